"""Issue 43: AnomalyAlarm's parts name what they measured and feed the alarm's preset.

Each part's measures feed exactly the detectors it judged by name before (``Preset.fed_by``), in the order their
alerts came; the detectors that helpers held (``ddp_desync``, ``eval_mode_in_training``, ``nonfinite_rollback``)
are the preset's own attributes, under the checkpoint keys and state layout main's code wrote.
"""

from __future__ import annotations

import math

import pytest

from lightning_diag import AnomalyAlarm
from lightning_diag.rules.amp_not_applied import AmpRule
from lightning_diag.rules.base import FromSettings, StepContext
from lightning_diag.rules.eval_before_training import EvalBeforeTrainingRule
from lightning_diag.rules.eval_randomness import EvalRandomnessRule
from lightning_diag.rules.loss_outlier import LossOutlierRule
from lightning_diag.rules.loss_stagnant import LossStagnantRule
from lightning_diag.rules.loss_swing import LossSwingRule
from lightning_diag.rules.measures import (
    AmpLayers,
    LossWindow,
    Measures,
    OutputSpread,
    ReplicaDifferences,
    Rollback,
    StepLosses,
    TrainOverrides,
    UntrainedInEval,
    Validation,
    ZeroOutputs,
)
from lightning_diag.rules.output_collapse import OutputCollapseRule
from lightning_diag.rules.replicas import DesyncRule
from lightning_diag.rules.rollback import RollbackRule
from lightning_diag.rules.train_mode import EvalModeRule
from lightning_diag.rules.train_override_bypassed import TrainOverrideRule
from lightning_diag.rules.val_decline import ValDeclineRule
from lightning_diag.rules.val_fluctuation import ValFluctuationRule
from lightning_diag.rules.zero_output import ZeroOutputRule

#: What each part of the alarm measures, and the detectors it judged by name before it fed the preset, in the order
#: their alerts came.
PARTS: dict[str, tuple[Measures, tuple[type[FromSettings], ...]]] = {
    "loss trend: a closed period": (
        Measures(loss_window=LossWindow(1.0, steps=16, variance=0.01, lr=0.1, initial=2.3)),
        (LossSwingRule, LossStagnantRule),
    ),
    "loss trend: a validation run": (
        Measures(validation=Validation(1.0, train=0.9, se=0.01, noise_se=0.01, lr=0.1, baseline=2.3)),
        (ValDeclineRule, ValFluctuationRule, LossSwingRule, LossStagnantRule),
    ),
    "replica check": (Measures(replica_differences=ReplicaDifferences([0.0], ["w"], {})), (DesyncRule,)),
    "train-mode check": (Measures(eval_mode={"drop": "dropout"}), (EvalModeRule,)),
    "guard: a rollback": (Measures(rollback=Rollback(50, "NaN/Inf in the loss", "loss", "")), (RollbackRule,)),
    "run-time: train() overrides": (
        Measures(train_overrides=TrainOverrides(["Net"], ["drop"], [])), (TrainOverrideRule,)
    ),
    "run-time: mixed precision": (Measures(amp=AmpLayers({"fc": 10}, {}, "16-mixed")), (AmpRule,)),
    "run-time: step losses": (Measures(step_losses=StepLosses([1.0, 1.1], [1, 2])), (LossOutlierRule,)),
    "run-time: evaluated before training": (
        Measures(untrained_in_eval=UntrainedInEval(["fc"], True)), (EvalBeforeTrainingRule,)
    ),
    "run-time: dropout in evaluation": (Measures(eval_dropouts={"drop": 0.1}), (EvalRandomnessRule,)),
    "sampled: zero outputs": (Measures(zero_outputs=ZeroOutputs(["fc"], [], ["fc"])), (ZeroOutputRule,)),
    "sampled: output spread": (Measures(output_spread=OutputSpread(0.1, 1.0, 8, "<root>")), (OutputCollapseRule,)),
    "sampled: no output seen": (
        Measures(output_spread=OutputSpread(math.nan, math.nan, 0, "")), (OutputCollapseRule,)
    ),
}


@pytest.mark.parametrize("part", list(PARTS))
def test_each_part_feeds_the_detectors_it_judged_before_in_their_order(part: str) -> None:
    m, expected = PARTS[part]
    fed = AnomalyAlarm.preset.fed_by(m.present())
    assert tuple(entry.rule for entry in fed) == expected


def test_feed_judges_a_validation_run_in_the_order_its_alerts_came() -> None:
    alarm = AnomalyAlarm()
    called: list[str] = []
    for entry in AnomalyAlarm.preset.detectors:
        rule = getattr(alarm, entry.attribute)
        judge = getattr(rule, "judge", None)
        if judge is None:  # the non-finite policy decides, it is fed nothing
            continue

        def spy(ctx, m, _judge=judge, _name=entry.rule.__name__):
            called.append(_name)
            return _judge(ctx, m)

        rule.judge = spy  # the test's own detector instances
    ctx = StepContext(0, 10)
    alarm.feed(ctx, PARTS["loss trend: a validation run"][0])
    assert called == ["ValDeclineRule", "ValFluctuationRule", "LossSwingRule", "LossStagnantRule"]
    called.clear()
    alarm.feed(ctx, PARTS["loss trend: a closed period"][0])
    assert called == ["LossSwingRule", "LossStagnantRule"]


def test_the_swing_judges_a_validation_value_only_when_it_is_a_loss() -> None:
    swing = LossSwingRule()
    ctx = StepContext(0, 10)
    assert swing.judge(ctx, Measures(validation=Validation(0.8, se=0.01, is_loss=False))) == []
    assert swing.val_previous is None and swing.val_first is None  # not judged: nothing noted
    swing.judge(ctx, Measures(validation=Validation(0.8, se=0.01)))
    assert swing.val_previous is not None and swing.val_first == 0.8


def test_the_stagnant_rule_takes_the_initial_loss_once_and_notes_validations_by_orientation() -> None:
    rule = LossStagnantRule()
    ctx = StepContext(0, 10)
    assert rule.judge(ctx, Measures(loss_window=LossWindow(2.0, initial=math.nan))) == []
    assert rule.baseline is None  # a non-finite initial loss is no baseline
    rule.judge(ctx, Measures(loss_window=LossWindow(2.0, initial=2.3)))
    rule.judge(ctx, Measures(loss_window=LossWindow(1.9, initial=5.0)))
    assert rule.baseline == 2.3 and rule.points == 3
    # a validation value is noted, not judged as a point; higher_is_better orients it (lower is better inside)
    assert rule.judge(ctx, Measures(validation=Validation(0.7, higher_is_better=True))) == []
    rule.judge(ctx, Measures(validation=Validation(0.9, higher_is_better=True)))
    assert rule.points == 3 and rule.validation == [-0.7, -0.9, 2.0] and rule.validation_improved()


def test_the_detectors_helpers_held_are_the_presets_attributes_under_their_old_keys() -> None:
    alarm = AnomalyAlarm(on_nonfinite="rollback", rules={"nonfinite_rollback": {"lr_factor": 0.25}})
    for attribute, rule, key in (
        ("desync_rule", DesyncRule, "replicas"),
        ("train_mode_rule", EvalModeRule, "train_mode"),
        ("rollback_rule", RollbackRule, "rollback"),
    ):
        (entry,) = [d for d in AnomalyAlarm.preset.detectors if d.rule is rule]
        assert (entry.attribute, entry.key) == (attribute, key) and isinstance(getattr(alarm, attribute), rule)
    # the recovery asks the preset's rollback detector, built from the thresholds in effect
    assert alarm.recovery.rule is alarm.rollback_rule and alarm.rollback_rule.lr_factor == 0.25
    assert alarm.replicas.tolerance == alarm.desync_rule.tolerance


def test_a_checkpoint_in_the_earlier_layout_loads_into_the_detectors() -> None:
    """main's code saved ``ReplicaCheck.state_dict()`` (its rule's state), ``TrainModeCheck.state_dict()`` and the
    recovery's rollback rule under ``replicas``, ``train_mode`` and ``rollback``: those dicts, written out as it
    wrote them, load into the preset's detectors."""
    alarm = AnomalyAlarm(on_nonfinite="rollback")
    state = alarm.state_dict()
    state["replicas"] = {"checks": 3, "last_max_diff": 0.5, "latch": {"replicas": [None, 0]}}
    state["train_mode"] = {"checks": 7, "latch": {"frozen": [None, 0], "trained": [None, 0]}}
    state["rollback"] = {
        "rollbacks": 1, "lr_scale": 0.5, "last_rollback_step": 120, "last_restored_step": 100,
        "latch": {},
    }
    fresh = AnomalyAlarm(on_nonfinite="rollback")
    fresh.load_state_dict(state)
    assert (fresh.desync_rule.checks, fresh.desync_rule.last_max_diff) == (3, 0.5)
    assert fresh.desync_rule.latch.active == {"replicas"}
    assert fresh.train_mode_rule.checks == 7 and fresh.train_mode_rule.latch.active == {"trained", "frozen"}
    assert (fresh.rollbacks, fresh.lr_scale, fresh.rollback_rule.last_restored_step) == (1, 0.5, 100)
    assert {k: fresh.state_dict()[k] for k in ("replicas", "train_mode", "rollback")} == {
        k: state[k] for k in ("replicas", "train_mode", "rollback")
    }
