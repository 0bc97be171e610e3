"""The TTFT benchmark's service features (warm prefill cache, no_pipelining) in-process, and ``scd bench``
in its smallest form over real network namespaces with tiny models (no timings asserted)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from consumer_service.engine import ConsumerEngine
from consumer_service.settings import ConsumerSettings
from producer_service.engine import ProducerEngine
from producer_service.settings import ProducerSettings
from shared.model.tiny import perturbed, tiny_model
from tools import client
from tools.inprocess import InProcessServices

PROMPT = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(9)).tolist()


@pytest.fixture(scope="module")
def services():
    base = tiny_model("llama", n_layers=4)
    cs = ConsumerSettings.load(model={"path": "unused"}, server={"port": 0}, name="c", methods=["oracle", "raw"],
                               bench={"hold_layers": True})
    consumer = ConsumerEngine(cs, perturbed(base, 0.2))

    def make_producer(addresses):
        s = ProducerSettings.load(model={"path": "unused"}, server={"port": 0}, default_method="raw",
                                  methods=["oracle", "raw"], prefill_cache_entries=2, bench={"hold_layers": True},
                                  consumers={n: {"address": a} for n, a in addresses.items()})
        return ProducerEngine(s, base)

    with InProcessServices([consumer], make_producer) as svc:
        yield svc


def _gen(svc, prompt=PROMPT, no_pipelining=False, **kw):
    req = client.request(prompt, "c", kw.pop("method", "raw"), max_new_tokens=kw.pop("n", 6), **kw)
    return client.generate(svc.producer_address, req, timeout=60, metadata=client.BENCH_HOLD if no_pipelining else ())


def test_prefill_cache_serves_a_repeated_prompt_identically(services):
    eng = services.producer_engine
    eng.clear_prefill_cache()
    first = _gen(services)
    assert len(eng._prefills) == 1
    again = _gen(services)
    assert again.token_ids == first.token_ids
    assert again.timings.wire_bytes == first.timings.wire_bytes
    assert len(eng._prefills) == 1  # a hit, not a second entry
    others = [PROMPT[:-i] for i in (1, 2, 3)]
    for p in others:
        _gen(services, prompt=p, n=1)
    assert len(eng._prefills) == 2  # bounded: least recently used evicted
    assert tuple(PROMPT[:-1]) not in eng._prefills


def test_prefill_cache_keeps_one_state_per_prompt_with_every_captured_layer(services):
    """Keyed by the prompt alone: a method that needs a layer the cached state lacks redoes the
    prefill capturing both sets, and later requests of either kind hit it."""
    from types import SimpleNamespace

    from producer_service.engine import Prepared

    eng = services.producer_engine
    eng.clear_prefill_cache()

    def prepared(hidden=(), residual=()):
        m = SimpleNamespace(transfers_layers=True, hidden_layers=lambda: hidden, residual_layers=lambda: residual)
        return Prepared(None, PROMPT, 0, m, "")

    s1, hit1 = eng.prefill(prepared(hidden=(1,)))
    s2, hit2 = eng.prefill(prepared(residual=(2,)))
    s3, hit3 = eng.prefill(prepared(hidden=(1,), residual=(2,)))
    assert (hit1, hit2, hit3) == (False, False, True) and s3 is s2 and s1 is not s2
    assert set(s2.hidden) == {1} and set(s2.residual) == {2}
    assert torch.equal(s2.hidden[1], s1.hidden[1])
    assert list(eng._prefills) == [tuple(PROMPT[:-1])]


def test_prefill_cache_holds_at_most_its_byte_budget(services, monkeypatch):
    eng = services.producer_engine
    eng.clear_prefill_cache()
    gauge = lambda: services._servicer.metrics.value("prefill_cache_bytes")  # noqa: E731
    _gen(services, n=1)
    one = eng._prefills[tuple(PROMPT[:-1])].nbytes
    assert one > 0 and eng.prefill_cache_nbytes == one == gauge()
    # room for one state of this length: a second prompt evicts the first, whatever the entry count
    monkeypatch.setattr(eng, "settings", eng.settings.model_copy(update={"prefill_cache_bytes": one + one // 2}))
    _gen(services, prompt=PROMPT[1:], n=1)
    assert list(eng._prefills) == [tuple(PROMPT[1:-1])]
    assert eng.prefill_cache_nbytes == eng._prefills[tuple(PROMPT[1:-1])].nbytes == gauge()
    # a state larger than the whole budget is served but not kept, and evicts nothing
    monkeypatch.setattr(eng, "settings", eng.settings.model_copy(update={"prefill_cache_bytes": one // 2}))
    assert _gen(services, n=1).token_ids
    assert list(eng._prefills) == [tuple(PROMPT[1:-1])]
    eng.clear_prefill_cache()
    assert gauge() == 0


def test_prefill_cache_off_by_default():
    assert ProducerSettings.load(model={"path": "unused"}).prefill_cache_entries == 0


def test_no_pipelining_gives_the_same_tokens_and_bytes(services, monkeypatch):
    eng = services.producer_engine
    seen = []
    layers = eng.layers
    monkeypatch.setattr(eng, "layers", lambda p, stats, hold=False: seen.append(hold) or layers(p, stats, hold))
    piped = _gen(services, method_params={"dtype": "float32"})
    held = _gen(services, method_params={"dtype": "float32"}, no_pipelining=True)
    assert seen == [False, True]
    assert held.token_ids == piped.token_ids
    assert held.timings.payload_bytes == piped.timings.payload_bytes > 0
    assert held.timings.wire_bytes == piped.timings.wire_bytes  # the protocol does not carry the bench switch
    oracle = _gen(services, method="oracle", no_pipelining=True)
    assert len(oracle.token_ids) == 6 and oracle.timings.payload_bytes == 0


def test_bench_hold_is_ignored_unless_the_server_enables_it(monkeypatch):
    """In production (bench.hold_layers off) a client cannot make the services hold layers."""
    base = tiny_model("llama", n_layers=2)
    cs = ConsumerSettings.load(model={"path": "unused"}, server={"port": 0}, name="c", methods=["raw"])

    def make_producer(addresses):
        s = ProducerSettings.load(model={"path": "unused"}, server={"port": 0}, default_method="raw", methods=["raw"],
                                  consumers={n: {"address": a} for n, a in addresses.items()})
        return ProducerEngine(s, base)

    with InProcessServices([ConsumerEngine(cs, base)], make_producer) as svc:
        seen = []
        layers = svc.producer_engine.layers
        monkeypatch.setattr(svc.producer_engine, "layers",
                            lambda p, stats, hold=False: seen.append(hold) or layers(p, stats, hold))
        _gen(svc, no_pipelining=True)
        assert seen == [False]


# ------------------------------------------------------------------ scd bench over network namespaces
def _netns_unavailable() -> str:
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return f"needs {missing} (iproute2)"
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    return ""


needs_netns = pytest.mark.skipif(bool(_netns_unavailable()), reason=_netns_unavailable() or "ok")


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-models")
    base = tiny_model("llama", n_layers=4)
    out = []
    for name, model in (("producer", base), ("consumer", perturbed(base, 0.2))):
        model.save_pretrained(root / name)
        (root / name / ".scd-complete").write_text("ok\n")
        out.append(str(root / name))
    return out


def _bench_cmd(tiny_dirs, tmp_path, *extra):
    p, c = tiny_dirs
    return [sys.executable, "-m", "tools.cli", "bench", "--producer-model", p, "--consumer-model", c, "--pair", "tiny",
            "--store", str(tmp_path / "store"), "--threads", "1", *extra]


def _left(pid: int) -> list[str]:
    from tools.bench.netns import namespaces

    return [n for n in namespaces() if n.endswith(f"-{pid}")]


@needs_netns
def test_bench_smallest_form(tiny_dirs, tmp_path):
    from shared.codecs import CODECS, method_config
    from shared.model.loading import folder_fingerprint

    out = tmp_path / "bench.json"
    raw_cfg = method_config("raw").fingerprint()
    served_raw = f"{folder_fingerprint(tiny_dirs[0])}:raw.v{CODECS['raw'].version}:{raw_cfg}:"
    kl_file = tmp_path / "eval.json"  # raw as this run serves it; the Oracle as another producer served it
    consumer = folder_fingerprint(tiny_dirs[1])
    kl_file.write_text(json.dumps({"native_prefix": "off", "models": {"consumer": consumer}, "methods": {
        "raw": {"kl": 0.25, "identity": served_raw},
        "oracle": {"kl": 0.0, "identity": "0" * 16 + ":oracle.v1:0:"}}}))
    proc = subprocess.Popen(_bench_cmd(tiny_dirs, tmp_path, "--methods", "oracle,raw", "--bandwidths", "100",
                                       "--tokens", "120", "--repeats", "1", "--json", str(out),
                                       "--kl-json", str(kl_file)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr[-3000:]
    assert not _left(proc.pid), "the benchmark left its namespaces behind"
    line = json.loads(stdout.strip().splitlines()[-1])
    res = json.loads(out.read_text())
    assert set(line["methods"]) == set(res["methods"]) == {"oracle", "raw"}
    for v in res["methods"].values():
        assert {"warm_ttft_ms", "cold_ttft_ms", "bytes", "floor_ms", "link_mbit"} <= set(v)
        assert v["link_mbit"] == 100 and v["warm_ttft_ms"] > 0 and v["cold_ttft_ms"] > 0
        assert v["floor_ms"] > v["bytes"] * 8 / 100e3  # bytes / rate, plus a decode step
    raw, oracle = res["methods"]["raw"], res["methods"]["oracle"]
    assert raw["bytes"] > 10 * oracle["bytes"] > 0  # raw ships K/V; the Oracle only the ids
    assert raw["prompt_tokens"] == 120
    rows = {r["method"]: r for r in res["rows"]}
    assert rows["raw"]["nopipe"]["n"] == 1 and rows["raw"]["cold"]["n"] == 1 and rows["raw"]["warm"]["n"] == 1
    assert rows["oracle"]["nopipe"] is None and rows["raw"]["goodput_mbit"] > 0
    assert "tbf" in res["config"]["qdiscs"]["100"] and "100Mbit" in res["config"]["qdiscs"]["100"]
    assert "raw_goodput_100mbit" in res["targets"]
    assert raw["kl"] == 0.25 and oracle["kl"] is None  # only the KL measured with what this run served
    assert list(res["config"]["kl_unused"]) == ["oracle"] and "producer weights" in res["config"]["kl_unused"]["oracle"]
    assert "KL from" in stdout and "not used for: oracle (measured with other producer weights" in stdout
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_netns
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_bench_cleans_up_on_signal(tiny_dirs, tmp_path, sig):
    import signal
    import time

    sig = getattr(signal, sig)
    # SIGINT's default disposition for the bench, as from a terminal (a background job inherits it
    # ignored), set here and inherited through exec: no Python may run between fork and exec, since
    # this process may hold gRPC threads of earlier tests (a preexec_fn child aborted with SIGABRT)
    old = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        proc = subprocess.Popen(_bench_cmd(tiny_dirs, tmp_path, "--methods", "raw", "--bandwidths", "10",
                                           "--tokens", "400", "--repeats", "200"),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, old)
    try:
        t0 = time.monotonic()
        while len(_left(proc.pid)) < 2 and time.monotonic() - t0 < 60 and proc.poll() is None:
            time.sleep(0.2)
        assert len(_left(proc.pid)) == 2, "namespaces never appeared"
        time.sleep(3)  # services starting or serving
        proc.send_signal(sig)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert not _left(proc.pid), f"{sig!r} left namespaces behind"
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tiny_dirs[0]) not in ps, "a service outlived the benchmark"


def interrupt_when_shown(cmd: list[str], marker: bytes, env: dict | None = None, wait_s: float = 240) -> tuple:
    """Run a benchmark command with SIGINT's default disposition (as from a terminal; see the test
    above), send it SIGINT once its progress bar shows ``marker`` (the point or policy it measures
    now), and return (the process, its stdout)."""
    import os
    import signal
    import time

    old = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    finally:
        signal.signal(signal.SIGINT, old)
    try:
        os.set_blocking(proc.stderr.fileno(), False)
        seen, t0 = b"", time.monotonic()
        while marker not in seen.split(b"\r")[-1] and proc.poll() is None and time.monotonic() - t0 < wait_s:
            seen += proc.stderr.read() or b""
            time.sleep(0.2)
        assert marker in seen, seen[-2000:]
        proc.send_signal(signal.SIGINT)
        stdout, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, stdout


@needs_netns
def test_bench_interrupted_reports_the_points_it_measured(tiny_dirs, tmp_path):
    """Ctrl-C in a grid of an hour lost every result; the points whose requests were all made are
    now reported (table, JSON marked interrupted, final line), and the command exits 130."""
    out = tmp_path / "b.json"
    # the second link rate is slow: a raw request takes seconds there, the first point is quick
    proc, stdout = interrupt_when_shown(_bench_cmd(tiny_dirs, tmp_path, "--methods", "oracle,raw", "--bandwidths",
                                                   "1000,0.1", "--tokens", "120", "--repeats", "2", "--json",
                                                   str(out)), b"0.1 Mbit/s")
    assert proc.returncode == 130, stdout[-2000:]
    assert not _left(proc.pid)
    res = json.loads(out.read_text())
    assert res["config"]["interrupted"] and res["config"]["bandwidths_mbit"] == [1000]
    assert {(r["link_mbit"], r["method"]) for r in res["rows"]} == {(1000, "oracle"), (1000, "raw")}
    assert json.loads(stdout.decode().strip().splitlines()[-1])["headline"] == {"link_mbit": 1000, "tokens": 120}


def test_bench_refuses_without_privileges(monkeypatch):
    from tools.bench import netns

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(netns.BenchError, match="needs root"):
        netns.check_privileges()
    monkeypatch.setattr(netns.shutil, "which", lambda name: None)
    with pytest.raises(netns.BenchError, match="iproute2"):
        netns.check_privileges()


def test_the_final_timings_name_the_method_as_scd_eval_records_it(services):
    """``scd bench`` takes a method's KL from an ``scd eval`` file only where the eval measured what the
    producer served: the final timings carry the requested method's identity (producer weights, kind
    and version, settings, calibration pin), the string the eval harness records for the same method.
    Before, a bench beside artifacts recalibrated since the eval quoted the old KL (the committed
    results gave `scd` 0.189, measured fifteen rounds of calibration earlier, for today's 0.097)."""
    from shared.model.fingerprint import weights_fingerprint
    from tools.eval.harness import codec_method

    eng = services.producer_engine
    fp, ctx = weights_fingerprint(eng.adapter.model), eng.ctxs["c"]
    seen = {}
    for label, params in (("raw", {}), ("raw:dtype=float32", {"dtype": "float32"}), ("oracle", {})):
        kind = label.split(":")[0]
        got = _gen(services, method=kind, method_params=params, n=1).timings.method_identity
        assert got == codec_method(kind, ctx, ctx, params or None).identity(fp), label
        seen[label] = got
    assert len(set(seen.values())) == 3  # other settings, another method: another identity
    assert all(v.startswith(fp + ":") for v in seen.values())
    consumer = services.consumer_servers["c"].servicer.engine
    assert _gen(services, n=1).timings.consumer_fingerprint == weights_fingerprint(consumer.adapter.model)
