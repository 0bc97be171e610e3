"""Artifacts round-trip and refuse tampering; selection finds a planted sensitive layer."""

import json
import os

import pytest
import torch

from shared.artifacts import store
from shared.artifacts.meta import ArtifactMeta
from shared.errors import DataLoss, FingerprintMismatch, NotFound, PreconditionFailed
from tools.calibration.selection import greedy, restore_one


def _meta(**kw):
    base = dict(pair="p", producer_fingerprint="aaa", consumer_fingerprint="bbb", n_layers=2, n_kv_heads=1,
                head_dim=4, hidden_size=8, r_k=2, r_v=2, r_h=2, code_bits=8, center=True, patch_layers=[1],
                aligner_hidden=4)
    return ArtifactMeta(**{**base, **kw})


def test_artifacts_round_trip_and_tamper_refused(tmp_path):
    t = {"enc.k.0": torch.randn(4, 2)}
    folder = store.save(tmp_path, _meta(), t, {"dec.k.0": torch.randn(2, 4)})
    meta, got = store.load(folder, "producer", "aaa", "bbb")
    assert meta.patch_layers == [1] and torch.equal(got["enc.k.0"], t["enc.k.0"])
    with pytest.raises(FingerprintMismatch, match=r"run `scd calibrate --pair p` \(with --data PROMPTS.jsonl"):
        store.load(folder, "consumer", "aaa", "zzz")
    data = bytearray((folder / "consumer.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (folder / "consumer.safetensors").write_bytes(bytes(data))
    with pytest.raises(DataLoss, match="sha256"):
        store.load(folder, "consumer")
    with pytest.raises(NotFound, match="scd calibrate"):
        store.load(tmp_path / "missing", "producer")


@pytest.mark.parametrize("edit,error,match", [
    (lambda m: "{ not json", DataLoss, "is not JSON"),
    (lambda m: "[]", PreconditionFailed, "format None"),
    (lambda m: {**m, "format_version": 9}, PreconditionFailed, "format 9; this build reads 1"),
    (lambda m: {k: v for k, v in m.items() if k != "pair"}, PreconditionFailed,
     r"not a valid artifact manifest \(pair:"),
    (lambda m: {**m, "r_k": "wide"}, PreconditionFailed, "r_k: Input should be a valid integer"),
    (lambda m: {**m, "patch_layers": [1, 7]}, PreconditionFailed, r"patch_layers \[7\]: layers are 0..1"),
    (lambda m: {**m, "patch_blocks": [[1, 5]]}, PreconditionFailed, r"patch_blocks \[\[1, 5\]\]"),
    (lambda m: {**m, "fallback_layers": [-1]}, PreconditionFailed, "fallback_layers"),
    (lambda m: {**m, "layer_ranks": {"0": 0}}, PreconditionFailed, "layer_ranks"),
    (lambda m: {**m, "r_h": 0}, PreconditionFailed, "must be positive"),
])
def test_a_broken_or_edited_manifest_is_refused_at_load(tmp_path, edit, error, match):
    """meta.json is not under a hash of its own (it holds the others'): a manifest that does not
    parse, is of another format, or names layers the model does not have is refused at load with
    what to do, not a traceback or a failure per request."""
    folder = store.save(tmp_path, _meta(), {"a": torch.ones(1)}, {"b": torch.ones(1)})
    path = folder / "meta.json"
    body = edit(json.loads(path.read_text()))
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    with pytest.raises(error, match=match):
        store.load(folder, "consumer")


def test_an_invalid_profile_names_the_field(tmp_path):
    store.save_profile(tmp_path, "p", "droidspeak", {"blocks": "not a list"}, "pf", "cf")
    with pytest.raises(PreconditionFailed, match=r"not a valid droidspeak profile \(blocks: Input should be a valid"):
        store.load_profile(tmp_path, "p", "droidspeak")


def test_rewrite_is_atomic_and_leaves_no_temp(tmp_path):
    store.save(tmp_path, _meta(), {"a": torch.ones(1)}, {"b": torch.ones(1)})
    store.save(tmp_path, _meta(r_k=3), {"a": torch.zeros(1)}, {"b": torch.ones(1)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]
    assert json.loads((tmp_path / "p" / "meta.json").read_text())["r_k"] == 3


@pytest.mark.skipif(os.geteuid() != 0, reason="bind-mounting a folder needs root")
def test_a_pairs_folder_that_is_a_mount_point_is_rewritten_in_place(tmp_path):
    """A volume mounted at <store>/<pair> cannot be renamed: a whole calibration ended in EBUSY."""
    import subprocess

    store.save(tmp_path, _meta(), {"a": torch.ones(1)}, {"b": torch.ones(1)})
    folder = tmp_path / "p"
    subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
    try:
        store.save(tmp_path, _meta(r_k=3), {"a": torch.zeros(1)}, {"b": torch.ones(1)})
        assert json.loads((folder / "meta.json").read_text())["r_k"] == 3
        assert sorted(p.name for p in folder.iterdir()) == ["consumer.safetensors", "meta.json",
                                                           "producer.safetensors"]  # no temporary folder left
        assert store.load_meta(folder).r_k == 3
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_written_artifacts_are_readable_by_other_users(tmp_path):
    """Temporary files are private (0600); what the store publishes has the umask's mode, so a
    service running as another user can read it."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        folder = store.save(tmp_path, _meta(), {"a": torch.ones(1)}, {"b": torch.ones(1)})
        store.save_profile(tmp_path, "p", "ridge", {"top_k": 1}, "pf", "cf", tensors={"w": torch.ones(1)})
    finally:
        os.umask(old)
    paths = [folder, *folder.iterdir(), tmp_path / "p.ridge.json", tmp_path / "p.ridge.safetensors"]
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in paths} == \
        {p.name: 0o755 if p.is_dir() else 0o644 for p in paths}


def test_greedy_respects_budget_and_stops_without_gain():
    gains = {0: 0.1, 1: 0.5, 2: 0.0, 3: 0.2}
    f = lambda s: 1.0 - sum(gains[l] for l in s)  # noqa: E731
    sens = restore_one([0, 1, 2, 3], 1.0, f, progress=False)
    assert max(sens, key=sens.get) == 1
    path = greedy([1, 3, 0, 2], 8, 1.0, f, cost=lambda l: 1.0, progress=False)
    assert [p["layer"] for p in path] == [1, 3, 0]  # layer 2 brings nothing: the search stops
    path = greedy([1, 3, 0, 2], 8, 1.0, f, cost=lambda l: {1: 10.0}.get(l, 1.0), progress=False)
    assert path[0]["layer"] == 3  # gain per unit cost, not gain


def test_selection_picks_the_planted_layer(tiny_artifacts):
    folder, report = tiny_artifacts
    sens = {s["layer"]: s["gain"] for s in report["sensitivity"]}
    assert max(sens, key=sens.get) == 2, sens
    assert store.load_meta(folder).patch_layers == [2]
    v = report["validation"]
    assert report["selected_kl"] < v["reuse_only_kl"] and report["selected_kl"] < v["raw_kl"]


def test_profile_with_tensors_round_trips_and_a_tampered_file_is_refused(tmp_path):
    import torch

    from shared.artifacts import store
    from shared.errors import DataLoss, FingerprintMismatch

    t = {"w.0": torch.randn(2, 3), "src.0": torch.tensor([0], dtype=torch.int32)}
    store.save_profile(tmp_path, "p", "ridge", {"top_k": 1}, "pf", "cf", tensors=t)
    body = store.load_profile(tmp_path, "p", "ridge", "pf", "cf")
    assert body["top_k"] == 1 and torch.equal(body["tensors"]["w.0"], t["w.0"])
    with pytest.raises(FingerprintMismatch):
        store.load_profile(tmp_path, "p", "ridge", "other", "cf")
    path = tmp_path / "p.ridge.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(DataLoss, match="sha256"):
        store.load_profile(tmp_path, "p", "ridge")


@pytest.mark.parametrize("edit,match", [
    (lambda b: {**b, "format_version": 2}, "format 2"),
    (lambda b: {k: v for k, v in b.items() if k != "blocks"}, "not a valid droidspeak profile"),
    (lambda b: {**b, "blocks": "3-6"}, "not a valid droidspeak profile"),
    (lambda b: {**b, "unexpected": 1}, "not a valid droidspeak profile"),
])
def test_profiles_are_typed_and_their_format_checked(tmp_path, edit, match):
    import json

    from shared.artifacts import store
    from shared.errors import PreconditionFailed

    path = store.save_profile(tmp_path, "p", "droidspeak", {"blocks": [[1, 3]]}, "pf", "cf")
    body = store.load_profile(tmp_path, "p", "droidspeak")
    assert body["blocks"] == [(1, 3)] and len(body["pin"]) == 16
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    with pytest.raises(PreconditionFailed, match=match):
        store.load_profile(tmp_path, "p", "droidspeak")


def test_a_stream_encoded_with_other_calibration_data_is_refused(tmp_path):
    """The header pins the profile the producer used; a consumer that loaded another one refuses
    (or, with the recompute fallback, prefills itself)."""
    import json

    from consumer_service.engine import ConsumerEngine
    from consumer_service.settings import ConsumerSettings
    from shared.artifacts import store
    from shared.domain import SamplingRequest, StreamHeader
    from shared.errors import PreconditionFailed
    from shared.model.fingerprint import weights_fingerprint
    from shared.model.tiny import tiny_model
    from shared.rpc.wire import PROTOCOL_VERSION

    model = tiny_model("llama", n_layers=4)
    fp = weights_fingerprint(model)
    path = store.save_profile(tmp_path, "p", "droidspeak", {"blocks": [[1, 3]]}, fp, fp)
    pin = store.load_profile(tmp_path, "p", "droidspeak")["pin"]

    def engine(fallback):
        s = ConsumerSettings.load(model={"path": "unused"}, server={"port": 0}, name="p", methods=["droidspeak"],
                                  artifact_store=str(tmp_path), fallback=fallback)
        return ConsumerEngine(s, model)

    def header(their_pin):
        return StreamHeader(request_id="r", method="droidspeak", method_version=1, protocol_version=PROTOCOL_VERSION,
                            pair_fingerprint=f"{fp}:droidspeak.v1:x:{their_pin}", n_layers=4, n_tokens=9,
                            prompt_ids=tuple(range(1, 11)), params={}, sampling=SamplingRequest(max_new_tokens=2),
                            native_prefix=False, prefix_len=0, consumer="p", deadline_unix=0.0)

    assert engine("fail").open(header(pin)).fallback == ""
    path.write_text(json.dumps({**json.loads(path.read_text()), "blocks": [[2, 4]]}))  # recalibrated on one side
    with pytest.raises(PreconditionFailed, match="calibration data"):
        engine("fail").open(header(pin))
    assert engine("recompute").open(header(pin)).fallback == "artifacts"
