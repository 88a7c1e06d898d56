import pytest

from lightning_diag.rules.base import StepContext
from lightning_diag.rules.grad import GradBandRule, GradCollapseRule, GradSpreadRule


def run(rule, series):
    return [[(a.rule, a.source) for a in rule.update(x, StepContext(0, i))] for i, x in enumerate(series)]


@pytest.mark.parametrize(
    ("series", "expected_at", "expected"),
    [
        ([{"a": 0.1, "b": 1.0}] * 6, None, None),
        ([{"a": 1e-5, "b": 0.5}] * 4, 2, [("grad_vanish", "a")]),
        ([{"a": 1e-4, "b": 2e-4}] * 4, None, None),  # all small together (converged): not vanishing
        ([{"a": 20.0}] * 4, 0, [("grad_explode", "a")]),  # an explosion is reported at once
        ([{"a": 1e-5, "b": 0.5}, {"a": 0.1, "b": 0.5}] * 3, None, None),  # vanish needs patience
        ([{"a": float("nan")}] * 4, None, None),
    ],
)
def test_band_table(series, expected_at, expected):
    out = run(GradBandRule(), series)
    fired = [(i, x) for i, x in enumerate(out) if x]
    assert fired == ([] if expected is None else [(expected_at, expected)])


def test_band_latches_per_layer_and_rearms():
    rule = GradBandRule()
    out = run(rule, [{"a": 20.0, "b": 20.0}, {"a": 20.0, "b": 1.0}, {"a": 1.0, "b": 20.0}, {"a": 20.0, "b": 20.0}])
    assert out == [[("grad_explode", "a"), ("grad_explode", "b")], [], [("grad_explode", "b")], [("grad_explode", "a")]]


def test_spread():
    assert run(GradSpreadRule(), [{"a": 1.0, "b": 50.0}] * 5) == [[]] * 5
    out = run(GradSpreadRule(), [{"a": 1e-3, "b": 1.0}] * 4)
    assert out == [[], [], [("grad_layer_spread", "model")], []]
    assert run(GradSpreadRule(), [{"a": 0.0, "b": 1.0}] * 4) == [[]] * 4  # zero layers are not a spread


def test_collapse_baseline_and_slow_convergence():
    slow = [1.0 * 0.97**k for k in range(120)]  # falls 38x over a long run: not a collapse
    assert all(not x for x in run(GradCollapseRule(), slow))
    sudden = [1.0] * 8 + [1e-4] * 5
    out = run(GradCollapseRule(), sudden)
    assert [i for i, x in enumerate(out) if x] == [10]


def test_grad_rules_state_roundtrip():
    for rule, feed in (
        (GradBandRule(), {"a": 20.0}),
        (GradSpreadRule(), {"a": 1e-4, "b": 1.0}),
        (GradCollapseRule(), 1.0),
    ):
        for i in range(4):
            rule.update(feed, StepContext(0, i))
        clone = type(rule)()
        clone.load_state_dict(rule.state_dict())
        assert clone.state_dict() == rule.state_dict()
