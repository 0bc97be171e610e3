"""What is committed and served is what was measured: every point of a committed operating table
(``artifacts/store/<pair>.auto.json``) reads the artifacts and profiles committed beside it. A
recalibration that forgets to remake the table fails here, not at a user's (``auto`` then skips the
stale points without a word, and served DroidSpeak on every built-in pair for weeks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.auto import stale_points
from shared.engine import load_context
from shared.model.hf_adapter import ModelAdapter
from shared.model.tiny import shaped_model

STORE = Path(__file__).resolve().parents[2] / "artifacts" / "store"
TABLES = sorted(STORE.glob("*.auto.json"))


def test_there_are_committed_tables():
    assert {p.name.split(".")[0] for p in TABLES} >= {"strong", "mild", "code", "verse"}


@pytest.mark.parametrize("table", TABLES, ids=lambda p: p.name)
def test_every_point_of_a_committed_table_reads_the_committed_artifacts(table):
    body = json.loads(table.read_text())
    pair = body["pair"]
    meta = json.loads((STORE / pair / "meta.json").read_text())
    model = shaped_model(meta["n_layers"], meta["hidden_size"], meta["n_kv_heads"], meta["head_dim"])
    ctx = load_context(ModelAdapter(model), STORE / pair, "producer")
    stale = stale_points(body, ctx)
    assert not stale, (f"{table.name}: {len(stale)} of {len(body['points'])} points are stale: {stale}; remake it "
                       f"with `scd calibrate --pair {pair} --method auto --out artifacts/store`")
    assert {p["method"] for p in body["points"]} >= {"raw", "scd", "scd-reuse"}
