"""A prepared model folder counts as ready only while it is whole: a folder whose weights were
removed or cut short after `scd assets` made it counted as ready, so `scd assets` failed on it
("has no model*.safetensors weights") instead of making it again."""

from __future__ import annotations

from tools.assets.models import _DONE, _finish, is_ready


def _prepared(tmp_path):
    tmp, final = tmp_path / "m.tmp", tmp_path / "m"
    tmp.mkdir()
    (tmp / "config.json").write_text("{}")
    (tmp / "model.safetensors").write_bytes(b"x" * 100)
    _finish(tmp, final)
    return final


def test_a_prepared_folder_is_ready_until_a_file_is_removed(tmp_path):
    final = _prepared(tmp_path)
    assert is_ready(final)
    (final / "model.safetensors").unlink()
    assert not is_ready(final)


def test_a_weights_file_cut_short_is_not_ready(tmp_path):
    final = _prepared(tmp_path)
    (final / "model.safetensors").write_bytes(b"x" * 10)
    assert not is_ready(final)


def test_an_earlier_builds_marker_needs_the_config_and_weights(tmp_path):
    final = _prepared(tmp_path)
    (final / _DONE).write_text("ok\n")  # what `scd assets` wrote before it listed the files
    assert is_ready(final)
    (final / "model.safetensors").unlink()
    assert not is_ready(final)
    assert not is_ready(tmp_path / "never-made")


def test_the_data_splits_are_ready_while_every_listed_file_matches_its_sha256(tmp_path):
    """A split file removed or edited counted as ready: `scd assets` kept it, while loading the split
    said to run `scd assets`."""
    import hashlib
    import json

    from tools import data

    body = '{"id": "q1"}\n'
    (tmp_path / "qa_test.jsonl").write_text(body)
    manifest = {"format": data.FORMAT, "files": {"qa_test.jsonl": {"sha256": hashlib.sha256(body.encode()).hexdigest(),
                                                                   "n": 1}}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert data.is_ready(tmp_path)
    (tmp_path / "qa_test.jsonl").write_text(body + body)
    assert not data.is_ready(tmp_path)
    (tmp_path / "qa_test.jsonl").unlink()
    assert not data.is_ready(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    assert not data.is_ready(tmp_path)
