"""Every relative link of the README and the docs reaches a file, and every #anchor a heading of it
(as GitHub makes heading anchors), so that moving a section cannot leave a reader at a dead link."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _lines_outside_code(path: Path):
    fenced = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield number, line


def anchors(path: Path) -> set[str]:
    """GitHub's: lower case, punctuation but - and _ dropped, spaces to -, repeats numbered."""
    seen: dict[str, int] = {}
    for _, line in _lines_outside_code(path):
        heading = re.match(r"#{1,6} (.*)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            seen[slug] = seen.get(slug, 0) + 1
            if seen[slug] > 1:
                seen[f"{slug}-{seen[slug] - 1}"] = 1
    return set(seen)


def markdown_files() -> list[Path]:
    found = [ROOT / "README.md"]
    for folder in ("docs", "deploy", "integrations"):
        found += sorted((ROOT / folder).glob("**/*.md"))
    return found


def dead_links(path: Path, root: Path = ROOT) -> list[str]:
    dead = []
    for number, line in _lines_outside_code(path):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # https://, mailto:
                continue
            file, _, anchor = target.partition("#")
            where = (path.parent / file).resolve() if file else path
            if not where.exists():
                dead.append(f"{path.relative_to(root)}:{number}: {target} (no such file)")
            elif anchor and where.suffix == ".md" and anchor not in anchors(where):
                dead.append(f"{path.relative_to(root)}:{number}: {target} (no heading makes #{anchor})")
    return dead


def test_every_relative_link_of_the_docs_reaches_its_file_and_heading():
    assert len(markdown_files()) > 5
    dead = [d for path in markdown_files() for d in dead_links(path)]
    assert not dead, "\n".join(dead)


def test_the_checker_finds_a_dead_file_and_a_dead_anchor(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A title\n## Twice\n## Twice\n```\n[x](nowhere.md)\n```\n"
                    "[ok](#a-title) [ok](#twice-1) [dead](#nope) [gone](other.md) [ok](page.md#twice)\n")
    got = dead_links(page, root=tmp_path)
    assert [d.split(": ", 1)[1] for d in got] == ["#nope (no heading makes #nope)", "other.md (no such file)"]
