import pytest

from lightning_diag.rules import Latch, LossSwingRule, StepContext, ValDeclineRule, ValFluctuationRule
from lightning_diag.rules.measures import LossWindow, Measures, Validation


def _val(train, val):
    """The measures of one validation run of value `val` after a mean training loss of `train`."""
    return Measures(validation=Validation(val, train=train))


def _validate(rule, i, train, val):
    """`rule`'s alerts on the `i`-th validation run (epoch `i`, 20 steps an epoch)."""
    return rule.judge(StepContext(i, 20 * (i + 1)), _val(train, val))


def feed(rule, values, spread=(0.01**2, 20)):
    """Feed the values; to ``loss_swing``, as epoch means of 20 steps whose step losses spread by 0.01 (far below
    the changes judged)."""
    def measures(v):
        if isinstance(rule, LossSwingRule):
            return Measures(loss_window=LossWindow(v, steps=spread[1], variance=spread[0]))
        return Measures(validation=Validation(v))

    return [len(rule.judge(StepContext(i, 20 * (i + 1)), measures(v))) for i, v in enumerate(values)]


@pytest.mark.parametrize(
    ("name", "losses", "fires_at"),
    [
        ("steady 20% fall", [2.0 * 0.8**k for k in range(10)], []),
        ("steady 50% fall", [2.0 * 0.5**k for k in range(8)], []),
        ("plateau with noise", [1.0, 1.02, 0.99, 1.01, 1.0, 0.98], []),
        ("oscillation", [1.0, 0.8, 1.0, 0.8, 1.0, 0.8], [4]),
        ("steady rise", [1.0, 1.15, 1.35, 1.6, 1.9], [3]),
        ("two rises only", [1.0, 1.2, 1.45, 1.44, 1.43], []),
        ("rise, rise, crash", [1.0, 1.2, 1.45, 1.0, 0.9], [3]),
        ("near zero jitter", [0.0010, 0.0005, 0.0012, 0.0006, 0.0013], []),
    ],
)
def test_loss_swing_table(name, losses, fires_at):
    fired = feed(LossSwingRule(), losses)
    assert [i for i, n in enumerate(fired) if n] == fires_at, name


# The demo curriculum (lightning_diag/demo/schedules.py, seed 3) as measured: epochs of 16 steps, then from epoch 4
# sequences twice as long join the set (32 steps an epoch): the loss rises twice on the harder data and falls back.
CURRICULUM = [  # (epoch mean, steps, step-loss standard deviation)
    (1.0065, 16, 0.0497), (0.2663, 16, 0.0357), (0.0293, 16, 0.0042), (0.0048, 16, 0.0009),
    (0.0117, 32, 0.0131), (0.0795, 32, 0.0868), (0.0231, 32, 0.0606), (0.0145, 32, 0.0287),
]


def feed_points(rule, points):
    return [
        len(rule.judge(StepContext(i, 16 * (i + 1)), Measures(loss_window=LossWindow(v, steps=n, variance=sd**2))))
        for i, (v, n, sd) in enumerate(points)
    ]


def test_loss_swing_a_larger_training_set_is_a_level_shift_not_a_swing():
    # the epoch where the step count doubles is a mean over other data: its rise is the data's, so the rise and the
    # fall after it are two swinging points at most (the measured healthy false alarm of 6 December 2026)
    assert feed_points(LossSwingRule(), CURRICULUM) == [0] * len(CURRICULUM)
    # the same means over one unchanged training set are "rise, rise, crash": they swing
    same_data = [(v, 32, sd) for v, _, sd in CURRICULUM]
    assert feed_points(LossSwingRule(), same_data) == [0, 0, 0, 0, 0, 0, 1, 0]
    # an oscillation on the new data still fires once the set stays the same size
    after = [*CURRICULUM[:5], (0.02, 32, 0.002), (0.03, 32, 0.002), (0.02, 32, 0.002), (0.03, 32, 0.002)]
    assert feed_points(LossSwingRule(), after) == [0, 0, 0, 0, 0, 0, 0, 1, 0]
    # fewer steps are no other data: an epoch cut short (a stop, non-finite losses left out) still swings
    cut = [(1.0, 32, 0.01), (1.2, 32, 0.01), (1.0, 32, 0.01), (1.2, 10, 0.01)]
    assert feed_points(LossSwingRule(), cut) == [0, 0, 0, 1]


def test_loss_swing_latches_and_rearms():
    rule = LossSwingRule()
    # swing 3 times (fires), keep swinging (quiet), calm down (clears), swing again (fires again)
    values = [1.0, 0.8, 1.0, 0.8, 1.0, 0.8, 0.79, 0.78, 0.77, 1.0, 0.8, 1.0]
    fired = feed(rule, values)
    assert [i for i, n in enumerate(fired) if n] == [4, 11]


def test_loss_swing_alert_content():
    rule = LossSwingRule()
    alerts = [
        a
        for i, v in enumerate([1.0, 1.2, 1.44, 1.8])
        for a in rule.judge(StepContext(i, 20 * (i + 1)), Measures(loss_window=LossWindow(v, 20, 0.01**2)))
    ]
    (a,) = alerts
    assert (a.rule, a.severity, a.epoch, a.global_step, a.source) == (
        "loss_swing",
        "warning",
        3,
        80,
        "train_loss",
    )
    assert a.threshold == 0.1 and a.value == pytest.approx(0.25)


def validation(v, se, df, lr=None, scale=None, source="val_loss"):
    """The measures of one validation run for loss_swing's validation view."""
    return Measures(validation=Validation(v, noise_se=se, df=df, lr=lr, baseline=scale, metric=source))


def feed_validation(rule, values, se=0.01, lr=None):
    """Feed validation losses, each with standard error ``se`` (from 127 degrees of freedom)."""
    rates = lr or [None] * len(values)
    return [
        len(rule.judge(StepContext(i, 20 * (i + 1)), validation(v, se, 127.0, lr=r)))
        for i, (v, r) in enumerate(zip(values, rates, strict=True))
    ]


@pytest.mark.parametrize(
    ("name", "values", "fires_at"),
    [
        # the batch-size-1 oscillation as measured (seed 1): rise, fall, rise after a first fall
        ("up and down", [8.5, 6.5, 13.0, 7.6, 13.8, 5.9], [4]),
        ("rise, rise, fall", [4.2, 10.8, 21.1, 12.9], [3]),
        # a validation loss that only climbs is val_decline's (overfitting), not an oscillation
        ("climb", [1.0, 1.2, 1.45, 1.8, 2.2, 2.7], []),
        ("steady fall", [1.0, 0.8, 0.64, 0.51, 0.41], []),
        ("small wobble", [1.0, 1.05, 1.0, 1.05, 1.0, 1.05], []),
        ("near zero jitter", [0.0010, 0.0005, 0.0012, 0.0006, 0.0013], []),
    ],
)
def test_loss_swing_validation_view_table(name, values, fires_at):
    fired = feed_validation(LossSwingRule(), values, se=0.0001)
    assert [i for i, n in enumerate(fired) if n] == fires_at, name


def test_loss_swing_validation_view_judges_the_change_against_the_standard_errors():
    values = [1.0, 1.3, 1.0, 1.3, 1.0]
    assert feed_validation(LossSwingRule(), values, se=0.05) == [0, 0, 0, 1, 0]  # 0.3 is 4.2 standard errors
    assert feed_validation(LossSwingRule(), values, se=0.12) == [0] * 5  # 1.8: the validation set's noise
    assert feed_validation(LossSwingRule(), values, se=None) == [0] * 5  # unknown noise: never significant
    # the rate moving with the loss by at most lr_ratio is the schedule (a cyclic rate), not a swing
    cyclic = [1e-3, 3e-3, 1e-3, 3e-3, 1e-3]
    assert feed_validation(LossSwingRule(), values, se=0.05, lr=cyclic) == [0] * 5


def test_loss_swing_validation_view_rises_above_the_untrained_loss():
    # the calibration's one-step epochs of batch 8 (healthy): significant jumps, all below the initial loss of 1.38
    jumps = [0.16, 0.12, 0.82, 0.12, 1.03, 0.22]
    rule = LossSwingRule()
    fired = [len(rule.judge(StepContext(i, 4 * i), validation(v, 0.04, 30.0, scale=1.38)))
             for i, v in enumerate(jumps)]
    assert fired == [0] * 6 and rule.peaks["loss_swing"] == pytest.approx(0.75, abs=0.01)  # 1.03 of 1.38
    # the same jumps past a model's initial loss of 0.5: worse than untrained at every other run, an oscillation
    rule = LossSwingRule()
    fired = [len(rule.judge(StepContext(i, 4 * i), validation(v, 0.04, 30.0, scale=0.5)))
             for i, v in enumerate(jumps)]
    assert fired == [0, 0, 0, 0, 1, 0]


def test_loss_swing_validation_view_alert_and_margin():
    rule = LossSwingRule()
    alerts = [
        a
        for i, v in enumerate([4.2, 10.8, 21.1, 12.9])
        for a in rule.judge(StepContext(i, 64 * (i + 1)), validation(v, 1.5, 63.0, source="val_loss"))
    ]
    (a,) = alerts
    assert (a.rule, a.source, a.global_step, a.threshold) == ("loss_swing", "val_loss", 256, 0.1)
    assert a.value == pytest.approx(12.9 / 21.1 - 1) and "up and down" in a.message
    assert rule.peaks["loss_swing"] > 1.0
    quiet = LossSwingRule()
    feed_validation(quiet, [1.0, 1.05, 1.0, 1.05, 1.0], se=0.01)
    assert quiet.peaks["loss_swing"] == pytest.approx(0.476, abs=0.01)  # 4.8% against 10%: half-way
    climb = LossSwingRule()
    feed_validation(climb, [1.0, 1.2, 1.45, 1.8, 2.2], se=0.01)
    assert climb.peaks["loss_swing"] == 0.0  # no fall: however steep, never an oscillation


@pytest.mark.parametrize(
    ("mode", "values", "fires_at"),
    [
        ("min", [1.0, 1.1, 1.2, 1.3, 1.4, 1.5], [5]),
        ("min", [1.0, 1.1, 1.2, 1.3, 1.2, 1.4, 1.5], []),
        ("min", [1.0, 0.9, 0.8, 0.7, 0.6, 0.5], []),
        ("max", [0.9, 0.8, 0.7, 0.6, 0.5, 0.4], [5]),
        ("max", [0.5, 0.6, 0.7, 0.8, 0.9, 0.95], []),
    ],
)
def test_val_decline_table(mode, values, fires_at):
    fired = feed(ValDeclineRule(mode=mode), values)
    assert [i for i, n in enumerate(fired) if n] == fires_at


def test_val_fluctuation():
    rule = ValFluctuationRule()
    train = [1.0 * 0.8**k for k in range(6)]
    val = [1.0, 1.4, 0.9, 1.5, 0.9, 1.4]
    fired = [
        len(_validate(rule, i, t, v)) for i, (t, v) in enumerate(zip(train, val, strict=False))
    ]
    assert fired == [0, 0, 0, 0, 0, 1]  # the first 5 runs are judged once the training period after them is known
    quiet = ValFluctuationRule()
    smooth_val = [1.2 * 0.85**k for k in range(6)]
    pairs = enumerate(zip(train, smooth_val, strict=True))
    assert all(not quiet.judge(StepContext(i, 20 * (i + 1)), _val(t, v)) for i, (t, v) in pairs)


@pytest.mark.parametrize(
    ("train", "val", "fires_at"),
    [
        # the converged corpus BERT at lr 2e-3: 50% in log units near zero, but it rises by 7% of its initial loss
        ([1.29, 0.52, 0.19, 0.10, 0.079, 0.041], [0.964, 0.237, 0.097, 0.167, 0.024, 0.025], []),
        # a validation loss zig-zagging by 40% of its level while the training loss falls smoothly
        ([1.0 * 0.8**k for k in range(7)], [1.0, 1.4, 0.9, 1.5, 0.9, 1.4, 0.9], [5]),
        # the same zig-zag after a fall from 4.0 (rises 1.6 = 40% of the start): it fires once the fall has left
        # the window's trend
        ([4.0 * 0.7**k for k in range(8)], [4.0, 1.4, 0.9, 1.5, 0.9, 1.4, 0.9, 1.5], [6]),
        # converged near zero, wandering by 0.05 from a start at 2.3: quiet
        ([2.3 * 0.5**k for k in range(7)], [2.3, 0.4, 0.08, 0.03, 0.08, 0.03, 0.08], []),
        # one large bump between falls (rises once, by 40% of the start): not a fluctuation
        ([1.0 * 0.8**k for k in range(6)], [1.0, 0.5, 0.9, 0.4, 0.3, 0.25], []),
        # the same window with a second rise of the same size: fluctuating
        ([1.0 * 0.8**k for k in range(6)], [1.0, 0.5, 0.9, 0.4, 0.8, 0.3], [5]),
    ],
    ids=["converged-finetune", "zigzag", "zigzag-after-a-fall", "converged-wander", "one-bump", "two-bumps"],
)  # a window is judged at the run after it (its training period after the last validation is then known)
def test_val_fluctuation_is_judged_against_the_initial_scale(train, val, fires_at):
    rule = ValFluctuationRule()
    fired = [
        len(_validate(rule, i, t, v)) for i, (t, v) in enumerate(zip(train, val, strict=True))
    ]
    assert [i for i, n in enumerate(fired) if n] == fires_at


def test_val_fluctuation_quiet_near_zero():
    rule = ValFluctuationRule()
    train = [0.001] * 6
    val = [0.002, 0.004, 0.002, 0.004, 0.002, 0.004]
    assert all(
        not _validate(rule, i, t, v) for i, (t, v) in enumerate(zip(train, val, strict=False))
    )


@pytest.mark.parametrize("factory", [LossSwingRule, ValDeclineRule, ValFluctuationRule])
def test_state_roundtrip_and_missing_keys(factory):
    rule = factory()
    for i, v in enumerate([1.0, 1.3, 1.0, 1.3]):
        if isinstance(rule, ValFluctuationRule):
            rule.judge(StepContext(i, 20 * (i + 1)), _val(v, v))
        elif isinstance(rule, ValDeclineRule):
            rule.judge(StepContext(i, 20 * (i + 1)), Measures(validation=Validation(v)))
        else:
            rule.judge(StepContext(i, 20 * (i + 1)), Measures(loss_window=LossWindow(v)))
        if isinstance(rule, LossSwingRule):
            rule.judge(StepContext(i, 20 * (i + 1)), Measures(validation=Validation(v, noise_se=0.01)))
    clone = factory()
    clone.load_state_dict(rule.state_dict())
    assert clone.state_dict() == rule.state_dict()
    state = rule.state_dict()
    del state["latch"]
    with pytest.raises(KeyError, match="latch"):
        factory().load_state_dict(state)


def test_latch():
    latch = Latch()
    assert latch.update("a", True) and not latch.update("a", True)
    assert latch.is_active("a")
    latch.update("a", False)
    assert latch.update("a", True)
