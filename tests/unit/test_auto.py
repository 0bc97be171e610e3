"""``auto``'s choice from an operating table: the quality bound, the expected time, the link."""

import pytest

from shared.auto import DEFAULT_LINK_MBPS, MIN_SAMPLE_BYTES, AutoSettings, LinkEstimator, choose, expected_ms
from shared.errors import InvalidRequest, PreconditionFailed


def _pt(label, kl, bpt, enc=0.0, rec=0.0):
    method, _, rest = label.partition(":")
    params = dict(kv.split("=") for kv in rest.split(";") if kv)
    return {"label": label, "method": method, "params": params, "pin": "", "kl": kl, "kl_by_kind": {},
            "bytes_per_token": bpt, "encode_ms_per_token": enc, "reconstruct_ms_per_token": rec}


# a drifting pair: raw is far off, a corrector reaches half of raw at a compute cost
STRONG = {"raw_kl": 0.5, "points": [
    _pt("oracle", 0.0, 0.0, rec=2.0), _pt("raw", 0.5, 23000), _pt("quant", 0.6, 8000, enc=0.02),
    _pt("scd", 0.2, 5000, enc=0.05, rec=0.8), _pt("droidspeak", 0.15, 18000, rec=1.0)]}
# a pair that barely drifts: no point reaches half of raw's KL
MILD = {"raw_kl": 0.005, "points": [
    _pt("raw", 0.005, 23000), _pt("quant", 0.008, 8000, enc=0.02), _pt("ridge", 0.0035, 23000, enc=0.1),
    _pt("ridge:budget=0.4", 0.0045, 9200, enc=0.2, rec=0.05)]}


def test_the_bound_is_half_of_raw_where_some_point_reaches_it():
    c = choose(STRONG, 1000, 1000, "setting")
    assert c.method == "scd" and "0.5x raw" in c.reason  # droidspeak is within too, but slower
    assert c.label in c.reason and "1000 Mbit/s" in c.reason and "next: droidspeak" in c.reason


def test_without_a_point_at_half_of_raw_the_bound_is_raw_and_the_cheapest_in_time_wins():
    fast = choose(MILD, 1000, 100, "measured")
    assert fast.label == "ridge:budget=0.4" and fast.params == {"budget": "0.4"}  # quant is over raw's KL
    # on a very fast link the bytes stop mattering: raw costs no compute at all
    assert choose(MILD, 1000, 1e6, "setting").label == "raw"


def test_the_oracle_and_methods_not_offered_or_not_usable_are_never_chosen():
    assert choose(STRONG, 1000, 0.001, "setting").method != "oracle"  # even on a link that crawls
    c = choose(STRONG, 1000, 1000, "setting", offered={"raw", "quant", "droidspeak"})
    assert c.method == "droidspeak"
    c = choose(STRONG, 1000, 1000, "setting", usable=lambda p: p["method"] != "scd")
    assert c.method == "droidspeak"
    with pytest.raises(PreconditionFailed, match="calibrate --method auto"):
        choose(STRONG, 1000, 1000, "setting", offered={"oracle"})


def test_an_explicit_bound_and_none_within_it():
    loose = AutoSettings(max_kl_vs_raw=1.0)  # raw, scd and droidspeak qualify
    assert choose(STRONG, 1000, 1000, "setting", loose).method == "raw"  # 184 ms on the wire, no compute
    assert choose(STRONG, 1000, 10, "setting", loose).method == "scd"  # the bytes dominate
    c = choose(STRONG, 1000, 1000, "setting", AutoSettings(max_kl_vs_raw=0.01))
    assert c.method == "droidspeak" and "none within" in c.reason  # the most accurate, said so


def test_ties_in_time_and_kl_go_to_the_fewest_bytes_and_a_worse_kl_is_no_tie():
    """Expected times within 5% and KLs within 10% of the lowest among them are below what the
    table resolves: the point with fewer bytes is served; a clearly worse KL is not traded for bytes."""
    table = {"raw_kl": 0.006, "points": [
        _pt("raw", 0.006, 22000), _pt("ridge:k_bits=8;v_bits=8", 0.00228, 12000, enc=0.14, rec=0.07),
        _pt("ridge:k_bits=8;v_bits=6", 0.00234, 10600, enc=0.15, rec=0.08),
        _pt("ridge:budget=0.4", 0.0028, 9000, enc=0.27, rec=0.1)]}
    one_g = choose(table, 1000, 1000, "setting")  # 306 ms against 315: a tie; 12,000 vs 10,600 bytes
    assert one_g.label == "ridge:k_bits=8;v_bits=6"
    assert "a tie with the fastest (ridge:k_bits=8;v_bits=8" in one_g.reason
    strict = choose(table, 1000, 1000, "setting", AutoSettings(time_tolerance=0))
    assert strict.label == "ridge:k_bits=8;v_bits=8" and "tie" not in strict.reason
    # at 100 Mbit/s ridge:budget=0.4 ties k_bits=8;v_bits=6 in time (1090 vs 1078 ms) with the fewest
    # bytes, but its KL is 20% higher: not a tie
    slow = choose(table, 1000, 100, "setting")
    assert slow.label == "ridge:k_bits=8;v_bits=6", slow.reason
    assert choose(table, 1000, 100, "setting", AutoSettings(kl_tolerance=0.5)).label == "ridge:budget=0.4"


def test_expected_time_is_compute_plus_bytes_over_the_link():
    p = _pt("x", 0.1, 1000, enc=0.1, rec=0.4)
    assert expected_ms(p, 2000, 8.0) == pytest.approx(2000 * 0.5 + 2000 * 1000 * 8 / 8e6 * 1e3)


def test_settings_are_checked_with_a_message_that_names_them():
    with pytest.raises(InvalidRequest, match="link_mbps"):
        AutoSettings.parse({"link_mbps": "-3"})
    with pytest.raises(InvalidRequest, match=r"bits: not a known setting \(its settings: link_mbps, max_kl_vs_raw, "
                       r"time_tolerance, kl_tolerance\)"):
        AutoSettings.parse({"bits": "4"})
    for rate in ("0", "1e-300", "5e-324", "1e308"):  # a plan of 10^300 ms (or inf) at "0 Mbit/s"
        with pytest.raises(InvalidRequest, match=r"link_mbps: Input should be (greater|less) than or equal to") as e:
            AutoSettings.parse({"link_mbps": rate})
        assert e.value.param == "link_mbps"
    assert AutoSettings.parse({"link_mbps": "250"}).link_mbps == 250
    assert AutoSettings.parse({"link_mbps": "0.001"}).link_mbps == 0.001


def test_the_link_estimate_is_the_best_recent_goodput_of_transfers_big_enough_to_say():
    links = LinkEstimator(window=3)
    assert links.estimate("a") == (DEFAULT_LINK_MBPS, "default, nothing measured yet")
    links.observe("a", 1000, 1.0)  # too small to say anything about the rate
    assert links.estimate("a")[0] == DEFAULT_LINK_MBPS
    for ms in (800.0, 200.0, 400.0):
        links.observe("a", MIN_SAMPLE_BYTES * 100, ms)
    rate, source = links.estimate("a")
    assert rate == pytest.approx(MIN_SAMPLE_BYTES * 100 * 8 / 0.2 / 1e6) and source == "best of 3 recent transfers"
    links.observe("a", MIN_SAMPLE_BYTES * 100, 1000.0)  # the window forgets the oldest, not the best yet
    links.observe("a", MIN_SAMPLE_BYTES * 100, 1000.0)
    links.observe("a", MIN_SAMPLE_BYTES * 100, 1000.0)  # now the fast one has left the window
    assert links.estimate("a")[0] == pytest.approx(MIN_SAMPLE_BYTES * 100 * 8 / 1.0 / 1e6)
    assert links.estimate("a", setting=42.0) == (42.0, "setting")
    assert links.estimate("b")[1].startswith("default")


def test_a_fallback_because_better_points_are_stale_says_so():
    """``auto`` chose DroidSpeak on every built-in pair for weeks because the table's SCD points no
    longer matched the artifacts, and nothing said so: the reason names the stale better points and
    the command that remakes the table; a point that is merely worse says nothing."""
    table = {**STRONG, "pair": "strong"}
    c = choose(table, 1000, 1000, "setting", usable=lambda p: p["method"] != "scd")
    assert c.method == "droidspeak" and "fell back" not in c.reason  # scd's KL is above droidspeak's
    c = choose(table, 1000, 1000, "setting", usable=lambda p: p["method"] != "droidspeak")
    assert c.method == "scd" and "fell back: 1 point(s) of lower validation KL" in c.reason
    assert "droidspeak: stale" in c.reason and "scd calibrate --pair strong --method auto" in c.reason
    assert "fell back" not in choose(table, 1000, 1000, "setting").reason


def test_stale_points_names_each_point_measured_with_other_artifacts(tiny_pair, tiny_artifacts):
    from shared.auto import stale_points
    from shared.codecs import CodecContext, make_method
    from shared.engine import load_context

    producer, _ = tiny_pair
    ctx = load_context(producer, tiny_artifacts[0], "producer")
    pin = make_method("scd", ctx).calibration()
    table = {"pair": "tiny", "raw_kl": 0.5, "points": [
        {**_pt("raw", 0.5, 100)}, {**_pt("scd", 0.2, 10), "pin": pin}, {**_pt("scd-reuse", 0.3, 10), "pin": "old"},
        {**_pt("droidspeak", 0.1, 50), "pin": "x"}]}
    stale = stale_points(table, ctx)
    assert set(stale) == {"scd-reuse", "droidspeak"} and "stale (measured with calibration 'old'" in stale["scd-reuse"]
    assert "cannot be made here" in stale["droidspeak"]  # no profile: it needs its blocks
    assert stale_points(table, ctx, offered={"raw", "scd"}) == {}
    assert "cannot be made" in stale_points(table, CodecContext(producer))["scd"]  # no artifacts at all
