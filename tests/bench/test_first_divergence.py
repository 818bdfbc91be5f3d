"""``gpu_ab.first_divergence``: where one greedy sequence leaves another, and how close it was."""
from lodestar.bench.gpu_ab import first_divergence


def _lp(chosen: float, top: list[tuple[int, float]]):
    return (chosen, top)


def test_the_same_sequence_never_diverges():
    lps = [_lp(-0.1, [(3, -0.1), (4, -2.0)]), _lp(-0.2, [(5, -0.2), (6, -0.3)])]
    assert first_divergence([3, 5], lps, [3, 5], lps) == {"step": None, "max_abs_dlogprob_before": 0.0}


def test_the_first_differing_step_with_the_margins_there_and_the_drift_before():
    a = [3, 5, 7]
    la = [_lp(-0.1, [(3, -0.1), (4, -2.0)]), _lp(-0.2, [(5, -0.2), (6, -0.25)]), _lp(-0.3, [(7, -0.3), (8, -1.0)])]
    b = [3, 6, 7]
    lb = [_lp(-0.125, [(3, -0.125), (4, -2.0)]), _lp(-0.21, [(6, -0.21), (5, -0.24)]), _lp(-0.3, [(7, -0.3), (8, -1.0)])]
    out = first_divergence(a, la, b, lb)
    assert out["step"] == 1
    assert out["max_abs_dlogprob_before"] == 0.025          # step 0 only
    assert out["margin_a"] == 0.05 and out["margin_b"] == 0.03


def test_a_step_without_a_second_candidate_has_no_margin():
    out = first_divergence([1], [_lp(0.0, [(1, 0.0)])], [2], [_lp(0.0, [(2, 0.0)])])
    assert out == {"step": 0, "max_abs_dlogprob_before": 0.0, "margin_a": None, "margin_b": None}
