"""``scd bench --fleet``: one producer in front of every built-in consumer, mixed traffic, over the
shaped link between two network namespaces (as ``scd bench``).

The traffic: ``prompts`` distinct prompts of ``tokens`` tokens, each asked of every consumer (a shared
base model in front of specialists: the same context reaches several of them), the requests in a
seeded random order, ``clients`` of them in flight at once, one generated token each (TTFT). Every
policy gets its own fresh prompts (the producer's prefill cache starts cold for each), and compares:

- ``oracle``: each consumer prefills the prompt itself (token ids cross, no cache);
- one fixed method for every consumer (default ``raw`` and ``scd``);
- ``auto``: per request, the producer's choice from the consumer's operating table.

Reported per policy: throughput (requests / wall time), p50 / p99 TTFT (the producer's, request in ->
first token), wire bytes per request, and the mean validation KL of what was served, from each pair's
operating table (``<store>/<pair>.auto.json``; the Oracle's is 0; ``-`` when a pair has none).
Ratios are to the Oracle of the same run.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tools.assets.registry import calibrate_hint, uncalibrated
from tools.bench.netns import BenchError, Testbed, check_privileges
from tools.bench.runner import Prompts, _git, _until_interrupted, _vocab, check_variant, variant
from tools.bench.services import CONSUMER_PORT, PRODUCER_PORT, Services, ServiceSpec

POLICIES = ("oracle", "raw", "scd", "auto")


@dataclass
class FleetConfig:
    pairs: tuple[str, ...] = ("strong", "mild", "code", "verse")
    policies: tuple[str, ...] = POLICIES
    link_mbit: float = 1000.0
    tokens: int = 1000
    prompts: int = 6
    clients: int = 2
    seed: int = 0
    threads: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    argv: list[str] = field(default_factory=list)


class FleetServices(Services):
    """The producer and one consumer process per pair (ports from ``CONSUMER_PORT`` up), each consumer
    with its own model (or the producer's weights plus its LoRA adapter)."""

    def __init__(self, tb: Testbed, spec: ServiceSpec, log_dir: Path, members: list[tuple[str, str, str | None, str]]):
        super().__init__(tb, spec, log_dir)
        self.members = members  # (name, model folder, adapter, store)

    def start(self, timeout_s: float = 900.0) -> "FleetServices":
        s, tb = self.spec, self.tb
        common = ["--set", "server.grace_s=1", "--set", f"model.device={s.device}", "--set", f"model.dtype={s.dtype}"]
        concrete = [m for m in s.methods if m != "auto"]  # auto is the producer's choice; consumers see its pick
        links = []
        for i, (name, model, adapter, store) in enumerate(self.members):
            port = CONSUMER_PORT + 1 + i
            self._start("consumer", tb.consumer_ns, [
                "--name", name, "--model", model, *(["--adapter", adapter] if adapter else []),
                "--host", tb.consumer_addr, "--port", str(port), "--store", store, "--set",
                f"methods=[{','.join(concrete)}]", *common], name=f"consumer-{name}")
            links += ["--consumer", f"{name}={tb.consumer_addr}:{port}"]
        self.wait_listening(timeout_s)  # every consumer before the producer (see wait_listening)
        self._start("producer", tb.producer_ns, [
            *links, "--model", s.producer_model, "--host", tb.client_addr, "--port", str(PRODUCER_PORT),
            "--set", f"prefill_cache_entries={s.prefill_cache_entries}", "--set",
            f"prefill_cache_bytes={s.prefill_cache_bytes}", "--set", f"default_method={s.methods[0]}",
            "--store", s.store, "--set", f"methods=[{','.join(s.methods)}]", *common])
        return self.wait_listening(timeout_s)


def _members(cfg: FleetConfig):
    from shared.model.loading import load_tokenizer
    from tools.assets import registry

    reg = registry.load().pairs
    missing = [p for p in cfg.pairs if p not in reg]
    if missing:
        raise BenchError(f"pairs {missing} are not registered (registered: {sorted(reg)}): run `scd assets`")
    entries = [reg[p] for p in cfg.pairs]
    producers = {e.producer for e in entries}
    if len(producers) != 1:
        raise BenchError(f"a fleet shares one producer; these pairs have {sorted(producers)}")
    members = []
    for p, e in zip(cfg.pairs, entries):
        model, adapter = e.consumer_model()
        members.append((p, str(model), str(adapter) if adapter else None, str(e.store_dir())))
    return entries[0].producer, members, load_tokenizer(Path(entries[0].tokenizer), required=False)


def _tables(members) -> dict:
    """Each pair's operating table: label -> validation KL and bytes per token."""
    out = {}
    for name, _, _, store in members:
        path = Path(store) / f"{name}.auto.json"
        if path.exists():
            out[name] = {p["label"]: p for p in json.loads(path.read_text())["points"]}
    return out


def _pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    if not xs:
        return None
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def run(cfg: FleetConfig, progress: bool = True) -> dict:
    for pol in cfg.policies:  # a setting no request would take, refused before the services start
        check_variant(pol)
    check_privileges()
    from tqdm import tqdm

    from tools import client

    producer, members, tok = _members(cfg)
    tables = _tables(members)
    prompts = Prompts(tok, _vocab(producer))
    prompts.check(cfg.tokens, model=producer)
    rng = random.Random(cfg.seed)
    kinds = tuple(dict.fromkeys([variant(p)[0] for p in cfg.policies]  # and every method auto may choose
                                + ([pt["method"] for t in tables.values() for pt in t.values()]
                                   if "auto" in cfg.policies else [])))
    short = {name: m for name, _, _, store in members if (m := uncalibrated(kinds, store, name))}
    if short:  # a consumer stopped at start-up, after the models loaded, naming its store's folder only
        raise BenchError("--methods: the pairs' stores lack the calibration of " + "; ".join(
            f"{', '.join(m)} for {name!r}" for name, m in short.items()) + f": {calibrate_hint()}, or leave them out")
    results, t0 = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="scd-fleet-") as logs, Testbed(cfg.link_mbit) as tb:
        spec = ServiceSpec("fleet", producer, "", str(members[0][3]), kinds, cfg.threads,
                           prefill_cache_entries=2 * cfg.prompts + 4, device=cfg.device, dtype=cfg.dtype)
        svc = FleetServices(tb, spec, Path(logs), members).start()
        addr = svc.producer_address

        def one(consumer: str, ids: list[int], policy: str) -> dict:
            kind, params = variant(policy)
            req = client.request(ids, consumer, kind, max_new_tokens=1, native_prefix=prompts.native_prefix,
                                 method_params=params)
            try:
                r = client.generate(addr, req, timeout=600)
            except Exception as e:  # grpc.RpcError: say which service failed
                svc.check_alive()
                raise BenchError(f"{policy} -> {consumer}: {e}") from None
            t = r.timings
            label = t.auto_reason.split(": ", 1)[0] if t.auto_reason else policy
            point = tables.get(consumer, {}).get(label)
            return dict(consumer=consumer, policy=policy, served=label, ttft_ms=t.ttft_ms, wire_bytes=t.wire_bytes,
                        kl=0.0 if label == "oracle" else (point["kl"] if point else None))

        names = [m[0] for m in members]
        with tqdm(total=len(cfg.policies) * (len(names) * (cfg.prompts + 1)), desc="fleet", unit="req",
                  disable=not progress) as bar, _until_interrupted() as stop:
            for pol in cfg.policies:
                bar.set_postfix_str(pol)
                warm = prompts.cold(cfg.tokens)
                for c in names:  # every code path and consumer warm before timing
                    one(c, warm, pol)
                    bar.update()
                fresh = [prompts.cold(cfg.tokens) for _ in range(cfg.prompts)]
                jobs = [(c, ids) for ids in fresh for c in names]
                rng.shuffle(jobs)
                t_pol = time.perf_counter()
                ex = ThreadPoolExecutor(cfg.clients)
                try:
                    futs = [ex.submit(one, c, ids, pol) for c, ids in jobs]
                    runs = []
                    for f in futs:
                        runs.append(f.result())
                        bar.update()
                finally:  # Ctrl-C: the queued requests are dropped, those in flight end
                    ex.shutdown(wait=True, cancel_futures=True)
                wall = time.perf_counter() - t_pol
                results.append(_summary(pol, runs, wall))
    if stop.interrupted and not results:
        raise KeyboardInterrupt  # nothing measured to report
    res = _report(cfg, results, time.perf_counter() - t0)
    if stop.interrupted:  # the policies whose requests were all made
        res["config"]["interrupted"] = True
    return res


def _summary(policy: str, runs: list[dict], wall: float) -> dict:
    ttft = [r["ttft_ms"] for r in runs]
    kls = [r["kl"] for r in runs]
    return dict(policy=policy, requests=len(runs), wall_s=wall, throughput_rps=len(runs) / wall,
                ttft_p50_ms=statistics.median(ttft), ttft_p99_ms=_pct(ttft, 0.99),
                bytes_per_request=statistics.mean(r["wire_bytes"] for r in runs),
                mean_kl=statistics.mean(kls) if all(k is not None for k in kls) else None,
                served=dict(Counter(f"{r['consumer']}:{r['served']}" for r in runs)), runs=runs)


def _report(cfg: FleetConfig, results: list[dict], seconds: float) -> dict:
    base = next((r for r in results if r["policy"] == "oracle"), None)
    for r in results:
        r["throughput_vs_oracle"] = r["throughput_rps"] / base["throughput_rps"] if base else None
        r["p50_speedup_vs_oracle"] = base["ttft_p50_ms"] / r["ttft_p50_ms"] if base else None
    return {"config": {**{k: getattr(cfg, k) for k in ("pairs", "policies", "link_mbit", "tokens", "prompts",
                                                       "clients", "seed", "threads", "device", "dtype", "argv")},
                       "seconds": round(seconds, 1), **_git()},
            "policies": results}


def table(res: dict) -> str:
    c = res["config"]
    lines = [f"fleet: one producer, consumers {', '.join(c['pairs'])}; {c['prompts']} prompts of ~{c['tokens']} tokens "
             f"each asked of every consumer, {c['clients']} in flight, link {c['link_mbit']:g} Mbit/s",
             f"{'policy':>10}{'req/s':>8}{'x oracle':>10}{'p50 ms':>9}{'p99 ms':>9}{'x oracle':>10}{'kB/req':>10}"
             f"{'mean KL':>10}"]
    for r in res["policies"]:
        def f(x, s):
            return "-" if x is None else format(x, s)
        lines.append(f"{r['policy']:>10}{r['throughput_rps']:>8.2f}{f(r['throughput_vs_oracle'], '.2f'):>10}"
                     f"{r['ttft_p50_ms']:>9.0f}{r['ttft_p99_ms']:>9.0f}{f(r['p50_speedup_vs_oracle'], '.2f'):>10}"
                     f"{r['bytes_per_request'] / 1e3:>10.0f}{f(r['mean_kl'], '.4f'):>10}")
    for r in res["policies"]:
        if r["policy"] == "auto":
            lines.append("auto served: " + ", ".join(f"{k} x{v}" for k, v in sorted(r["served"].items())))
    return "\n".join(lines)


def png(res: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["policies"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    names = [r["policy"] for r in rows]
    axes[0].bar(names, [r["throughput_rps"] for r in rows])
    axes[0].set_ylabel("requests / s")
    x = range(len(rows))
    axes[1].bar([i - 0.2 for i in x], [r["ttft_p50_ms"] for r in rows], 0.4, label="p50")
    axes[1].bar([i + 0.2 for i in x], [r["ttft_p99_ms"] for r in rows], 0.4, label="p99")
    axes[1].set_xticks(list(x), names)
    axes[1].set_ylabel("TTFT (ms)")
    axes[1].legend(fontsize=8)
    axes[2].bar(names, [r["bytes_per_request"] / 1e6 for r in rows])
    axes[2].set_ylabel("MB per request")
    c = res["config"]
    fig.suptitle(f"fleet of {len(c['pairs'])} consumers behind one producer, {c['link_mbit']:g} Mbit/s, "
                 f"~{c['tokens']}-token prompts, {c['clients']} in flight", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def final_line(res: dict, json_path: Path | None) -> str:
    keys = ("throughput_rps", "throughput_vs_oracle", "ttft_p50_ms", "ttft_p99_ms", "p50_speedup_vs_oracle",
            "bytes_per_request", "mean_kl")
    return json.dumps({"fleet": {r["policy"]: {k: round(r[k], 4) if isinstance(r[k], float) else r[k] for k in keys}
                                 for r in res["policies"]},
                       "seconds": res["config"]["seconds"], "json": str(json_path) if json_path else None})
