"""The tables in the docs that are rendered from committed files (``tools/docs_tables.py``) are what
those files say now: remaking an operating table without remaking the docs fails here."""

from pathlib import Path

import pytest

from tools.docs_tables import BLOCK, render

DOCS = sorted((Path(__file__).resolve().parents[2] / "docs").glob("*.md"))


@pytest.mark.parametrize("doc", [d for d in DOCS if BLOCK.search(d.read_text())], ids=lambda d: d.name)
def test_rendered_tables_are_current(doc):
    _, stale = render(doc.read_text())
    assert not stale, f"{doc.name}: {stale} differ from their files; run `make docs-tables`"


def test_a_changed_table_is_found(tmp_path):
    text = "<!-- table:auto:strong -->\n| an old table |\n<!-- /table -->\n"
    new, stale = render(text)
    assert stale == ["auto:strong"] and "| scd |" in new
    assert render(new)[1] == []
