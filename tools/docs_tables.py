"""Tables in the docs that are made from committed files, so that they cannot drift from what is
served: a block between ``<!-- table:KIND:NAME -->`` and ``<!-- /table -->`` is rendered from the file
it names (``auto``: ``artifacts/store/NAME.auto.json``, the operating table ``auto`` serves from).

    python -m tools.docs_tables          # rewrite the blocks of docs/*.md
    python -m tools.docs_tables --check  # exit 1 naming each stale block (tests/unit/test_docs_tables.py)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STORE = ROOT / "artifacts" / "store"
BLOCK = re.compile(r"(<!-- table:(\w+):([\w-]+) -->\n)(.*?)(<!-- /table -->)", re.S)


def auto_table(pair: str, store: Path = STORE) -> str:
    """The operating table of ``pair``, by validation KL: every point as ``auto`` reads it."""
    body = json.loads((store / f"{pair}.auto.json").read_text())
    raw = body["raw_kl"]
    rows = ["| point | KL | x raw | bytes/token | encode ms/tok | reconstruct ms/tok |", "|---|---|---|---|---|---|"]
    for p in sorted(body["points"], key=lambda p: p["kl"]):
        rows.append(f"| {p['label']} | {p['kl']:.4f} | {p['kl'] / raw:.2f} | {p['bytes_per_token']:,.0f} | "
                    f"{p['encode_ms_per_token']:.3f} | {p['reconstruct_ms_per_token']:.3f} |")
    report = body.get("report") or {}
    note = f"raw KL {raw:.4f}, {report.get('n', '?')} validation prompts of {body.get('data', '?')}, made in " \
           f"{report.get('seconds', 0):.0f} s"
    from shared.auto import choose

    said = []
    for mbps in (1000.0, 100.0):
        c = choose(body, 1000, mbps, "docs")
        said.append(f"at {mbps:.0f} Mbit/s `{c.label}` ({c.expected_ms:,.0f} ms expected)")
    return ("\n".join(rows) + f"\n\n({note}; `artifacts/store/{pair}.auto.json`.) For a 1,000-token prompt `auto` "
            f"serves {' and '.join(said)}.\n")


RENDER = {"auto": auto_table}


def render(text: str) -> tuple[str, list[str]]:
    """``text`` with every block rendered again, and the names of those that changed."""
    changed: list[str] = []

    def one(m: re.Match) -> str:
        kind, name = m.group(2), m.group(3)
        if kind not in RENDER:
            raise SystemExit(f"unknown table kind {kind!r} (known: {', '.join(RENDER)})")
        new = RENDER[kind](name)
        if new != m.group(4):
            changed.append(f"{kind}:{name}")
        return m.group(1) + new + m.group(5)

    return BLOCK.sub(one, text), changed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is stale")
    args = ap.parse_args()
    stale = []
    for doc in sorted((ROOT / "docs").glob("*.md")):
        text = doc.read_text()
        new, changed = render(text)
        stale += [f"{doc.relative_to(ROOT)}: {c}" for c in changed]
        if changed and not args.check:
            doc.write_text(new)
    for s in stale:
        print(("stale: " if args.check else "rewrote: ") + s)
    if args.check and stale:
        print("run `python -m tools.docs_tables` (make docs-tables) to remake them", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
