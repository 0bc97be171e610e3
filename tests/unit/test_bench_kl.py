"""``scd bench`` quotes a method's KL from an ``scd eval`` file only where the eval measured what the run
served (``tools.bench.runner.matched_kl``); otherwise it says why not."""

import json

import pytest

from tools.bench.runner import BenchConfig, _kl, matched_kl

SERVED = {"oracle": "fp:oracle.v1:s0:", "raw": "fp:raw.v1:s1:", "scd": "fp:scd.v7:s2:pinB"}


def _file(tmp_path, methods, native_prefix="on"):
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"methods": methods, "native_prefix": native_prefix}))
    return path


def test_a_kl_is_used_only_for_the_method_it_was_measured_with(tmp_path):
    path = _file(tmp_path, {"oracle": {"kl": 0.0, "identity": SERVED["oracle"]},
                            "raw": {"kl": 0.5, "identity": SERVED["raw"]},
                            "scd": {"kl": 0.19, "identity": "fp:scd.v7:s2:pinA"}})  # calibrated again since
    measured, src = _kl(BenchConfig(kl_json=str(path)))
    assert src == str(path)
    kl, unused = matched_kl(measured, SERVED, native_prefix=True)
    assert kl == {"oracle": 0.0, "raw": 0.5}
    assert set(unused) == {"scd"} and "calibration" in unused["scd"] and "settings" not in unused["scd"]


@pytest.mark.parametrize("entry, native, why", [
    ({"kl": 0.5}, True, "does not say what it was measured with"),  # an eval from before identities
    ({"kl": 0.5, "identity": "fp:raw.v1:s9:"}, True, "settings"),  # raw:dtype=float32 against the default
    ({"kl": 0.5, "identity": "other:raw.v1:s1:"}, True, "producer weights"),
    ({"kl": 0.5, "identity": SERVED["raw"]}, False, "native prefix on, this run off"),
    (None, True, "not in the file"),
])
def test_why_a_kl_is_not_used(tmp_path, entry, native, why):
    path = _file(tmp_path, {"oracle": {"kl": 0.0, "identity": SERVED["oracle"]}, **({"raw": entry} if entry else {})})
    measured, _ = _kl(BenchConfig(kl_json=str(path)))
    kl, unused = matched_kl(measured, {"raw": SERVED["raw"]}, native_prefix=native)
    assert kl == {} and why in unused["raw"], unused


def test_auto_gets_no_kl_from_an_eval(tmp_path):
    """``auto`` picks its method per request by the link rate, so the eval's KL (at its own rate) is not the run's."""
    path = _file(tmp_path, {"auto": {"kl": 0.2}})
    kl, unused = matched_kl(_kl(BenchConfig(kl_json=str(path)))[0], {"auto": "fp:scd.v2:s:p"}, native_prefix=True)
    assert kl == {} and "per request" in unused["auto"]
