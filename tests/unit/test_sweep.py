import json

from tools.eval import sweep


def test_pareto_frontier():
    rows = {"a": {"bytes_per_token": 10, "kl": 0.5}, "b": {"bytes_per_token": 5, "kl": 0.6},
            "c": {"bytes_per_token": 20, "kl": 0.6}, "d": {"bytes_per_token": 5, "kl": 0.7},
            "oracle": {"bytes_per_token": 4, "kl": 0.0}}
    assert sorted(sweep.pareto(rows)) == ["a", "b"]


def test_points_and_plot(tmp_path):
    pts = sweep.points(["oracle", "raw", "quant", "droidspeak", "scd"], [[3, 5], [7, 9]], [2, 4, 6], [[10, 20]])
    labels = [p[0] for p in pts]
    assert dict((p[0], p[2]) for p in pts)["scd[no block]"] == {"patch_blocks": "none"}
    assert "scd[no block]" not in [p[0] for p in sweep.points(["scd"], None, [2], [])]
    assert "quant[bits=4]" in labels and "droidspeak[3-5,7-9]" in labels and "scd[k=0]" in labels
    assert dict((p[0], p[2]) for p in pts)["scd[k=0]"] == {"patch_layers": "none"}
    rows = {lab: {"bytes_per_token": 10.0 * (i + 1), "kl": 1.0 / (i + 1)} for i, lab in enumerate(labels)}
    body = sweep.write(rows, tmp_path / "s.json", "t")
    assert (tmp_path / "s.png").stat().st_size > 1000
    assert json.loads((tmp_path / "s.json").read_text())["pareto"] == body["pareto"]
