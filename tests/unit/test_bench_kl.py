"""``scd bench`` quotes a method's KL from an ``scd eval`` file only where the eval measured what the run
served (``tools.bench.runner.matched_kl``); otherwise it says why not."""

import json

import pytest

from tools.bench.runner import BenchConfig, _kl, matched_kl

IDS = {"oracle": "fp:oracle.v1:s0:", "raw": "fp:raw.v1:s1:", "scd": "fp:scd.v7:s2:pinB"}
SERVED = {m: (i, "cfpA") for m, i in IDS.items()}


def _file(tmp_path, methods, native_prefix="on", consumer="cfpA"):
    path = tmp_path / "eval.json"
    body = {"methods": methods, "native_prefix": native_prefix}
    if consumer:
        body["models"] = {"producer": "fp", "consumer": consumer}
    path.write_text(json.dumps(body))
    return path


def _match(path, served, native=True):
    return matched_kl(_kl(BenchConfig(kl_json=str(path)))[0], served, native_prefix=native)


def test_a_kl_is_used_only_for_the_method_it_was_measured_with(tmp_path):
    path = _file(tmp_path, {"oracle": {"kl": 0.0, "identity": IDS["oracle"]},
                            "raw": {"kl": 0.5, "identity": IDS["raw"]},
                            "scd": {"kl": 0.19, "identity": "fp:scd.v7:s2:pinA"}})  # calibrated again since
    assert _kl(BenchConfig(kl_json=str(path)))[1] == str(path)
    kl, unused = _match(path, SERVED)
    assert kl == {"oracle": 0.0, "raw": 0.5}
    assert set(unused) == {"scd"} and "calibration" in unused["scd"] and "settings" not in unused["scd"]


@pytest.mark.parametrize("entry, native, consumer, why", [
    ({"kl": 0.5}, True, "cfpA", "does not say what it was measured with"),  # an eval from before identities
    ({"kl": 0.5, "identity": "fp:raw.v1:s9:"}, True, "cfpA", "settings"),  # raw:dtype=float32 against the default
    ({"kl": 0.5, "identity": "other:raw.v1:s1:"}, True, "cfpA", "producer weights"),
    ({"kl": 0.5, "identity": IDS["raw"]}, True, "cfpB", "another consumer model"),  # another pair's eval
    ({"kl": 0.5, "identity": IDS["raw"]}, True, None, "which consumer model"),
    ({"kl": 0.5, "identity": IDS["raw"]}, False, "cfpA", "native prefix on, this run off"),
    (None, True, "cfpA", "not in the file"),
])
def test_why_a_kl_is_not_used(tmp_path, entry, native, consumer, why):
    path = _file(tmp_path, {"oracle": {"kl": 0.0, "identity": IDS["oracle"]}, **({"raw": entry} if entry else {})},
                 consumer=consumer)
    kl, unused = _match(path, {"raw": SERVED["raw"]}, native)
    assert kl == {} and why in unused["raw"], unused


def test_auto_gets_no_kl_from_an_eval(tmp_path):
    """``auto`` picks its method per request by the link rate, so the eval's KL (at its own rate) is not the run's."""
    kl, unused = _match(_file(tmp_path, {"auto": {"kl": 0.2}}), {"auto": ("fp:scd.v2:s:p", "cfpA")})
    assert kl == {} and "per request" in unused["auto"]
