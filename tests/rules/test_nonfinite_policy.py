"""The non-finite policy as a table: a sequence of steps in, the verdicts and alerts out, for every action."""

import pytest

from lightning_diag.rules.base import StepContext
from lightning_diag.rules.nonfinite import NonFinitePolicy
from lightning_diag.rules.verdicts import NonFiniteDetails, StepFindings, Verdict

# ok: clean step; loss / grad: a NaN in the loss / only in a gradient; ovf: a GradScaler overflow (finite loss,
# bad gradient, scaler active); nan-amp: a NaN loss under a GradScaler; ok-amp: a clean step under a scaler.
STEPS = {
    "ok": StepFindings(False, False),
    "loss": StepFindings(True, True),
    "grad": StepFindings(False, True),
    "ovf": StepFindings(False, True, scaler_active=True),
    "nan-amp": StepFindings(True, True, scaler_active=True),
    "ok-amp": StepFindings(False, False, scaler_active=True),
}
A, S, T, R = "apply", "skip", "stop", "raise"

TABLE = [
    # (action, settings, steps, verdicts, alert sources per step)
    ("stop", {}, ["ok", "loss", "loss"], [A, T, T], [[], ["loss"], ["loss"]]),
    ("stop", {}, ["grad"], [T], [["gradients"]]),
    ("raise", {}, ["ok", "grad"], [A, R], [[], ["gradients"]]),
    ("warn", {}, ["loss", "loss", "ok", "loss", "grad"], [A] * 5, [["loss"], [], [], ["loss"], ["gradients"]]),
    (
        "skip",
        {"max_skips": 2},
        ["loss", "loss", "ok", "grad", "loss"],
        [S, S, A, T, T],
        [["loss"], [], [], ["gradients", "skip_limit"], ["loss", "skip_limit"]],
    ),
    ("skip", {"max_skips": 0}, ["grad"], [T], [["gradients", "skip_limit"]]),
    # the scaler's own overflows: only the max_scaler_overflows-th consecutive one is a fault
    (
        "stop",
        {"max_scaler_overflows": 3},
        ["ovf", "ovf", "ok-amp", "ovf", "ovf", "ovf"],
        [A, A, A, A, A, T],
        [[], [], [], [], [], ["gradients"]],
    ),
    ("skip", {"max_scaler_overflows": 2}, ["ovf", "ovf", "ovf"], [A, S, S], [[], ["gradients"], []]),
    # a NaN loss is never the scaler's business
    ("stop", {"max_scaler_overflows": 3}, ["nan-amp"], [T], [["loss"]]),
]
IDS = [f"{row[0]}-{'-'.join(row[2])}" for row in TABLE]


def run(policy, steps, start=0):
    verdicts, sources = [], []
    for i, name in enumerate(steps, start=start):
        decision = policy.decide(STEPS[name], StepContext(0, i))
        verdicts.append(decision.verdict.value)
        sources.append([a.source for a in decision.alerts])
        if decision.verdict is Verdict.RAISE:
            assert decision.error is decision.alerts[0]
        assert all(a.global_step == i and a.severity == "critical" for a in decision.alerts)
    return verdicts, sources


@pytest.mark.parametrize(("action", "settings", "steps", "verdicts", "sources"), TABLE, ids=IDS)
def test_policy_table(action, settings, steps, verdicts, sources):
    assert run(NonFinitePolicy(action, **settings), steps) == (verdicts, sources)


@pytest.mark.parametrize(("action", "settings", "steps", "verdicts", "sources"), TABLE, ids=IDS)
def test_policy_resumed_at_every_step_decides_the_same(action, settings, steps, verdicts, sources):
    for split in range(len(steps) + 1):
        first = NonFinitePolicy(action, **settings)
        before = run(first, steps[:split])
        second = NonFinitePolicy(action, **settings)
        second.load_state_dict(first.state_dict())
        after = run(second, steps[split:], start=split)
        assert (before[0] + after[0], before[1] + after[1]) == (verdicts, sources), split


def test_alert_names_the_rule_the_step_and_the_details():
    details = NonFiniteDetails({"AdamW/group_0": 3e-4}, ("encoder.weight", "..."), 1.25)
    decision = NonFinitePolicy("skip").decide(STEPS["grad"], StepContext(2, 17), lambda: details)
    (alert,) = decision.alerts
    assert (alert.rule, alert.epoch, alert.global_step) == ("nonfinite_grad", 2, 17)
    for text in ("global step 17", "the update was skipped", "AdamW/group_0=0.0003", "encoder.weight", "1.25"):
        assert text in alert.message


def test_details_are_gathered_only_for_an_alerting_step():
    calls = []

    def details():
        calls.append(1)
        return NonFiniteDetails()

    policy = NonFinitePolicy("stop", max_scaler_overflows=2)
    policy.decide(STEPS["ok"], StepContext(0, 0), details)
    policy.decide(STEPS["ovf"], StepContext(0, 1), details)
    assert calls == []
    policy.decide(STEPS["ovf"], StepContext(0, 2), details)
    assert calls == [1]


@pytest.mark.parametrize(
    ("found", "expected"),
    [
        ([(None, None)], [[]]),
        ([(5, None)], [[("nonfinite_loss", 5)]]),
        ([(None, 7)], [[("nonfinite_grad", 7)]]),
        ([(3, 2)], [[("nonfinite_loss", 3)]]),  # a bad loss names the loss, at its first step
        ([(4, 4), (9, 9)], [[("nonfinite_loss", 4)], []]),  # the episode goes on: latched
        ([(4, 4), (None, None), (9, 9)], [[("nonfinite_loss", 4)], [], [("nonfinite_loss", 9)]]),
    ],
)
def test_deferred_read_back_table(found, expected):
    policy = NonFinitePolicy("warn")
    out = [
        [(a.rule, a.global_step) for a in policy.decide_deferred(loss, grad, StepContext(1, 20))]
        for loss, grad in found
    ]
    assert out == expected


def test_state_round_trip_and_missing_latch():
    policy = NonFinitePolicy("skip", max_skips=9)
    for name in ("loss", "loss", "ovf"):
        policy.decide(STEPS[name], StepContext(0, 0))
    state = policy.state_dict()
    assert state == {"skips": 2, "scaler_overflows": 1, "latch": {"loss": [None, 0.0]}}  # the overflow applied
    clone = NonFinitePolicy("skip", max_skips=9)
    clone.load_state_dict(state)
    assert clone.state_dict() == state
    with pytest.raises(KeyError, match="latch"):
        clone.load_state_dict({"skips": 1})


def test_unknown_action_is_rejected():
    with pytest.raises(ValueError, match="action"):
        NonFinitePolicy("explode")  # type: ignore[arg-type]


def test_rollback_action_hands_the_alert_to_the_callback():
    policy = NonFinitePolicy("rollback")
    ctx = StepContext(0, 4)
    decision = policy.decide(STEPS["loss"], ctx)
    assert decision.verdict is Verdict.ROLLBACK and decision.alerts == ()
    assert decision.error is not None and decision.error.rule == "nonfinite_loss"
    assert policy.decide(STEPS["ok"], StepContext(0, 5)).verdict is Verdict.APPLY


def test_a_localised_source_names_the_alert_and_the_episode_still_clears():
    policy = NonFinitePolicy("skip", max_skips=5)
    where = NonFiniteDetails(source="net.4", located="Linear `net.4` forward: 3 NaN / 0 Inf from finite inputs")
    first = policy.decide(STEPS["loss"], StepContext(0, 1), lambda: where)
    assert [a.source for a in first.alerts] == ["net.4"] and "First non-finite value: Linear" in first.alerts[0].message
    assert policy.decide(STEPS["loss"], StepContext(0, 2), lambda: where).alerts == ()  # same episode
    policy.decide(STEPS["ok"], StepContext(0, 3))
    assert [a.source for a in policy.decide(STEPS["loss"], StepContext(0, 4), lambda: where).alerts] == ["net.4"]
