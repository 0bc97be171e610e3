"""``scd bench``: time to first token through the real services over a real, rate-limited link.

For each link rate, prompt length and method, real requests go through the producer's client API
(``tools.client``); every number comes from the services' own Timings of those requests:

- **warm**: the same prompt, already prefilled once by the producer (its prefill cache holds the
  state: one base prefill serving many consumers); the producer only encodes and streams.
- **cold**: a prompt the producer has never seen (distinct per request): prefill, then stream.
- **no pipelining**: the warm request with the ``scd-bench-hold`` metadata (the services run with
  ``bench.hold_layers``): the producer encodes every layer before
  sending a frame, and the consumer reconstructs only after the trailer (same payload, same link).

The Oracle sends token ids only and the consumer prefills itself, so its warm and cold are the same
requests. TTFT is the producer's (request received -> first token relayed); the client's is kept too.
The floor of a method is ``wire bytes * 8 / link rate + one consumer decode step`` (the decode step
measured in the same requests: the first and only decode step after the cache is ready, from
Timings.decode_tokens_per_s with max_new_tokens=1; the median over every request at that prompt
length).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared.codecs import parse_variant
from tools.bench.netns import BenchError, Testbed, check_privileges
from tools.bench.services import REPO, Services, ServiceSpec

log = logging.getLogger(__name__)

TARGET_SPEEDUP = 5.0  # issue 16: warm SCD at 1 Gbit/s, ~1,000 tokens, >= 5x faster than the Oracle
TARGET_FLOOR_RATIO = 3.0  # ... and within 3x of its physical floor
TARGET_GOODPUT_SHARE = 0.8


@dataclass
class BenchConfig:
    methods: tuple[str, ...] = ("oracle", "raw", "quant", "spectrum", "droidspeak", "ridge", "scd-reuse", "scd")
    bandwidths_mbit: tuple[float, ...] = (100.0, 1000.0, 10000.0)
    tokens: tuple[int, ...] = (500, 1000, 2000)
    repeats: int = 5
    delay_ms: float = 0.0
    pair: str = "strong"
    pipelining: bool = True
    threads: int = max(1, (os.cpu_count() or 2) // 2)
    producer_model: str | None = None  # default: the prepared producer
    consumer_model: str | None = None  # default: the prepared consumer of ``pair``
    store: str | None = None  # default: the repo's artifact store
    kl_json: str | None = None  # default: results/eval_all_<pair>_on.json when it exists
    device: str = "cpu"
    dtype: str = "float32"
    argv: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------- prompts
class Prompts:
    """Deterministic prompts of exactly N tokens. With a tokenizer: the chat-template prefix, then text
    of the test split's QA passages, then the template's closing tail (so the native prefix applies).
    Without one (tiny test models): seeded random ids. Offset 0 is the warm prompt of each length; every
    cold prompt starts elsewhere in the pool."""

    def __init__(self, tokenizer=None, vocab: int = 256):
        self._k = 0
        if tokenizer is None:
            import torch

            self.prefix, self.tail, self.native_prefix = [], [], False
            self.pool = torch.randint(0, vocab, (200_000,), generator=torch.Generator().manual_seed(0)).tolist()
            return
        from shared.model.prompt import PromptFormat
        from tools import data

        fmt = PromptFormat(tokenizer)
        self.prefix = fmt.prefix_ids
        self.tail = fmt._ids(fmt.tail) if fmt.chat else []
        self.native_prefix = bool(self.prefix)
        pool = []
        try:
            items = data.load("qa", "test", fmt=fmt)
        except (FileNotFoundError, ValueError) as e:  # the prompts are the built-in QA test passages
            raise BenchError(f"the benchmark's prompts are the built-in QA test passages: {e}") from None
        for it in items:
            body = it.prompt_ids[it.prefix_len:]
            if self.tail and body[-len(self.tail):] == self.tail:
                body = body[: -len(self.tail)]
            pool.extend(body)
        self.pool = pool

    def check(self, *lengths: int, model: str | None = None) -> None:
        """BenchError naming ``--tokens`` for a prompt length this builder cannot make, or that the
        services (default settings) would refuse for the ``model`` folder's context, before any
        service starts."""
        from consumer_service.settings import ConsumerSettings
        from producer_service.settings import ProducerSettings

        t = len(self.prefix) + len(self.tail)
        limits = [s.model_fields["max_prompt_tokens"].default for s in (ProducerSettings, ConsumerSettings)]
        top = min([t + len(self.pool) - 1, *(x for x in limits if x is not None)])  # None: the model's context
        if model is not None:
            top = min(top, int(json.loads((Path(model) / "config.json").read_text()).get("max_position_embeddings")
                               or top))
        bad = [n for n in lengths if not t < n <= top]
        if bad:
            raise BenchError(f"--tokens {','.join(map(str, bad))}: a prompt is the pair's chat template ({t} tokens) "
                             f"and text from the test split, within the services' prompt limit; give lengths from "
                             f"{t + 1} to {top}")

    def get(self, n: int, offset: int = 0) -> list[int]:
        m = n - len(self.prefix) - len(self.tail)
        if not 1 <= m < len(self.pool):
            self.check(n)
        o = offset % (len(self.pool) - m)
        return self.prefix + self.pool[o : o + m] + self.tail

    def cold(self, n: int) -> list[int]:
        self._k += 1
        return self.get(n, 1 + self._k * 7919)


# ---------------------------------------------------------------------------------------- requests
def variant(label: str) -> tuple[str, dict[str, str]]:
    """A benchmarked method (``shared.codecs.parse_variant``), sent as the request's method parameters."""
    try:
        return parse_variant(label)
    except ValueError as e:
        raise BenchError(str(e)) from None


def check_variant(label: str) -> tuple[str, dict[str, str]]:
    """``variant`` with its settings checked as the producer will check them (BenchError if not)."""
    from shared.codecs import check_settings
    from shared.errors import SCDError

    kind, params = variant(label)
    try:
        check_settings(kind, params)
    except SCDError as e:
        raise BenchError(f"{label}: {e}") from None
    return kind, params


def _one(address: str, ids: list[int], consumer: str, method: str, native_prefix: bool, no_pipelining: bool) -> dict:
    from tools import client

    kind, params = variant(method)
    req = client.request(ids, consumer, kind, max_new_tokens=1, native_prefix=native_prefix, method_params=params)
    r = client.generate(address, req, timeout=600, metadata=client.BENCH_HOLD if no_pipelining else ())
    t = r.timings
    if t is None:
        raise BenchError(f"{method}: the final token event carried no timings")
    return dict(
        ttft_ms=t.ttft_ms, client_ttft_ms=r.client_ttft_ms, prefill_ms=t.prefill_ms, encode_ms=t.encode_ms,
        wire_bytes=t.wire_bytes, payload_bytes=t.payload_bytes, reconstruct_ms=t.reconstruct_ms,
        transfer_ms=t.transfer_ms, tail_ms=t.last_frame_to_first_token_ms,
        decode_step_ms=1e3 / t.decode_tokens_per_s if t.decode_tokens_per_s > 0 else float("nan"),
        prompt_tokens=t.prompt_tokens, fallback=bool(t.fallback_recompute), identity=t.method_identity,
        consumer_fp=t.consumer_fingerprint,
    )


def _median(xs):
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else None


def _p90(xs):
    xs = sorted(x for x in xs if x == x)
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=10, method="inclusive")[-1]


def _stats(runs: list[dict]) -> dict | None:
    if not runs:
        return None
    out = {k: _median([r[k] for r in runs]) for k in ("ttft_ms", "client_ttft_ms", "prefill_ms", "encode_ms",
                                                      "transfer_ms", "reconstruct_ms", "tail_ms", "decode_step_ms")}
    out["ttft_p90_ms"] = _p90([r["ttft_ms"] for r in runs])
    out["n"] = len(runs)
    out["fallbacks"] = sum(r["fallback"] for r in runs)
    gp = [r["wire_bytes"] * 8 / (r["transfer_ms"] * 1e3) for r in runs if r["transfer_ms"] > 0 and r["wire_bytes"]]
    out["goodput_mbit"] = _median(gp)
    return out


# ---------------------------------------------------------------------------------------- the run
def _models(cfg: BenchConfig):
    """(producer folder, consumer folder, consumer adapter, tokenizer, store) of the bench: the
    registered pair's, unless the config names folders."""
    from shared.errors import ConfigError
    from shared.model.loading import check_model_folder, load_tokenizer
    from tools.assets import registry

    e = registry.load().pairs.get(cfg.pair)
    if e is None and not (cfg.producer_model and cfg.consumer_model):
        raise BenchError(f"unknown pair {cfg.pair!r} (registered: {registry.names() or 'none'}): run `scd assets`, "
                         "`scd pair add`, or give --producer-model and --consumer-model")
    for given, option in ((cfg.producer_model, "--producer-model"), (cfg.consumer_model, "--consumer-model")):
        if given:
            try:
                check_model_folder(given, option)
            except ConfigError as err:
                raise BenchError(str(err)) from None
    pm = cfg.producer_model or e.producer
    cm, adapter = (cfg.consumer_model, None) if cfg.consumer_model else e.consumer_model()
    tok = load_tokenizer(Path(e.tokenizer if e else pm), required=False)
    store = cfg.store or str(e.store_dir() if e else registry.default_store(builtin=True))
    return pm, cm, adapter, tok, store


def _vocab(path: str) -> int:
    return int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])


def _git() -> dict:
    def run(*a):
        r = subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    return {"commit": run("rev-parse", "HEAD"), "dirty": bool(run("status", "--porcelain", "--untracked-files=no"))}


def run(cfg: BenchConfig, progress: bool = True) -> dict:
    from shared.codecs import CODECS

    kinds = tuple(dict.fromkeys(variant(m)[0] for m in cfg.methods))
    unknown = [k for k in kinds if k not in CODECS]
    if unknown:
        raise BenchError(f"unknown methods {unknown}; expected some of {sorted(CODECS)}")
    if not cfg.methods or not cfg.bandwidths_mbit or not cfg.tokens or cfg.repeats < 1:
        raise BenchError("need at least one method, bandwidth, prompt length and repeat")
    for m in cfg.methods:  # a setting no request would take, refused before the services start
        check_variant(m)
    if cfg.kl_json:
        _kl(cfg)  # a file named but unreadable is refused now, not after the run
    check_privileges()
    pm, cm, adapter, tok, store = _models(cfg)
    from tools.assets.registry import calibration_missing

    why = calibration_missing(kinds, store, cfg.pair)
    if why:  # the consumer stopped at start-up, after the models loaded, naming the store's folder only
        raise BenchError(why)
    prompts = Prompts(tok, _vocab(pm))
    prompts.check(*cfg.tokens, model=pm)
    name = cfg.pair
    transfer = [m for m in cfg.methods if CODECS[variant(m)[0]].transfers_layers]
    per_cell = {m: 1 + cfg.repeats if m not in transfer else
                (2 + 3 * cfg.repeats if cfg.pipelining else 1 + 2 * cfg.repeats) for m in cfg.methods}
    total = len(cfg.bandwidths_mbit) * len(cfg.tokens) * sum(per_cell.values()) + len(cfg.methods)
    t_start = time.perf_counter()
    raw: list[dict] = []
    from tqdm import tqdm

    with tempfile.TemporaryDirectory(prefix="scd-bench-") as logs, Testbed(cfg.bandwidths_mbit[0], cfg.delay_ms) as tb:
        svc = Services(tb, ServiceSpec(name, pm, cm, store, kinds, cfg.threads, consumer_adapter=adapter,
                                       prefill_cache_entries=2 * len(cfg.methods) + 2, device=cfg.device,
                                       dtype=cfg.dtype), Path(logs))
        svc.start()
        addr = svc.producer_address
        qdisc_log = {}
        with tqdm(total=total, desc="bench", unit="req", disable=not progress) as bar, _until_interrupted() as stop:
            for m in cfg.methods:  # one request per method: the whole path works, code paths are warm
                _request(svc, addr, prompts.get(min(cfg.tokens)), name, m, prompts.native_prefix, False)
                bar.update()
            for bw in cfg.bandwidths_mbit:
                tb.set_rate(bw)
                qdisc_log[f"{bw:g}"] = tb.qdiscs()
                for n in cfg.tokens:
                    warm_ids = prompts.get(n, 0)
                    cells = {m: dict(link_mbit=bw, tokens=n, method=m, warm=[], cold=[], nopipe=[],
                                     native_prefix=prompts.native_prefix)
                             for m in cfg.methods}

                    def req(m, ids, nopipe=False, bw=bw, n=n):
                        bar.set_postfix_str(f"{bw:g} Mbit/s, {n} tok, {m}")
                        r = _request(svc, addr, ids, name, m, prompts.native_prefix, nopipe)
                        bar.update()
                        return r

                    for m in cfg.methods:  # warm-up; fills the producer's prefill cache with this prompt
                        req(m, warm_ids)
                        if m in transfer and cfg.pipelining:
                            req(m, warm_ids, True)
                    for _ in range(cfg.repeats):  # interleaved, so drifting load hits every method and variant alike
                        for m in cfg.methods:
                            cells[m]["warm"].append(req(m, warm_ids))
                            if m in transfer:
                                cells[m]["cold"].append(req(m, prompts.cold(n)))
                                if cfg.pipelining:
                                    cells[m]["nopipe"].append(req(m, warm_ids, True))
                    for m, cell in cells.items():
                        if m not in transfer:  # the Oracle: no producer prefill, warm == cold
                            cell["cold"] = cell["warm"]
                        raw.append(cell)
    if stop.interrupted and not raw:
        raise KeyboardInterrupt  # nothing measured to report
    res = summarize(cfg, raw)
    res["config"].update(qdiscs=qdisc_log, seconds=round(time.perf_counter() - t_start, 1))
    if stop.interrupted:
        res["config"]["interrupted"] = True
    return res


class _Stop:
    interrupted = False


@contextlib.contextmanager
def _until_interrupted():
    """Ctrl-C ends the run with what it measured (every point whose requests were all made): a grid
    of an hour interrupted near its end lost every result. The services and the link are still
    taken down by the contexts around this one."""
    stop = _Stop()
    try:
        yield stop
    except KeyboardInterrupt:
        stop.interrupted = True


def _request(svc: Services, addr, ids, name, m, native_prefix, nopipe) -> dict:
    import grpc

    try:
        return _one(addr, ids, name, m, native_prefix, nopipe)
    except grpc.RpcError as e:
        svc.check_alive()
        raise BenchError(f"{m}: request failed: {e.code().name}: {e.details()}\n{svc.tail('producer', 10)}\n"
                         f"{svc.tail('consumer', 10)}") from None


# ---------------------------------------------------------------------------------------- summary
def _closest(values, target):
    return min(values, key=lambda v: (abs(v - target), v))


def _kl(cfg: BenchConfig) -> tuple[dict, str | None]:
    """Each method's entry of an ``scd eval --json`` file (its KL, and what it was measured with), and the
    file's path: ``--kl-json``'s (BenchError when it cannot be read: it is checked before the services
    start), else the pair's file in results/ if there is a readable one."""
    path = Path(cfg.kl_json) if cfg.kl_json else REPO / "results" / f"eval_all_{cfg.pair}_on.json"
    try:
        body = json.loads(path.read_text())
        consumer = (body.get("models") or {}).get("consumer")
        kl = {m: {"kl": r["kl"], "identity": r.get("identity"), "consumer": consumer,
                  "native_prefix": body.get("native_prefix")} for m, r in body["methods"].items() if "kl" in r}
    except OSError as e:
        if cfg.kl_json:
            raise BenchError(f"--kl-json {path} cannot be read: {e.strerror or e}; give an `scd eval --json` "
                             "file") from None
        return {}, None
    except (ValueError, KeyError, TypeError, AttributeError):
        kl = {}
    if not kl and cfg.kl_json:
        raise BenchError(f"--kl-json {path} is not an `scd eval --json` file (no methods with a KL in it)")
    return (kl, str(path)) if kl else ({}, None)


def matched_kl(measured: dict, served: dict[str, tuple[str, str]], native_prefix: bool) -> tuple[dict, dict]:
    """The KLs of ``measured`` (``_kl``'s entries) that belong to the methods this run served: the eval
    recorded the same identity (producer weights, kind and version, settings, calibration) as the
    producer gave for the method's requests and the same consumer weights as the consumer gave
    (``served``: label -> (identity, consumer fingerprint)), with the same native prefix. Returns
    ({label: KL}, {label: why its KL is not used}) over the served labels."""
    kl, unused = {}, {}
    want = "on" if native_prefix else "off"
    for m, (got, consumer) in served.items():
        e = measured.get(m)
        if e is None:
            unused[m] = "not in the file"
        elif variant(m)[0] == "auto":
            unused[m] = "it chooses a method per request, by the link: its eval KL is the eval's link rate's"
        elif not e["identity"]:
            unused[m] = "the file does not say what it was measured with (an older `scd eval`)"
        elif e["identity"] != got:
            unused[m] = f"measured with other {_differs(e['identity'], got)} than this run served"
        elif e["consumer"] != consumer:
            unused[m] = ("measured with another consumer model than this run served" if e["consumer"] else
                         "the file does not say which consumer model it was measured with (an older `scd eval`)")
        elif e["native_prefix"] not in (None, want):
            unused[m] = f"measured with the native prefix {e['native_prefix']}, this run {want}"
        else:
            kl[m] = e["kl"]
    return kl, unused


def _differs(a: str, b: str) -> str:
    names = ("producer weights", "kind and version", "settings", "calibration")
    pa, pb = a.split(":"), b.split(":")
    diff = [n for n, x, y in zip(names, pa, pb) if x != y]
    return " and ".join(diff) if len(pa) == len(pb) == len(names) and diff else "weights, settings or calibration"


def summarize(cfg: BenchConfig, cells: list[dict]) -> dict:
    from shared.codecs import CODECS

    # a transfer leaves the prompt's last token to a decode step; a method that transfers no layer (the
    # Oracle) prefills the whole prompt, its first token with it, and runs no step
    stepped = [c for c in cells if CODECS[variant(c["method"])[0]].transfers_layers]
    step = {}  # prompt length -> median decode step over every request at that length that ran one
    for n in cfg.tokens:
        step[n] = _median([r["decode_step_ms"] for c in stepped if c["tokens"] == n
                           for r in c["warm"] + c["cold"] + c["nopipe"]])
    rows = []
    for c in cells:
        warm, cold, nopipe = _stats(c["warm"]), _stats(c["cold"]), _stats(c["nopipe"])
        wire = _median([r["wire_bytes"] for r in c["warm"]])
        floor = wire * 8 / (c["link_mbit"] * 1e3) + (step[c["tokens"]] or 0.0)
        row = dict(
            link_mbit=c["link_mbit"], tokens=c["tokens"], method=c["method"],
            prompt_tokens=c["warm"][0]["prompt_tokens"], bytes=int(wire),
            payload_bytes=int(_median([r["payload_bytes"] for r in c["warm"]])),
            decode_step_ms=step[c["tokens"]], floor_ms=floor,
            warm=warm, cold=cold, nopipe=nopipe,
            warm_ttft_ms=warm["ttft_ms"], warm_ttft_p90_ms=warm["ttft_p90_ms"],
            cold_ttft_ms=cold["ttft_ms"], cold_ttft_p90_ms=cold["ttft_p90_ms"],
            warm_floor_ratio=warm["ttft_ms"] / floor, cold_floor_ratio=cold["ttft_ms"] / floor,
            warm_prefill_ms=warm["prefill_ms"], cold_prefill_ms=cold["prefill_ms"],
            nopipe_ttft_ms=nopipe["ttft_ms"] if nopipe else None,
            pipelining_gain=nopipe["ttft_ms"] / warm["ttft_ms"] if nopipe else None,
            goodput_mbit=(nopipe or warm)["goodput_mbit"], goodput_pipelined_mbit=warm["goodput_mbit"],
        )
        row["goodput_share"] = row["goodput_mbit"] / c["link_mbit"] if row["goodput_mbit"] else None
        rows.append(row)
    by = {(r["link_mbit"], r["tokens"], r["method"]): r for r in rows}
    for r in rows:
        o = by.get((r["link_mbit"], r["tokens"], "oracle"))
        r["warm_speedup_vs_oracle"] = o["warm_ttft_ms"] / r["warm_ttft_ms"] if o else None
        r["cold_speedup_vs_oracle"] = o["cold_ttft_ms"] / r["cold_ttft_ms"] if o else None
    measured = {(c["link_mbit"], c["tokens"]) for c in cells}  # the whole grid, unless the run was interrupted
    links, lengths = {b for b, _ in measured}, {n for _, n in measured}
    bw0 = _closest(sorted(links), 1000.0)
    n0 = _closest(sorted(n for b, n in measured if b == bw0), 1000)
    keys = ("link_mbit", "tokens", "prompt_tokens", "warm_ttft_ms", "warm_ttft_p90_ms", "cold_ttft_ms",
            "cold_ttft_p90_ms", "bytes", "floor_ms", "warm_floor_ratio", "cold_floor_ratio", "nopipe_ttft_ms",
            "pipelining_gain", "goodput_mbit", "warm_speedup_vs_oracle", "cold_speedup_vs_oracle")
    methods = {m: {k: by[(bw0, n0, m)][k] for k in keys} for m in cfg.methods}
    measured, kl_src = _kl(cfg)
    served = {c["method"]: (c["warm"][0].get("identity", ""), c["warm"][0].get("consumer_fp", "")) for c in cells
              if c["warm"]}
    kl, kl_unused = matched_kl(measured, served, any(c.get("native_prefix", True) for c in cells))
    for m, v in methods.items():
        v["kl"] = kl.get(m)
    return {
        "config": dict(methods=list(cfg.methods), bandwidths_mbit=[b for b in cfg.bandwidths_mbit if b in links],
                       tokens=[n for n in cfg.tokens if n in lengths],
                       repeats=cfg.repeats, delay_ms=cfg.delay_ms, pair=cfg.pair, threads_per_service=cfg.threads,
                       device=cfg.device, dtype=cfg.dtype, cpus=os.cpu_count(), kernel=platform.release(),
                       argv=cfg.argv, kl_source=kl_src, kl_unused=kl_unused if kl_src else {}, time=time.time(),
                       **_git()),
        "decode_step_ms": {str(n): v for n, v in step.items()},
        "headline": {"link_mbit": bw0, "tokens": n0},
        "methods": methods,
        "targets": targets(cfg, by, kl, bw0, n0),
        "rows": rows,
    }


def targets(cfg: BenchConfig, by: dict, kl: dict, bw0: float, n0: int) -> dict:
    out = {}
    scd, oracle = by.get((bw0, n0, "scd")), by.get((bw0, n0, "oracle"))
    if scd and oracle:
        s = oracle["warm_ttft_ms"] / scd["warm_ttft_ms"]
        out["warm_speedup_scd_vs_oracle"] = dict(link_mbit=bw0, tokens=n0, value=s, threshold=TARGET_SPEEDUP,
                                                 met=s >= TARGET_SPEEDUP)
    if scd and "scd" in kl:
        rivals = {m: by[(bw0, n0, m)]["warm_ttft_ms"] for m in cfg.methods
                  if m != "scd" and m in kl and kl[m] <= kl["scd"]}
        out["scd_fastest_at_its_quality"] = dict(
            link_mbit=bw0, tokens=n0, scd_ms=scd["warm_ttft_ms"], rivals_ms=rivals,
            unknown_kl=[m for m in cfg.methods if m not in kl],
            met=all(scd["warm_ttft_ms"] < v for v in rivals.values()))
    for bw in (100.0, 1000.0):
        r = by.get((bw, n0, "scd"))
        if r:
            out[f"scd_floor_ratio_{bw:g}mbit"] = dict(tokens=n0, value=r["warm_floor_ratio"],
                                                       cold_value=r["cold_floor_ratio"], threshold=TARGET_FLOOR_RATIO,
                                                       met=r["warm_floor_ratio"] <= TARGET_FLOOR_RATIO)
    r = by.get((100.0, n0, "raw"))
    if r and r["goodput_share"] is not None:
        out["raw_goodput_100mbit"] = dict(tokens=n0, goodput_mbit=r["goodput_mbit"], value=r["goodput_share"],
                                          pipelined_mbit=r["goodput_pipelined_mbit"], threshold=TARGET_GOODPUT_SHARE,
                                          met=r["goodput_share"] >= TARGET_GOODPUT_SHARE)
    return out
