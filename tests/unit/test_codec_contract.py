"""Every registered transfer method honours the same contract (parametrised over CODECS)."""

import dataclasses
from typing import get_args

import pytest
import torch

from shared.artifacts import store
from shared.codecs import CODECS, CodecConfig, CodecContext, DecodeJob, make_method, method_config
from shared.codecs.scd import PairArtifacts
from shared.domain import LayerReceived
from shared.errors import DataLoss, InvalidPayload
from shared.rpc import scd_pb2 as pb
from shared.rpc.wire import FrameDecoder, StreamTotals, layer_frames

IDS = torch.randint(0, 256, (161,), generator=torch.Generator().manual_seed(9)).tolist()


def test_registry_keys_match_config_union():
    members = get_args(get_args(CodecConfig)[0])
    assert {m.model_fields["kind"].default for m in members} == set(CODECS)


@pytest.fixture(scope="module")
def contexts(tiny_pair, tiny_artifacts, tiny_droidspeak, tiny_spectrum, tiny_ridge):
    producer, consumer = tiny_pair
    folder, _ = tiny_artifacts
    meta, pt = store.load(folder, "producer")
    _, ct = store.load(folder, "consumer")
    profiles = {"droidspeak": tiny_droidspeak, "spectrum": tiny_spectrum, "ridge": tiny_ridge}
    return (CodecContext(producer, PairArtifacts(meta, pt, "producer"), profiles),
            CodecContext(consumer, PairArtifacts(meta, ct, "consumer"), profiles))


def _transfer(kind, pctx, cctx, start=0, params=None, compression="zstd"):
    """encode every layer -> frames (``compression``) -> decoder -> decode; returns (cache, payload
    bytes, encoded)."""
    enc, dec = make_method(kind, pctx, params), make_method(kind, cctx, params)
    state = pctx.model.prefill(IDS[:-1], hidden_layers=enc.hidden_layers(), residual_layers=enc.residual_layers())
    own = cctx.model.prefill(IDS[:-1])
    job = DecodeJob(IDS, len(IDS) - 1, start, tuple(k[:, :, :start] for k in own.keys),
                    tuple(v[:, :, :start] for v in own.values))
    session = dec.start(job)
    totals, fd = StreamTotals(), FrameDecoder(n_layers=pctx.model.n_layers)
    fd.feed(pb.KVFrame(header=pb.Header(n_layers=pctx.model.n_layers)))
    encoded = []
    if enc.transfers_layers:
        for layer in range(pctx.model.n_layers):
            tensors = enc.encode_layer(state, layer, start)
            schema = session.schema(layer)  # what the method declares is exactly what it sends
            assert set(tensors) == set(schema), (layer, sorted(tensors), sorted(schema))
            assert not [n for n, t in tensors.items() if schema[n].mismatch(t.dtype, tuple(t.shape))]
            encoded.append(tensors)
            for f in layer_frames(layer, tensors, compression=compression):
                out = fd.feed(totals.add(f))
            assert isinstance(out, LayerReceived) and out.layer == layer
            got = out.tensors
            assert {k: (v.dtype, v.shape) for k, v in got.items()} == \
                {k: (v.dtype, v.shape) for k, v in tensors.items()}
            session.add_layer(layer, got)
    fd.feed(totals.trailer())
    return session.finish(), totals.payload_bytes, encoded


@pytest.mark.parametrize("kind", sorted(CODECS))
def test_round_trip_shapes_dtypes_and_determinism(kind, contexts):
    pctx, cctx = contexts
    cache, _, enc1 = _transfer(kind, pctx, cctx)
    m = cctx.model
    for layer in range(m.n_layers):
        k, v = cache.layers[layer].keys, cache.layers[layer].values
        assert k.shape == v.shape == (1, m.n_kv_heads, len(IDS) - 1, m.head_dim)
        assert k.dtype == v.dtype == m.dtype
    _, _, enc2 = _transfer(kind, pctx, cctx)
    for a, b in zip(enc1, enc2):
        assert all(torch.equal(a[n], b[n]) for n in a)


def _lies(tensors):
    """A consistent liar's versions of one layer (checksums would be right): each must be refused."""
    name = max(tensors, key=lambda n: tensors[n].numel())
    t = tensors[name]
    yield "missing", InvalidPayload, {n: v for n, v in tensors.items() if n != name}
    yield "extra", InvalidPayload, {**tensors, "extra": torch.zeros(2, dtype=torch.uint8)}
    other = torch.int32 if t.dtype != torch.int32 else torch.float16
    yield "dtype", InvalidPayload, {**tensors, name: t.to(other)}
    for each, u in tensors.items():  # every tensor, e.g. a [1] scale that would broadcast over its rows
        one = torch.ones(1, dtype=u.dtype)
        if u.shape != one.shape:
            yield f"broadcast {each}", InvalidPayload, {**tensors, each: one}
    if t.numel() > 1:
        yield "rows", InvalidPayload, {**tensors, name: t.reshape(-1)[1:].clone() if t.dim() == 1 else t[:-1].clone()}
    floats = [n for n, v in tensors.items() if v.is_floating_point() and v.numel()]
    if floats:
        bad = tensors[floats[0]].clone()
        bad[(0,) * bad.dim()] = float("nan")
        yield "nan", DataLoss, {**tensors, floats[0]: bad}
        bad = tensors[floats[0]].clone()
        bad[(-1,) * bad.dim()] = float("inf")
        yield "inf", DataLoss, {**tensors, floats[0]: bad}


@pytest.mark.parametrize("kind,params", [(k, {}) for k in sorted(CODECS)] + [
    ("ridge", {"k_bits": "6", "v_bits": "8"}), ("ridge", {"budget": "0.4", "fp16_share": "0"}),
    ("spectrum", {"int4": "off"})])
def test_settings_read_back_from_the_wire_as_they_were_sent(kind, params):
    """The wire carries settings as strings: every field of every method's settings, numbers and
    words alike ("16", "on"), must read back to the same settings on the other side."""
    cfg = method_config(kind, params)
    assert method_config(kind, cfg.wire_params()) == cfg


LAYOUTS = [(k, {}) for k, c in sorted(CODECS.items()) if c.transfers_layers] + [
    ("ridge", {"k_bits": "6", "v_bits": "8"}), ("ridge", {"v_bits": "4"})]
"""Every layer-transferring method, and the settings that change what crosses the wire."""


@pytest.mark.parametrize("kind,params", LAYOUTS, ids=lambda x: x if isinstance(x, str) else ";".join(x.values()))
def test_a_consistent_liar_is_refused_at_every_layer(kind, params, contexts):
    """Names, dtypes and shapes are checked against the method's declared schema, floats must be
    finite: a wrong row count, a [1]-shaped scale that would broadcast, another dtype, NaN or Inf."""
    pctx, cctx = contexts
    enc, dec = make_method(kind, pctx, params), make_method(kind, cctx, params)
    state = pctx.model.prefill(IDS[:-1], hidden_layers=enc.hidden_layers(), residual_layers=enc.residual_layers())
    session = dec.start(DecodeJob(IDS, len(IDS) - 1, 0))
    for layer in range(pctx.model.n_layers):
        tensors = enc.encode_layer(state, layer, 0)
        for case, err, lie in _lies(tensors):  # a refused layer changes nothing: the session goes on
            with pytest.raises(err):
                session.add_layer(layer, lie)
            assert case
        session.add_layer(layer, tensors)
    session.finish()


@pytest.mark.parametrize("kind", sorted(k for k, c in CODECS.items() if not c.cross_model))
def test_same_model_methods_are_exact_or_within_bound(kind, contexts):
    pctx, _ = contexts
    same = CodecContext(pctx.model)
    variants = {"raw": ({}, {"dtype": "float32"}), "spectrum": ({"int4": "on"}, {"int4": "off", "budget": "0.6"})}
    for params in variants.get(kind, ({},)):
        method = make_method(kind, same, params)
        cache, _, _ = _transfer(kind, same, same, params=params)
        native = same.model.own_cache(IDS[:-1])
        for layer in range(same.model.n_layers):
            for got, ref in ((cache.layers[layer].keys, native.layers[layer].keys),
                             (cache.layers[layer].values, native.layers[layer].values)):
                err = float((got - ref).norm() / ref.norm())
                if method.lossless:
                    assert err < 1e-5, f"{kind}{params} layer {layer}: lossless but rel err {err}"
                else:
                    assert err <= method.error_bound(), f"{kind}{params} layer {layer}: {err} > {method.error_bound()}"


@pytest.mark.parametrize("kind", sorted(k for k, c in CODECS.items() if c.cross_model))
def test_cross_model_methods_beat_raw_against_the_consumers_own_cache(kind, contexts):
    pctx, cctx = contexts
    cache, _, _ = _transfer(kind, pctx, cctx)
    raw, _, _ = _transfer("raw", pctx, cctx, params={"dtype": "float32"})
    native = cctx.model.own_cache(IDS[:-1])

    def err(c):  # over the layers the tiny pair's planted change (layer 2) drifts; 0-1 are identical
        return sum(float((c.layers[l].values - native.layers[l].values).norm() / native.layers[l].values.norm())
                   for l in range(2, cctx.model.n_layers))

    assert err(cache) < err(raw), (err(cache), err(raw))


@pytest.mark.parametrize("kind", sorted(k for k, c in CODECS.items() if c.compressive))
def test_compressive_methods_send_fewer_bytes_than_raw(kind, contexts):
    pctx, cctx = contexts
    _, nbytes, _ = _transfer(kind, pctx, cctx)
    _, raw_bytes, _ = _transfer("raw", pctx, cctx)
    assert nbytes < raw_bytes, (nbytes, raw_bytes)


@pytest.mark.parametrize("kind", sorted(CODECS))
def test_native_prefix_splices_the_consumers_own_kv(kind, contexts):
    pctx, cctx = contexts
    cache, _, _ = _transfer(kind, pctx, cctx, start=5)
    own = cctx.model.build_cache(*(lambda s: (s.keys, s.values))(cctx.model.prefill(IDS[:-1])))
    for layer in range(cctx.model.n_layers):
        torch.testing.assert_close(cache.layers[layer].values[:, :, :5], own.layers[layer].values[:, :, :5])


def test_wrong_method_version_and_fingerprint_are_refused(tiny_pair):
    from consumer_service.engine import ConsumerEngine
    from consumer_service.settings import ConsumerSettings
    from shared.errors import FingerprintMismatch, PreconditionFailed
    from shared.rpc.convert import header_from_pb
    from shared.rpc.wire import PROTOCOL_VERSION

    _, consumer = tiny_pair
    eng = ConsumerEngine(ConsumerSettings.load(model={"path": "-"}, producer_fingerprint="abc", methods=["raw"]),
                         consumer.model)
    h = header_from_pb(pb.Header(method="raw", method_version=1, protocol_version=PROTOCOL_VERSION,
                                 pair_fingerprint="abc:raw", n_layers=consumer.n_layers, n_tokens=len(IDS) - 1,
                                 prompt_ids=IDS))
    eng.open(h)
    for field, value, exc, says in (("method_version", 99, PreconditionFailed, "update the consumer"),
                                    ("protocol_version", 99, PreconditionFailed, "update the consumer"),
                                    ("pair_fingerprint", "zzz:raw", FingerprintMismatch, "recalibrate")):
        with pytest.raises(exc, match=says):
            eng.open(dataclasses.replace(h, **{field: value}))
    eng.close()


def test_droidspeak_profile_recomputes_the_planted_layer(tiny_droidspeak):
    (a, b), = tiny_droidspeak["blocks"]
    assert a <= 2 < b and tiny_droidspeak["report"]["kl"] < tiny_droidspeak["report"]["raw_kl"]


def test_droidspeak_recompute_is_exact_between_identical_models(contexts):
    """Same model both sides: the recomputed block equals the native cache (fp16 on the wire)."""
    pctx, _ = contexts
    same = CodecContext(pctx.model)
    cache, nbytes, _ = _transfer("droidspeak", same, same, params={"blocks": "1-3"})
    native = same.model.own_cache(IDS[:-1])
    for layer in (1, 2):
        want = native.layers[layer].values
        err = float((cache.layers[layer].values - want).norm() / want.norm())
        assert err < 5e-3, err


def test_spectrum_allocation_protects_sinks_and_spends_the_budget():
    from shared.codecs.spectrum import FP16, INT4, INT8, allocate, tier_costs

    imp = torch.rand(200, generator=torch.Generator().manual_seed(3))
    imp[:4] = 0.0  # sinks score nothing here, yet stay fp16
    for budget, int4 in ((0.5, True), (0.7, True), (0.7, False)):
        tiers = allocate(imp, 4, budget, int4, 32, 0.5)
        assert (tiers[:4] == FP16).all()
        costs = tier_costs(32)
        spent = sum(costs[t] * int((tiers == t).sum()) for t in (FP16, INT8, INT4)) / len(tiers)
        assert budget - 0.02 <= spent <= budget + 1e-9, (budget, int4, spent)
        assert int4 or not (tiers == INT4).any()
        order = imp.clone()
        order[:4] = float("inf")
        fp = order[tiers == FP16].min()
        assert (order[tiers != FP16] <= fp).all()  # the most attended tokens get the fp16 slots


def test_spectrum_ranks_by_attention_from_the_window(contexts):
    pctx, _ = contexts
    m = make_method("spectrum", CodecContext(pctx.model), {"int4": "on"})
    state = pctx.model.prefill(IDS[:-1], hidden_layers=m.hidden_layers())
    imp = m.importance(state, 1)
    w = m.cfg.window
    assert imp.shape == (len(IDS) - 1,)
    # each of the window's queries spreads one unit of attention per head over the positions it sees
    n_q_heads = pctx.model.config.num_attention_heads
    torch.testing.assert_close(imp.sum(), torch.tensor(float(w * n_q_heads)), rtol=1e-4, atol=1e-3)


def test_spectrum_probe_result_drives_auto_int4(tiny_spectrum):
    assert isinstance(tiny_spectrum["int4"], bool)
    trials = tiny_spectrum["report"]["trials"]
    assert len(trials) == 3
    # the two-tier policy keeps at least the three-tier policy's fidelity to fp16
    assert all(t["two_tier"]["kl_vs_fp16"] <= t["three_tier"]["kl_vs_fp16"] + 1e-6 for t in trials)


def test_ridge_calibration_reduces_validation_kl_and_maps_from_top_k_layers(tiny_ridge):
    r = tiny_ridge["report"]
    assert r["kl"] < r["raw_kl"]
    k = tiny_ridge["top_k"]
    assert all(len(src) == k for src in tiny_ridge["sources"].values())
    # layers 0-1 of the tiny pair are identical, so each maps best from its own producer layer
    assert tiny_ridge["sources"]["0"][0] == 0 or 0 in tiny_ridge["sources"]["0"]


def test_ridge_recovers_a_planted_per_head_linear_map(tiny_pair):
    """A consumer whose layer-3 V is an exact linear function of the producer's layer-3 K/V per head
    is mapped almost exactly."""
    from shared.codecs import ridge as ridge_codec
    from tools.calibration import ridge

    producer, _ = tiny_pair
    L, H, D = producer.n_layers, producer.n_kv_heads, producer.head_dim
    g = torch.Generator().manual_seed(21)
    A = torch.randn(H, 2 * D, 2 * D, generator=g) / (2 * D) ** 0.5

    class Planted:
        n_layers, n_kv_heads, head_dim = L, H, D

        def prefill(self, ids):
            s = producer.prefill(ids)
            kv = torch.cat([s.keys[3][0], s.values[3][0]], -1) @ A  # [H, T, 2D]
            keys = list(s.keys)
            values = list(s.values)
            keys[3], values[3] = kv[..., :D].unsqueeze(0), kv[..., D:].unsqueeze(0)
            return type(s)(tuple(keys), tuple(values))

    prompts = [torch.randint(0, 256, (40,), generator=g).tolist() for _ in range(12)]
    moms = ridge.collect(producer, Planted(), prompts, progress=False)
    tensors, ranking, r2 = ridge.fit(moms, L, D, top_k=1, alpha=1e-6)
    assert ranking[3][0] == 3 and r2[3] > 0.999
    ids = prompts[0][:-1]
    s, t = producer.prefill(ids), Planted().prefill(ids)
    k, v = ridge_codec.apply(tensors, s.keys, s.values, 3, 0, D)
    assert float((v - t.values[3]).norm() / t.values[3].norm()) < 0.02


def _calibrate_tiny_joint(tiny_pair, tmp_path, seed, **settings):
    """The real pipeline on the tiny pair with the joint code and small settings: (prompts, val, cfg,
    folder, report)."""
    from tools.calibration.pipeline import CalibrationSettings, calibrate

    producer, consumer = tiny_pair
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (48,), generator=g).tolist() for _ in range(16)]
    val = [(torch.randint(0, 256, (40,), generator=g).tolist(), 0) for _ in range(3)]
    kinds = settings.pop("val_kinds", ())
    cfg = CalibrationSettings(**{"pair": "tiny", "n_prompts": 16, "r_kv": 40, "r_h": 32, "budget_k": 0, "n_val": 3,
                                 "ablations": False, **settings})
    folder, report = calibrate(producer, consumer, prompts, val, cfg, str(tmp_path), "test", progress=False,
                               val_kinds=kinds)
    return prompts, val, cfg, folder, report


def test_scd_with_a_joint_kv_code_round_trips_and_beats_raw(tiny_pair, tmp_path):
    """The joint [K | V] REUSE code (the default of `scd calibrate`): written, loaded, served."""
    from tools.calibration.pipeline import calibrate

    producer, consumer = tiny_pair
    prompts, val, cfg, folder, report = _calibrate_tiny_joint(tiny_pair, tmp_path, 15, block_layers=0)
    meta, pt = store.load(folder, "producer")
    _, ct = store.load(folder, "consumer")
    assert meta.reuse_code == "joint" and meta.r_kv == 40 and "enc.kv.0" in pt and "dec.kv.0" in ct
    assert report["validation"]["reuse_only_kl"] < report["validation"]["raw_kl"]
    pctx = CodecContext(producer, PairArtifacts(meta, pt, "producer"))
    cctx = CodecContext(consumer, PairArtifacts(meta, ct, "consumer"))
    cache, nbytes, enc = _transfer("scd", pctx, cctx)
    assert set(enc[0]) == {"zkv", "zkv_scale"} and enc[0]["zkv"].shape == (len(IDS) - 1, 40)
    raw, raw_bytes, _ = _transfer("raw", pctx, cctx, params={"dtype": "float32"})
    native = consumer.own_cache(IDS[:-1])

    def err(c):
        return sum(float((c.layers[l].values - native.layers[l].values).norm() / native.layers[l].values.norm())
                   for l in range(2, consumer.n_layers))

    assert err(cache) < err(raw)
    with pytest.raises(ValueError, match="r_kv=999"):
        calibrate(producer, consumer, prompts, val, cfg.model_copy(update={"r_kv": 999}), str(tmp_path), "x",
                  progress=False)


def served_entry(res: torch.Tensor, meta) -> torch.Tensor:
    """The entry state [T, hidden] as the consumer receives it: divided by its channels' scales,
    quantized per token to the calibrated levels, scaled back."""
    from shared.codecs.quant import dequantize_rows, quantize_rows
    from shared.codecs.scd import channel_scale

    c = channel_scale(res).float() if "r" in meta.code_channel else torch.ones(res.shape[1])
    return dequantize_rows(*quantize_rows(res / c, meta.code_levels.get("r", 8))) * c


def test_scd_patch_block_is_selected_streamed_and_recomputed_natively(tiny_pair, tmp_path):
    """A PATCH block: calibration slides it over the depth and keeps the best; the producer sends the
    entry residual state once (int8), the consumer's own layers give the block's K/V."""
    from tools.calibration.pipeline import calibrate

    producer, consumer = tiny_pair
    prompts, val, cfg, folder, report = _calibrate_tiny_joint(tiny_pair, tmp_path, 16, block_layers=2,
                                                                       ablations=True)
    assert [s["block"] for s in report["block_scan"]] == [[0, 2], [1, 3], [2, 4]]
    meta, pt = store.load(folder, "producer")
    _, ct = store.load(folder, "consumer")
    (a, b), = meta.patch_blocks
    assert report["patch_block"] == [a, b]
    assert report["validation"]["block_kl"] < report["validation"]["reuse_only_kl"]
    assert min(s["kl"] for s in report["block_scan"]) == report["validation"]["block_kl"]
    lengths = {x["layers"]: x for x in report["ablation_block_length"]}
    assert lengths[2]["block"] == [a, b] and lengths[2]["kl"] == pytest.approx(report["validation"]["block_kl"])
    assert all(x["block"][1] <= producer.n_layers for x in lengths.values())
    pctx = CodecContext(producer, PairArtifacts(meta, pt, "producer"))
    cctx = CodecContext(consumer, PairArtifacts(meta, ct, "consumer"))
    cache, nbytes, enc = _transfer("scd", pctx, cctx)
    assert meta.code_channel == ["r", "qkv"]  # the default: entry states carry per-channel scales
    assert set(enc[a]) == {"r", "r_scale", "r_channel"} and enc[a]["r"].shape == (len(IDS) - 1, producer.hidden_size)
    assert all(set(enc[l]) == {"skip"} for l in range(a + 1, b))
    reuse, reuse_bytes, _ = _transfer("scd", pctx, cctx, params={"patch_blocks": "none"})
    assert reuse_bytes != nbytes
    # inside the block the K/V are the consumer's own layers run on the producer's (int8) entry state:
    # divided by its channels' scales, quantized per token to the calibrated levels, scaled back
    res = producer.prefill(IDS[:-1], residual_layers=[a]).residual[a][0].float()
    from shared.codecs.scd import channel_scale
    assert torch.equal(enc[a]["r_channel"].float(), channel_scale(res).float())
    _, ks, vs = consumer.run_layers(served_entry(res, meta).unsqueeze(0), a, b)
    for j, layer in enumerate(range(a, b)):
        assert torch.allclose(cache.layers[layer].values, vs[j], atol=1e-5)
        assert not torch.allclose(reuse.layers[layer].values, vs[j], atol=1e-3)
    with pytest.raises(ValueError, match="block_layers=4"):
        calibrate(producer, consumer, prompts, val, cfg.model_copy(update={"block_layers": 4}), str(tmp_path), "x",
                  progress=False)


def _variant(meta, pt, ct, **update):
    """Artifacts of the same calibration with another block, exit layer or per-layer ranks (the
    REUSE maps of a lowered layer truncated to its rank), and no fallback layer unless given."""
    meta = meta.model_copy(update={"fallback_layers": [], "reuse_fallback_layers": [], **update})
    pt, ct = dict(pt), dict(ct)
    for layer, r in meta.layer_ranks.items():
        pt[f"enc.kv.{layer}"] = pt[f"enc.kv.{layer}"][:, :r].contiguous()
        ct[f"dec.kv.{layer}"] = ct[f"dec.kv.{layer}"][:r].contiguous()
    return PairArtifacts(meta, pt, "producer"), PairArtifacts(meta, ct, "consumer")


def test_scd_block_exit_layer_is_native_from_the_blocks_output_and_costs_no_bytes(tiny_pair, tmp_path):
    """With ``block_exit_kv`` the layer after the block sends nothing and its K/V are the consumer's
    own projections of the block's output state; without it, the REUSE code crosses."""

    producer, consumer = tiny_pair
    *_, folder, _ = _calibrate_tiny_joint(tiny_pair, tmp_path, 17, block_layers=2, block_exit_kv="off")
    meta, pt = store.load(folder, "producer")
    _, ct = store.load(folder, "consumer")
    a, b = 0, 2
    out = {}
    for exit_kv in (False, True):
        p, c = _variant(meta, pt, ct, patch_blocks=[(a, b)], patch_layers=[], block_exit_kv=exit_kv)
        out[exit_kv] = _transfer("scd", CodecContext(producer, p), CodecContext(consumer, c))
    (cache, nbytes, enc), (cache0, nbytes0, enc0) = out[True], out[False]
    assert set(enc[b]) == {"skip"} and set(enc0[b]) == {"zkv", "zkv_scale"} and nbytes < nbytes0
    res = producer.prefill(IDS[:-1], residual_layers=[a]).residual[a]
    h, _, _ = consumer.run_layers(served_entry(res[0].float(), meta).unsqueeze(0), a, b)
    k, v = consumer.kv_from_residual(b, h)
    assert torch.allclose(cache.layers[b].values, v, atol=1e-5)
    assert torch.allclose(cache.layers[b].keys, consumer.apply_rope(k), atol=1e-5)
    assert not torch.allclose(cache0.layers[b].values, v, atol=1e-3)
    for layer in range(b + 1, producer.n_layers):  # the layers after it are REUSE in both
        assert torch.equal(cache.layers[layer].values, cache0.layers[layer].values)


def test_scd_per_layer_ranks_are_declared_sent_and_checked(tiny_pair, tmp_path):
    """A lowered layer's code has its own width on the wire and in the schema; a producer that
    sends the full rank there is refused before decoding."""
    producer, consumer = tiny_pair
    *_, folder, _ = _calibrate_tiny_joint(tiny_pair, tmp_path, 18, block_layers=2, block_exit_kv="off")
    meta, pt = store.load(folder, "producer")
    _, ct = store.load(folder, "consumer")
    p, c = _variant(meta, pt, ct, patch_blocks=[(2, 4)], patch_layers=[], layer_ranks={0: 8, 1: 16})
    cache, nbytes, enc = _transfer("scd", CodecContext(producer, p), CodecContext(consumer, c))
    assert enc[0]["zkv"].shape == (len(IDS) - 1, 8) and enc[1]["zkv"].shape == (len(IDS) - 1, 16)
    full, full_bytes, _ = _transfer("scd", *(CodecContext(m, PairArtifacts(meta.model_copy(
        update={"patch_blocks": [(2, 4)], "patch_layers": []}), t, side)) for m, t, side in
        ((producer, pt, "producer"), (consumer, ct, "consumer"))))
    assert nbytes < full_bytes
    dec = make_method("scd", CodecContext(consumer, c))
    session = dec.start(DecodeJob(IDS, len(IDS) - 1, 0))
    wide = make_method("scd", CodecContext(producer, PairArtifacts(meta, pt, "producer")))
    state = producer.prefill(IDS[:-1])
    with pytest.raises(InvalidPayload, match="layer 0"):
        session.add_layer(0, wide.encode_layer(state, 0, 0))


def test_calibration_lowers_the_rank_before_the_block_within_its_tolerance(tiny_pair, tmp_path):
    _, _, cfg, folder, report = _calibrate_tiny_joint(tiny_pair, tmp_path, 19, block_layers=2,
                                                      pre_block_ranks=[8], tolerance=100.0)
    meta, pt = store.load(folder, "producer")
    (a, _), = meta.patch_blocks
    lowered = {l: 8 for l in range(a) if l not in meta.patch_layers}
    assert meta.layer_ranks == lowered
    assert lowered, f"the tiny pair's block starts at layer {a}: no layer before it to lower"
    assert [pt[f"enc.kv.{l}"].shape[1] for l in range(meta.n_layers)] == \
        [lowered.get(l, cfg.r_kv) for l in range(meta.n_layers)]
    assert report["pre_block_rank"]["rank"] == 8 and report["ablation_pre_block_rank"][0]["rank"] == 8
    # with no tolerance the full rank stays where the lower one loses anything
    *_, folder, report = _calibrate_tiny_joint(tiny_pair, tmp_path / "strict", 19, block_layers=2,
                                               pre_block_ranks=[1], tolerance=0.0)
    low = report["ablation_pre_block_rank"][0]
    assert (store.load_meta(folder).layer_ranks == {}) == (low["kl"] > report["selected_kl"])
