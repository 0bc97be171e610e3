"""A method's identity (``TransferMethod.identity``): what an ``scd eval`` KL was measured with, which
``scd bench`` matches against what the producer served. It must change with everything the KL depends
on: the producer's weights, the method's kind, version and settings, and what it reads of the pair's
store, on either side."""

import dataclasses

from test_codec_contract import contexts  # noqa: F401 - the module's fixture

from shared.codecs import CODECS, make_method
from shared.model.fingerprint import weights_fingerprint


def test_identity_follows_weights_kind_and_settings(contexts):  # noqa: F811
    pctx, _ = contexts
    fp = weights_fingerprint(pctx.model.model)
    ids = {kind: make_method(kind, pctx).identity(fp) for kind in CODECS}
    assert len(set(ids.values())) == len(CODECS)
    assert all(v.startswith(f"{fp}:{k}.v{CODECS[k].version}:") for k, v in ids.items())
    assert make_method("raw", pctx).identity("another") != ids["raw"]
    assert make_method("raw", pctx, {"dtype": "float32"}).identity(fp) != ids["raw"]
    assert make_method("scd", pctx).identity(fp).endswith(":" + pctx.artifacts.pin)  # the calibration


def test_ridge_identity_follows_its_maps_which_only_the_producer_reads(contexts):  # noqa: F811
    """``ridge``'s maps are producer-side only, so its handshake pin is empty (a consumer without the maps
    must accept the stream); a recalibrated map changes its KL all the same, so its identity names them."""
    pctx, _ = contexts
    def with_maps(sha: str):
        maps = {**pctx.profiles["ridge"], "pin": sha}
        return make_method("ridge", dataclasses.replace(pctx, profiles={**pctx.profiles, "ridge": maps}))

    a, b = with_maps("a" * 16), with_maps("b" * 16)
    assert a.pin() == b.pin() == ""
    assert a.identity("fp") != b.identity("fp") and a.identity("fp").endswith(":" + "a" * 16)
