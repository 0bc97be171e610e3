"""``scd soak``'s verdict on the outcomes it counted: a well-formed request the services refused fails
the soak (a soak whose every request was refused with INVALID_ARGUMENT passed)."""

from __future__ import annotations

import collections
import json
from pathlib import Path

from tools.soak import unexpected

RESULTS = Path(__file__).resolve().parents[2] / "results"


def counts(flat: dict) -> collections.Counter:
    return collections.Counter({tuple(k.split("|", 1)): n for k, n in flat.items()})


def test_a_healthy_soak_has_no_unexpected_outcome():
    healthy = json.loads((RESULTS / "soak_10min.json").read_text())["outcomes"]  # a real 10-minute run
    assert unexpected(counts(healthy)) == []
    assert unexpected(counts({"http|http 429": 3, "grpc|resource_exhausted": 2})) == []  # at capacity: come back


def test_refused_requests_and_wrong_answers_to_corrupt_streams_are_unexpected():
    got = unexpected(counts({
        "grpc|ok": 5, "grpc|invalid_argument": 262, "http|http 400": 1, "chat|http 412": 1,
        "cancel|invalid_argument (restart)": 3, "grpc|unavailable (restart)": 4,
        "corrupt|data_loss": 2, "corrupt|invalid_argument": 1, "corrupt|unavailable": 1,
        "corrupt|unavailable (restart)": 1, "http|http 503 (restart)": 2,
    }))
    assert got == [("cancel", "invalid_argument (restart)"), ("chat", "http 412"), ("corrupt", "invalid_argument"),
                   ("corrupt", "unavailable"), ("grpc", "invalid_argument"), ("http", "http 400")]


def test_lost_requests_and_server_errors_are_left_to_their_own_counts():
    # counted apart (lost, or a 5xx outside the restart), not twice
    assert unexpected(counts({"grpc|deadline_exceeded": 1, "http|transport error": 1, "grpc|unavailable": 1,
                              "http|http 500": 1})) == []
