"""loss_stagnant and grad_frozen: table-driven, framework-free."""

import math

import pytest

from lightning_diag.rules import LossStagnantRule, StepContext
from lightning_diag.rules.grad_frozen import GradFrozenRule
from lightning_diag.rules.loss_stagnant import DEFAULT_STAGNANT_PATIENCE, DEFAULT_STAGNANT_THRESHOLD
from lightning_diag.rules.measures import LossWindow, Measures


def _point(value):
    """The measures of one closed window whose mean training loss is `value`."""
    return Measures(loss_window=LossWindow(value))


def _stuck(stuck):
    """The measures of one gradient measurement whose stuck parameters are `stuck` (of the model :data:`NAMES`)."""
    return Measures(stuck_params=stuck, param_names=NAMES)

def stagnant_fires(baseline, points, **kwargs):
    rule = LossStagnantRule(**kwargs)
    if baseline is not None:
        rule.set_baseline(baseline)
    return [i for i, v in enumerate(points) if rule.judge(StepContext(i, 20 * (i + 1)), _point(v))]


@pytest.mark.parametrize(
    ("name", "baseline", "points", "fires_at"),
    [
        ("chance level throughout", 1.386, [1.385, 1.384, 1.383, 1.382, 1.381], [4]),
        ("chance level, noisy", 1.386, [1.39, 1.37, 1.40, 1.38, 1.39, 1.37, 1.38], [4]),
        ("learns in the first epoch", 1.386, [0.9, 0.5, 0.3, 0.2, 0.1], []),
        ("slow but real learning", 1.40, [1.38, 1.35, 1.30, 1.17, 0.9], []),
        ("learns just too late", 1.40, [1.39, 1.38, 1.39, 1.37, 1.38, 1.0], [4]),
        ("rises by a schedule (KL warm-up)", 1.0, [1.1, 1.2, 1.3, 1.4, 1.5, 1.6], []),
        ("falls 8% over a large floor", 100.0, [99.0, 98.0, 97.2, 96.0, 95.1, 94.0, 93.1, 92.0], []),
        ("no baseline (no step was seen)", None, [1.0, 1.0, 1.0, 1.0, 1.0], []),
        ("negative losses: rule is off", -2.0, [-2.0, -2.0, -2.0, -2.0], []),
        ("non-finite points are skipped", 1.0, [math.nan, 1.0, math.inf, 1.0, 1.0, 1.0, 1.0, 1.0], [6]),
    ],
)
def test_loss_stagnant_table(name, baseline, points, fires_at):
    assert stagnant_fires(baseline, points) == fires_at, name


def test_loss_stagnant_defaults_and_arguments():
    assert (DEFAULT_STAGNANT_THRESHOLD, DEFAULT_STAGNANT_PATIENCE) == (0.10, 4)
    # patience 2, but the trend test needs 5 points to be able to see a trend at alpha 0.05
    assert stagnant_fires(1.0, [0.97] * 6, patience=2, min_drop=0.05) == [4]
    assert stagnant_fires(1.0, [0.94] * 6, patience=2, min_drop=0.05) == []
    rule = LossStagnantRule()
    assert (rule.min_steps, rule.alpha, rule.min_trend) == (50, 0.05, 0.02)


def test_loss_stagnant_needs_steps_of_evidence_not_only_points():
    # one-batch epochs: 30 flat points are 30 steps, not enough; the rule waits for 50 optimizer steps
    rule = LossStagnantRule()
    rule.set_baseline(1.0)
    fired = [i for i in range(60) if rule.judge(StepContext(i, i + 1), _point(1.0 + 0.01 * (-1) ** i))]
    assert fired == [49]


def test_loss_stagnant_fires_once_then_clears_when_learning_starts():
    rule = LossStagnantRule(patience=2)
    rule.set_baseline(1.0)
    out = [rule.judge(StepContext(i, 30 * (i + 1)), _point(v)) for i, v in enumerate([1.0] * 5 + [0.5] * 3)]
    assert [len(a) for a in out] == [0, 0, 0, 0, 1, 0, 0, 0]
    alert = out[4][0]
    assert alert.rule == "loss_stagnant" and alert.severity == "warning" and alert.source == "train_loss"
    assert alert.value == pytest.approx(0.0) and alert.threshold == pytest.approx(0.1)
    assert "initial 1" in alert.message and "targets" in alert.message and "Mann-Kendall" in alert.message
    assert not rule.latch.active and rule.settled  # cleared by the fall (its level: the robust line's end)


def test_loss_stagnant_baseline_is_set_once():
    rule = LossStagnantRule()
    rule.set_baseline(math.nan)
    assert rule.baseline is None
    rule.set_baseline(2.0)
    rule.set_baseline(1.0)
    assert rule.baseline == 2.0


def test_loss_stagnant_state_roundtrip_and_missing_keys():
    rule = LossStagnantRule()
    rule.set_baseline(1.4)
    for i, v in enumerate([1.39, 1.38, 1.39, 1.37, 1.38]):
        rule.judge(StepContext(i, 20 * (i + 1)), _point(v))
    clone = LossStagnantRule()
    clone.load_state_dict(rule.state_dict())
    assert clone.state_dict() == rule.state_dict() and clone.latch.active == {"train_loss"}
    state = rule.state_dict()
    del state["baseline"]
    with pytest.raises(KeyError, match="baseline"):
        LossStagnantRule().load_state_dict(state)


NAMES = [
    "pos",
    "embed.weight",
    "enc.0.lin.weight",
    "enc.0.lin.bias",
    "enc.1.lin.weight",
    "enc.1.norm.weight",
    "head.weight",
]


@pytest.mark.parametrize(
    ("stuck", "sources"),
    [
        ({}, []),
        ({"enc.1.lin.weight": "frozen", "enc.1.norm.weight": "frozen"}, ["enc.1"]),  # a whole block: one alert
        ({"enc.0.lin.bias": "frozen"}, ["enc.0.lin"]),  # part of a module: the owning module
        ({"head.weight": "excluded"}, ["head"]),
        ({"pos": "frozen"}, ["pos"]),  # a parameter of the model itself
        ({"enc.0.lin.weight": "frozen", "enc.1.lin.weight": "excluded"}, ["enc.0.lin", "enc.1.lin"]),
    ],
)
def test_grad_frozen_groups_by_outermost_fully_stuck_module(stuck, sources):
    alerts = GradFrozenRule().judge(StepContext(0, 0), _stuck(stuck))
    assert [a.source for a in alerts] == sources
    # requires_grad=False is deliberate freezing (info); a trainable parameter in no optimizer is a warning.
    reasons = {a.source: {r for name, r in stuck.items() if name.startswith(a.source)} for a in alerts}
    for a in alerts:
        expected = "info" if reasons[a.source] == {"frozen"} else "warning"
        assert a.rule == "grad_frozen" and a.severity == expected, (a.source, a.severity)


def test_grad_frozen_zero_grad_in_the_graph_needs_patience_and_latches():
    rule = GradFrozenRule(patience=3)
    stuck = {"enc.0.lin.weight": "zero_grad", "enc.0.lin.bias": "zero_grad"}
    rule.judge(StepContext(0, -1), _stuck({}))  # it had a gradient at the first measurement, then lost it
    out = [rule.judge(StepContext(0, i), _stuck(stuck)) for i in range(5)]
    assert [len(a) for a in out] == [0, 0, 1, 0, 0]
    assert out[2][0].severity == "warning" and "exactly zero" in out[2][0].message
    assert rule.judge(StepContext(0, 5), _stuck({})) == [] and not rule.latch.active  # it learns again: cleared
    assert [len(rule.judge(StepContext(0, 6 + i), _stuck(stuck))) for i in range(3)] == [0, 0, 1]


def test_grad_frozen_parameters_outside_the_graph_are_one_info_listing_them():
    # modules built but never called (an optional head, an encoder this configuration skips): nothing to fix
    rule = GradFrozenRule(patience=3)
    stuck = {"enc.0.lin.weight": "no_grad", "enc.0.lin.bias": "no_grad", "head.weight": "no_grad"}
    out = [rule.judge(StepContext(0, i), _stuck(stuck)) for i in range(6)]
    assert [len(a) for a in out] == [0, 0, 1, 0, 0, 0]
    (alert,) = out[2]
    assert (alert.rule, alert.severity, alert.source) == ("grad_frozen", "info", "unused")
    assert "`enc.0`" in alert.message and "`head`" in alert.message and "never ran" in alert.message
    assert alert.value == 3.0
    # once: gone and back, it is not repeated; a state round trip keeps that
    rule.judge(StepContext(0, 6), _stuck({}))
    clone = GradFrozenRule(patience=3)
    clone.load_state_dict(rule.state_dict())
    assert [len(clone.judge(StepContext(0, 7 + i), _stuck(stuck))) for i in range(4)] == [0, 0, 0, 0]
    partial = rule.state_dict()
    del partial["unused"]
    with pytest.raises(KeyError, match="'unused'"):
        GradFrozenRule().load_state_dict(partial)


def test_grad_frozen_message_names_parameters_and_reason():
    stuck = _stuck({"enc.1.lin.weight": "frozen", "enc.1.norm.weight": "frozen"})
    (alert,) = GradFrozenRule().judge(StepContext(0, 0), stuck)
    assert "`enc.1.lin.weight`" in alert.message and "requires_grad" in alert.message
    assert "expect_frozen" in alert.message
    (alert,) = GradFrozenRule().judge(StepContext(0, 0), _stuck({"head.weight": "excluded"}))
    assert "optimizer" in alert.message


def test_grad_frozen_state_roundtrip():
    rule = GradFrozenRule()
    rule.judge(StepContext(0, 0), _stuck({"enc.0.lin.weight": "no_grad"}))
    clone = GradFrozenRule()
    clone.load_state_dict(rule.state_dict())
    assert clone.state_dict() == rule.state_dict()
