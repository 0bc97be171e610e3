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


def test_a_consumer_that_does_not_come_back_from_its_restart_fails_the_soak_with_its_log(tmp_path, monkeypatch):
    """The restart runs in a thread: a consumer that did not start again was a thread's traceback, and
    the rest of the run counted as the restart window."""
    import subprocess
    import sys

    from tools.demo import free_port
    from tools.soak import Soak

    soak = Soak("p", 1.0, 1, 1, 0)
    soak.logdir, soak.cport = tmp_path, free_port()
    soak.procs["consumer"] = subprocess.Popen([sys.executable, "-c", "pass"])
    (tmp_path / "consumer.log").write_text("error: port 5 is in use\n")
    monkeypatch.setattr(soak, "_consumer", lambda: subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"]))
    soak.restart_consumer()
    assert not soak.restarting.is_set()
    assert len(soak.tally.server_errors) == 1, soak.tally.server_errors
    said = soak.tally.server_errors[0]
    assert said.startswith("the consumer did not come back after its restart") and "exited with code 3" in said
    assert "error: port 5 is in use" in said
