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
