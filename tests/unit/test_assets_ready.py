"""A prepared model folder counts as ready only while it is whole: a folder whose weights were
removed or cut short after `scd assets` made it counted as ready, so `scd assets` failed on it
("has no model*.safetensors weights") instead of making it again."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from tools.assets.models import _DONE, _finish, is_ready


def _prepared(tmp_path):
    tmp, final = tmp_path / "m.tmp", tmp_path / "m"
    tmp.mkdir()
    (tmp / "config.json").write_text("{}")
    save_file({"w": torch.zeros(64)}, tmp / "model.safetensors")
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


def test_an_earlier_builds_marker_with_weights_cut_short_is_not_ready(tmp_path):
    """The cache of an earlier checkout keeps its marker ("ok"): a weights file cut short there
    counted as ready, so `scd assets`, which the load's error names, did nothing."""
    final = _prepared(tmp_path)
    (final / _DONE).write_text("ok\n")
    whole = (final / "model.safetensors").read_bytes()
    (final / "model.safetensors").write_bytes(whole[: len(whole) - 16])
    assert not is_ready(final)


def test_a_built_in_folder_that_does_not_load_names_scd_assets(tmp_path, monkeypatch):
    """The services load a built-in pair's folder themselves (not through the CLI's pair loader):
    a damaged one said what was wrong with the file but not that `scd assets` makes it again."""
    from shared.model.loading import ModelFolderError, load_model
    from shared.model.tiny import save_pretrained, tiny_model

    monkeypatch.setenv("SCD_HOME", str(tmp_path / "home"))
    for where, hinted in ((tmp_path / "home" / "models" / "m", True), (tmp_path / "mine", False)):
        save_pretrained(tiny_model(), where)
        weights = where / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
        with pytest.raises(ModelFolderError) as e:
            load_model(where)
        assert ("scd assets" in str(e.value)) is hinted and "model.safetensors" in str(e.value)


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
