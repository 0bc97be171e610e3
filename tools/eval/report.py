"""Plain-text tables for evaluation results."""

from __future__ import annotations

COLUMNS = [("kl", "KL", "{:.4f}"), ("top1", "top1", "{:.3f}"), ("task_f1", "taskF1", "{:.3f}"),
           ("agree_f1", "agreeF1", "{:.3f}"), ("delta_ppl_pct", "dPPL%", "{:+.1f}"),
           ("bytes_per_token", "B/tok", "{:.0f}"), ("bytes_vs_raw_fp16", "B/raw16", "{:.3f}"),
           ("encode_ms", "enc ms", "{:.1f}"), ("reconstruct_ms", "rec ms", "{:.1f}"),
           ("reconstruct_vs_prefill", "rec/pf", "{:.2f}"), ("n", "n", "{}")]


def _fmt(fmt: str, v) -> str:
    return "-" if v is None else fmt.format(v)


def print_table(res: dict, title: str = "") -> None:
    if title:
        print(title)
    w = max([12] + [len(name) + 1 for name in res["methods"]])  # variants such as scd:block_tokens=0.35
    head = f"{'method':<{w}}" + "".join(f"{h:>9}" for _, h, _ in COLUMNS)
    print(head)
    print("-" * len(head))
    for name, m in res["methods"].items():
        print(f"{name:<{w}}" + "".join(f"{_fmt(f, m.get(k)):>9}" for k, _, f in COLUMNS))


def print_layers(res: dict) -> None:
    lay = res["layers"]
    print("per-layer relative error of raw producer K/V vs the consumer's own (pre-RoPE)")
    print("layer " + " ".join(f"{i:>5}" for i in range(len(lay["k_rel_err"]))))
    print("K     " + " ".join(f"{x:5.3f}" for x in lay["k_rel_err"]))
    print("V     " + " ".join(f"{x:5.3f}" for x in lay["v_rel_err"]))
    print(f"growth per layer: K {lay['k_growth_per_layer']:+.4f}  V {lay['v_growth_per_layer']:+.4f}")


def print_buckets(res: dict) -> None:
    """KL per kind of text and per prompt length, where the prompts hold more than one of either."""
    for key, what in (("kl_by_kind", "kind"), ("kl_by_length", "prompt tokens")):
        groups = list(dict.fromkeys(g for m in res["methods"].values() for g in m.get(key, {})))
        if len(groups) < 2:
            continue
        w = max([12] + [len(name) + 1 for name in res["methods"]])
        print(f"KL by {what}")
        print(f"{'method':<{w}}" + "".join(f"{g:>11}" for g in groups))
        for name, m in res["methods"].items():
            print(f"{name:<{w}}" + "".join(f"{_fmt('{:.4f}', m.get(key, {}).get(g)):>11}" for g in groups))
