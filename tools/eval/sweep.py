"""``scd eval --sweep``: each method's knob varied, every point judged in one harness run (the
producer prefill and the Oracle shared), written as points and a quality-vs-bytes Pareto plot."""

from __future__ import annotations

import json
from pathlib import Path


def points(names: list[str], droidspeak_blocks: list[list[int]] | None, scd_patch_layers: list[int] | None,
           scd_patch_blocks: list | None = None) -> list[tuple[str, str, dict[str, str]]]:
    """(label, method kind, params) for every point of the sweep."""
    out: list[tuple[str, str, dict[str, str]]] = []
    for m in names:
        if m == "oracle":
            out.append(("oracle", "oracle", {}))
        elif m == "raw":
            out += [(f"raw[{d}]", "raw", {"dtype": d}) for d in ("float16", "bfloat16")]
        elif m == "quant":
            out += [(f"quant[bits={b}]", "quant", {"bits": str(b)}) for b in (8, 4)]
        elif m == "spectrum":
            out += [(f"spectrum[b={b}]", "spectrum", {"budget": str(b)}) for b in (0.3, 0.5, 0.7)]
        elif m == "ridge":
            out.append(("ridge", "ridge", {}))
        elif m == "droidspeak" and droidspeak_blocks:
            for i in range(1, len(droidspeak_blocks) + 1):
                spec = ",".join(f"{a}-{b}" for a, b in droidspeak_blocks[:i])
                out.append((f"droidspeak[{spec}]", "droidspeak", {"blocks": spec}))
        elif m == "scd" and scd_patch_layers is not None:
            for k in sorted({0, 1, 3, len(scd_patch_layers)}):
                spec = ",".join(str(x) for x in scd_patch_layers[:k]) or "none"
                out.append((f"scd[k={k}]", "scd", {"patch_layers": spec}))
            if scd_patch_blocks:  # what the PATCH block earns: the same artifacts with REUSE there instead
                out.append(("scd[no block]", "scd", {"patch_blocks": "none"}))
                out += [(f"scd[block_tokens={x}]", "scd", {"block_tokens": str(x)}) for x in (0.1, 0.2, 0.35)]
        elif m == "scd-reuse":
            out.append(("scd-reuse", "scd-reuse", {}))
    return out


def pareto(rows: dict[str, dict]) -> list[str]:
    """Labels on the frontier: no other point has <= bytes and <= KL with one strictly lower. The
    Oracle is a reference, not a contender: its cost is a full consumer prefill, not bytes."""
    rows = {k: v for k, v in rows.items() if k != "oracle"}
    front = []
    for a, ra in rows.items():
        dominated = any(
            rb["bytes_per_token"] <= ra["bytes_per_token"] and rb["kl"] <= ra["kl"]
            and (rb["bytes_per_token"] < ra["bytes_per_token"] or rb["kl"] < ra["kl"])
            for b, rb in rows.items() if b != a)
        if not dominated:
            front.append(a)
    return front


def plot(rows: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    families: dict[str, list[tuple[float, float, str]]] = {}
    for label, r in rows.items():
        if label == "oracle":
            continue
        families.setdefault(label.split("[")[0], []).append((r["bytes_per_token"], r["kl"], label))
    for fam, pts in sorted(families.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=fam)
        for x, y, lab in pts:
            ax.annotate(lab[len(fam):] or fam, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    if "oracle" in rows:
        ax.axhline(0.0, color="grey", lw=0.8, ls="--", label="oracle (own prefill)")
    ax.set_xscale("log")
    ax.set_xlabel("payload bytes per prompt token (lz4, log scale)")
    ax.set_ylabel("KL(oracle ‖ method), nats/token")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(rows: dict[str, dict], out_json: Path, title: str) -> dict:
    front = pareto(rows)
    png = out_json.with_suffix(".png")
    plot(rows, png, title)
    body = {"points": rows, "pareto": front, "png": str(png)}
    out_json.write_text(json.dumps(body, indent=2) + "\n")
    return body
