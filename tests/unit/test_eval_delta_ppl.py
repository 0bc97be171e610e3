"""dPPL% is relative to the Oracle's perplexity: without the oracle among the methods it is unknown
(null in the JSON, '-' in the table), not +0.0."""

from tools.eval.harness import Acc
from tools.eval.report import print_table


def _acc() -> Acc:
    a = Acc()
    a.kl, a.top1, a.bytes_per_token, a.encode_ms, a.reconstruct_ms = [0.1], [0.9], [100.0], [1.0], [2.0]
    a.tokens, a.kinds, a.nll, a.nll_tokens = [10], ["qa"], 5.0, 4
    return a


def test_delta_ppl_is_unknown_without_the_oracle(capsys):
    s = _acc().summary(None)
    assert s["delta_ppl_pct"] is None
    assert _acc().summary(s["ppl"] / 2)["delta_ppl_pct"] == 100.0
    print_table({"methods": {"raw": s}})
    row = capsys.readouterr().out.splitlines()[-1].split()
    assert row[0] == "raw" and row[5] == "-"  # method, KL, top1, taskF1 (-), agreeF1 (-), dPPL%


def test_delta_ppl_is_unknown_with_nothing_to_score_it_on(capsys):
    """No gold answer and no continuation (an operator's prompt alone): there is no perplexity to
    compare, for the Oracle or the method, so the column says '-' (it said +0.0)."""
    oracle, method = _acc(), _acc()
    oracle.nll = method.nll = 0.0
    oracle.nll_tokens = method.nll_tokens = 0
    o = oracle.summary(None)
    s = method.summary(o["ppl"])
    assert o["ppl"] is None and s["ppl"] is None and s["delta_ppl_pct"] is None
    print_table({"methods": {"raw": s}})
    assert capsys.readouterr().out.splitlines()[-1].split()[5] == "-"
