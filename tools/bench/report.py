"""The benchmark's table, PNG and final JSON line."""

from __future__ import annotations

import json
from pathlib import Path


def _f(x, spec=".0f", none="-"):
    return none if x is None else format(x, spec)


def _bytes(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def table(res: dict) -> str:
    c = res["config"]
    head = (f"TTFT over a rate-limited veth link between two network namespaces: pair={c['pair']}, "
            f"{c['repeats']} requests per point (median / p90 after a warm-up), one-way delay {c['delay_ms']:g} ms, "
            f"{c['threads_per_service']} thread(s) per service, {c['device']}/{c['dtype']}")
    cols = ("link", "tokens", "method", "bytes", "floor ms", "warm ms", "p90", "/floor", "cold ms", "p90", "/floor",
            "no-pipe ms", "pipe gain", "goodput", "vs oracle")
    mw = max([11] + [len(r["method"]) + 2 for r in res["rows"]])  # variants such as scd:block_tokens=0.5
    w = (7, 7, mw, 10, 9, 9, 8, 7, 9, 8, 7, 11, 10, 9, 10)
    lines = [head, "".join(f"{h:>{n}}" for h, n in zip(cols, w))]
    for r in res["rows"]:
        vals = (f"{r['link_mbit']:g}M", str(r["prompt_tokens"]), r["method"], _bytes(r["bytes"]), _f(r["floor_ms"]),
                _f(r["warm_ttft_ms"]), _f(r["warm_ttft_p90_ms"]), _f(r["warm_floor_ratio"], ".2f"),
                _f(r["cold_ttft_ms"]), _f(r["cold_ttft_p90_ms"]), _f(r["cold_floor_ratio"], ".2f"),
                _f(r["nopipe_ttft_ms"]), _f(r["pipelining_gain"], ".2f"),
                _f(r["goodput_mbit"], ".0f") + "M" if r["goodput_mbit"] else "-",
                _f(r["warm_speedup_vs_oracle"], ".2f") + "x" if r["warm_speedup_vs_oracle"] else "-")
        lines.append("".join(f"{v:>{n}}" for v, n in zip(vals, w)))
    lines.append(f"decode step (ms, by prompt length): {res['decode_step_ms']}")
    for k, t in res["targets"].items():
        detail = ", ".join(f"{a}={_f(b, '.3g') if isinstance(b, float) else b}" for a, b in t.items() if a != "met")
        lines.append(f"target {k}: {'met' if t['met'] else 'NOT met'} ({detail})")
    if c.get("kl_unused"):  # the quality-aware target knows no KL for these
        lines.append(f"KL from {c['kl_source']} not used for: "
                     + "; ".join(f"{m} ({why})" for m, why in c["kl_unused"].items())
                     + ". Measure them with `scd eval --methods ... --json F` and pass `--kl-json F`.")
    return "\n".join(lines)


def png(res: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = res["config"]
    tokens = c["tokens"]
    fig, axes = plt.subplots(1, len(tokens), figsize=(max(6.4, 5.2 * len(tokens)), 5.0), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, n in zip(axes[0], tokens):
        for i, m in enumerate(c["methods"]):
            rows = sorted((r for r in res["rows"] if r["tokens"] == n and r["method"] == m),
                          key=lambda r: r["link_mbit"])
            if not rows:
                continue
            x = [r["link_mbit"] for r in rows]
            col = colors[i % len(colors)]
            if m == "oracle":
                ax.plot(x, [r["warm_ttft_ms"] for r in rows], "s-", color=col, label="oracle (consumer prefill)")
                continue
            ax.plot(x, [r["warm_ttft_ms"] for r in rows], "o-", color=col, label=f"{m} warm")
            ax.plot(x, [r["cold_ttft_ms"] for r in rows], "x--", color=col, alpha=0.8, label=f"{m} cold")
            ax.plot(x, [r["floor_ms"] for r in rows], "_:", color=col, alpha=0.7, lw=1, ms=14, label=f"{m} floor")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link rate (Mbit/s)")
        ax.set_ylabel("TTFT (ms, median)")
        ax.set_title(f"~{n}-token prompt")
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=min(6, len(labels)), frameon=False)
    fig.suptitle(f"TTFT vs link rate, pair {c['pair']}, {c['device']}, {c['threads_per_service']} thread(s) per "
                 "service\n"
                 "warm: the producer holds the prefill; cold: it prefills first; floor: bytes / rate + one decode step",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0.04 + 0.035 * ((len(labels) - 1) // 6), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def final_line(res: dict, json_path: Path | None) -> str:
    keys = ("warm_ttft_ms", "cold_ttft_ms", "bytes", "floor_ms", "link_mbit", "warm_floor_ratio",
            "warm_speedup_vs_oracle", "pipelining_gain", "goodput_mbit")
    out = {"headline": res["headline"],
           "methods": {m: {k: (round(v[k], 3) if isinstance(v[k], float) else v[k]) for k in keys}
                       for m, v in res["methods"].items()},
           "targets": {k: t["met"] for k, t in res["targets"].items()},
           "seconds": res["config"].get("seconds"), "json": str(json_path) if json_path else None}
    return json.dumps(out)
