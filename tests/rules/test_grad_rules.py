import pytest

from lightning_diag.rules.base import StepContext, name_layers
from lightning_diag.rules.grad_collapse import GradCollapseRule
from lightning_diag.rules.grad_frozen import GradFrozenRule
from lightning_diag.rules.grad_layer_spread import GradSpreadRule
from lightning_diag.rules.grad_norm_band import GradBandRule, sgd_step_scale
from lightning_diag.rules.measures import Measures, WeightNorms


def run(rule, field, series, step0=0, **kw):
    """Judge each of `series` as the measure `field` (with the measures `kw`); the alerts of each step."""
    out = []
    for i, x in enumerate(series):
        out.append([(a.rule, a.source) for a in rule.judge(StepContext(0, step0 + i), Measures(**{field: x}, **kw))])
    return out


def fired(out):
    return [(i, x) for i, x in enumerate(out) if x]


# -- grad_explode: RMS gradient per element, every layer, one measurement ---------------------------------------
@pytest.mark.parametrize(
    ("series", "expected"),
    [
        ([{"a": 0.1, "b": 1.0}] * 6, []),
        ([{"a": 20.0}] * 4, [(0, [("grad_explode", "a")])]),  # reported at once, latched
        ([{"a": 1.1, "patch_embed": 0.64}] * 4, []),  # the largest healthy values measured in the corpus
        ([{"a": float("nan")}] * 4, []),  # non-finite: AnomalyAlarm's business
        ([{"a": 20.0}, {"a": 1.0}, {"a": 20.0}], [(0, [("grad_explode", "a")])]),  # a flicker: one event
        # clear on 2 x patience - 1 measurements: a new event
        (
            [{"a": 20.0}] + [{"a": 1.0}] * 5 + [{"a": 20.0}],
            [(0, [("grad_explode", "a")]), (6, [("grad_explode", "a")])],
        ),
        # 10x further past the threshold while it persists: alerts again, once
        (
            [{"a": 20.0}, {"a": 150.0}, {"a": 200.0}, {"a": 300.0}],
            [(0, [("grad_explode", "a")]), (2, [("grad_explode", "a")])],
        ),
    ],
)
def test_explode_table(series, expected):
    assert fired(run(GradBandRule(), "grad_rms", series)) == expected


def test_many_layers_exploding_together_are_one_alert_naming_them():
    rule = GradBandRule()
    layers = {f"h.{i}.fc": 11.0 + i for i in range(12)}
    alerts = rule.judge(StepContext(0, 0), Measures(grad_rms=layers))
    assert [(a.rule, a.source) for a in alerts] == [("grad_explode", "h.11.fc")]  # the worst
    assert "12 layers" in alerts[0].message and "and 9 more" in alerts[0].message
    assert rule.judge(StepContext(0, 1), Measures(grad_rms=layers)) == []  # latched
    layers["h.0.fc"] = 1.0
    layers["h.0.fc"] = 30.0  # a layer that was never cleared does not re-alert
    assert rule.judge(StepContext(0, 2), Measures(grad_rms=layers)) == []


# -- grad_vanish: ||g||/||W|| of comparable matrices, starved against the best-fed block, after the warm-up -----
HEALTHY_REL = {"h.0.fc": 0.02, "h.1.fc": 0.03, "h.0.out": 0.05, "h.1.out": 0.04}


@pytest.mark.parametrize(
    ("relative", "step0", "expected_at"),
    [
        (HEALTHY_REL, 100, None),
        ({**HEALTHY_REL, "h.0.fc": 1e-5}, 100, 2),  # one matrix starved while the others learn: patience 3
        ({**HEALTHY_REL, "h.0.fc": 1e-5}, 0, None),  # during the warm-up (init transients): silent
        ({**HEALTHY_REL, "h.0.fc": 1e-5}, 48, 4),  # judged from step 50 on: 3 measurements from there
        ({k: v * 1e-3 for k, v in HEALTHY_REL.items()}, 100, None),  # all small together: converged or dead
        ({**HEALTHY_REL, "h.0.fc": 6e-4}, 100, None),  # below 1e-3 but only 83x below the best: not starved
    ],
)
def test_vanish_table(relative, step0, expected_at):
    rule = GradBandRule()
    out = run(rule, "grad_rms", [{k: 0.01 for k in relative}] * 6, step0=step0, grad_relative=relative)
    expected = [] if expected_at is None else [(expected_at, [("grad_vanish", "h.0.fc")])]
    assert fired(out) == expected


def vanish_series(series):
    rule = GradBandRule(warmup_steps=0)
    return fired(
        [[(a.rule, a.source) for a in rule.judge(StepContext(0, i), Measures(grad_rms={}, grad_relative=rel))]
         for i, rel in enumerate(series)]
    )


def test_matrix_never_reached_is_not_vanishing_but_one_that_lost_its_gradient_is():
    # exactly 0 at every measurement since the first: the loss does not depend on it (grad_frozen's information)
    assert vanish_series([{"blk.0.fc": 0.05, "blk.1.fc": 0.04, "unused.fc": 0.0}] * 6) == []
    first = {"blk.0.fc": 0.05, "blk.1.fc": 0.04, "cut.fc": 0.02}
    lost = [first] + [{**first, "cut.fc": 0.0}] * 5  # a gradient at the first measurement, then exactly 0
    assert vanish_series(lost) == [(3, [("grad_vanish", "cut.fc")])]


def test_vanishing_layers_at_one_step_make_one_alert():
    # a deep stack where most matrices starve: the reference is the best-fed block, not the (vanished) median
    relative = {f"enc.{i}.fc": 1e-6 * (i + 1) for i in range(8)} | {f"head.{i}": 0.05 for i in range(3)}
    rule = GradBandRule(patience=1, warmup_steps=0)
    alerts = rule.judge(StepContext(0, 0), Measures(grad_rms={}, grad_relative=relative))
    assert len(alerts) == 1 and alerts[0].source == "enc.0.fc" and "8 layers" in alerts[0].message


def test_a_starved_layer_realerts_only_when_its_gap_to_the_best_fed_block_grows():
    # a batch with small gradients everywhere (all 16x lower) is the same event; the layer falling 20x further
    # behind the best-fed block has clearly worsened
    rule = GradBandRule(patience=1, warmup_steps=0)
    base = {**HEALTHY_REL, "h.0.fc": 1e-6}
    assert [a.source for a in rule.judge(StepContext(0, 0), Measures(grad_rms={}, grad_relative=base))] == ["h.0.fc"]
    quiet = {k: v / 16 for k, v in base.items()}
    assert rule.judge(StepContext(0, 1), Measures(grad_rms={}, grad_relative=quiet)) == []
    assert rule.judge(StepContext(0, 2), Measures(grad_rms={}, grad_relative=base)) == []
    worse = {**HEALTHY_REL, "h.0.fc": 5e-8}
    assert [a.source for a in rule.judge(StepContext(0, 3), Measures(grad_rms={}, grad_relative=worse))] == ["h.0.fc"]


def test_dead_blocks_are_not_vanishing_against_a_head_outside_the_blocks():
    # BERT at a 100x learning rate: every block matrix ~0, only the classifier (no block) learns: grad_collapse's
    relative = {"enc.0.fc": 0.0, "enc.1.fc": 1e-12, "classifier": 0.5}
    rule = GradBandRule(patience=1, warmup_steps=0)
    m = Measures(grad_rms={}, grad_relative=relative, blocks={"enc.0.fc", "enc.1.fc"})
    assert rule.judge(StepContext(0, 0), m) == []


# -- grad_layer_spread: one role across blocks -------------------------------------------------------------------
ROLES = {"h.0.fc": "h.*.fc", "h.1.fc": "h.*.fc", "norm": "norm", "head": "head"}


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"h.0.fc": 0.01, "h.1.fc": 0.5, "norm": 1e-6, "head": 10.0}, []),  # different roles never compared
        ({"h.0.fc": 1e-4, "h.1.fc": 0.5, "norm": 1.0, "head": 1.0}, [(2, [("grad_layer_spread", "h.*.fc")])]),
        ({"h.0.fc": 0.0, "h.1.fc": 0.5, "norm": 1.0, "head": 1.0}, []),  # a zero gradient is not a spread
    ],
)
def test_spread_table(values, expected):
    assert fired(run(GradSpreadRule(), "grad_relative", [values] * 5, step0=100, layer_roles=ROLES)) == expected


def test_spread_needs_the_slow_side_update_to_be_starved_too():
    # N-BEATS under Adam with L2 weight decay: blocks the loss no longer needs get 1e-6 of their peers' gradient,
    # and move faster than them (the decay shrinks them): not a difference in learning speed
    values = {"h.0.fc": 1e-6, "h.1.fc": 0.5}
    rule = GradSpreadRule()
    rule.judge(StepContext(0, 99), Measures(update_ratios={"h.0.fc": 0.37, "h.1.fc": 0.12}))
    assert fired(run(rule, "grad_relative", [values] * 5, step0=100, layer_roles=ROLES)) == []
    rule = GradSpreadRule()
    # starved update: the slow block does not learn
    rule.judge(StepContext(0, 99), Measures(update_ratios={"h.0.fc": 1e-5, "h.1.fc": 0.12}))
    out = run(rule, "grad_relative", [values] * 5, step0=100, layer_roles=ROLES)
    assert fired(out) == [(2, [("grad_layer_spread", "h.*.fc")])]


def test_spread_waits_for_the_warm_up():
    values = {"h.0.fc": 1e-4, "h.1.fc": 0.5}
    assert fired(run(GradSpreadRule(), "grad_relative", [values] * 10, step0=0, layer_roles=ROLES)) == []
    assert fired(run(GradSpreadRule(warmup_steps=0), "grad_relative", [values] * 4, layer_roles=None))[0][0] == 2


# -- grad_collapse: the loss tells converged from dead from vanished ---------------------------------------------
def collapse(norms, losses, **kw):
    rule = GradCollapseRule(**kw)
    out = []
    for i, (n, loss) in enumerate(zip(norms, losses, strict=True)):
        alerts = rule.judge(StepContext(0, i), Measures(grad_norm=n, loss=loss))
        out += [(i, a.severity.value, a.message) for a in alerts]
    return out


@pytest.mark.parametrize(
    ("late_loss", "severity", "word"),
    [
        (0.01, "info", "converged"),  # loss at 0.7% of the initial: converged, nothing wrong
        (1.5, "warning", "dead network"),  # loss stuck at (or above) the initial: dead
        (0.6, "warning", "vanished"),  # loss half-way: gradients vanished far from the floor
        (None, "warning", "vanished"),  # loss unknown: the plain collapse
    ],
)
def test_collapse_verdict_table(late_loss, severity, word):
    norms = [1.0] * 8 + [1e-4] * 5
    losses = [1.4] * 8 + [late_loss] * 5
    out = collapse(norms, losses)
    assert [(i, s) for i, s, _ in out] == [(10, severity)]
    assert word in out[0][2]


@pytest.mark.parametrize(("late_loss", "margin"), [(0.01, 0.01), (1.5, 1e4 / 100)])
def test_collapse_margin_is_the_warnings(late_loss, margin):
    # a converged model's collapse is an info: its margin stays that of the healthy norms before it (limit 0.01 / 1);
    # a dead one's is the limit over the streak's norm
    rule = GradCollapseRule()
    for i, (n, loss) in enumerate(zip([1.0] * 8 + [1e-4] * 5, [1.4] * 8 + [late_loss] * 5, strict=True)):
        rule.judge(StepContext(0, i), Measures(grad_norm=n, loss=loss))
    assert rule.peaks["grad_collapse"] == pytest.approx(margin)


def collapse_with_updates(updates, late_loss, norms=None):
    """The blocks' gradient falls 1e4x at measurement 8 while the loss falls to ``late_loss``; ``updates[i]`` is the
    model's relative update observed after measurement ``i`` (every layer alike)."""
    rule = GradCollapseRule()
    norms = norms or [1.0] * 8 + [1e-4] * 8
    out = []
    for i, n in enumerate(norms):
        loss = 1.4 if i < 8 else late_loss
        alerts = rule.judge(StepContext(0, i), Measures(grad_norm=n, loss=loss))
        out += [(i, a.severity.value, a.message) for a in alerts]
        rule.judge(StepContext(0, i), Measures(update_ratios={"a": updates[i], "b": updates[i], "c": float("nan")}))
    return out


@pytest.mark.parametrize(
    ("late_update", "late_loss", "expected"),
    [
        (0.02, 0.6, []),  # the loss fell, the parameters still move at 20% of their early rate: not a collapse
        (1e-4, 0.6, [(10, "warning")]),  # the loss fell, but the updates stopped too: vanished
        (0.02, 1.5, [(10, "warning")]),  # the loss is stuck: dead, whatever the updates
        (0.02, 0.01, [(10, "info")]),  # converged
    ],
)
def test_collapse_vanished_needs_the_updates_to_stop_too(late_update, late_loss, expected):
    updates = [0.1] * 8 + [late_update] * 8
    out = collapse_with_updates(updates, late_loss)
    assert [(i, s) for i, s, _ in out] == expected
    if expected == [(10, "warning")] and late_loss == 0.6:
        assert "0.001 of their early level" in out[0][2]


def test_collapse_waits_while_the_model_learns_then_fires_when_its_updates_stop():
    updates = [0.1] * 8 + [0.02] * 4 + [1e-4] * 4  # the updates stop at measurement 12
    assert [(i, s) for i, s, _ in collapse_with_updates(updates, 0.6)] == [(13, "warning")]


def test_collapse_slow_convergence_is_quiet():
    slow = [1.0 * 0.97**k for k in range(120)]  # falls 38x over a long run: not a collapse
    assert collapse(slow, [1.0] * 120) == []


# -- grad_frozen ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("reason", "severity"),
    [("frozen", "info"), ("excluded", "warning")],
)
def test_frozen_on_purpose_is_info_and_excluded_is_a_warning(reason, severity):
    names = ["emb.weight", "enc.0.w", "head.w"]
    alerts = GradFrozenRule().judge(StepContext(0, 0), Measures(stuck_params={"emb.weight": reason}, param_names=names))
    assert [(a.source, a.severity.value) for a in alerts] == [("emb", severity)]


@pytest.mark.parametrize(
    ("reason", "reached_first", "severity", "source"),
    [
        ("no_grad", False, "info", "unused"),  # not in the graph
        ("zero_grad", False, "info", "unused"),  # in the graph, exactly zero since the first measurement: unreached
        ("zero_grad", True, "warning", "a"),  # had a gradient, then exactly zero: something cut it
    ],
)
def test_never_reached_is_an_info_and_a_gradient_that_became_zero_a_warning(reason, reached_first, severity, source):
    names = ["a.w", "b.w"]
    rule = GradFrozenRule(patience=2)
    if reached_first:
        # a.w had a gradient at the first measurement
        assert rule.judge(StepContext(0, 0), Measures(stuck_params={}, param_names=names)) == []
    stuck = Measures(stuck_params={"a.w": reason}, param_names=names)
    out = [rule.judge(StepContext(0, i), stuck) for i in range(1, 4)]
    assert [len(x) for x in out] == [0, 1, 0] and (out[1][0].severity, out[1][0].source) == (severity, source)


def test_a_never_reached_parameter_that_gets_a_gradient_is_judged_again():
    names = ["a.w", "b.w"]
    rule = GradFrozenRule(patience=2)
    rule.judge(StepContext(0, 0), Measures(stuck_params={"a.w": "zero_grad"}, param_names=names))
    rule.judge(StepContext(0, 1), Measures(stuck_params={}, param_names=names))  # reached once: never "unreached" again
    stuck = Measures(stuck_params={"a.w": "zero_grad"}, param_names=names)
    out = [rule.judge(StepContext(0, i), stuck) for i in range(2, 4)]
    assert [(a.severity, a.source) for x in out for a in x] == [("warning", "a")]


def test_name_layers():
    assert name_layers({"a": 1.0}) == "`a` 1"
    assert name_layers({"a": 1.0, "b": 3.0}, worst_first=False) == "2 layers: `a` 1, `b` 3"


def test_grad_rules_state_roundtrip():
    for rule, feed in (
        (GradBandRule(), {"grad_rms": {"a": 20.0}}),
        (GradSpreadRule(warmup_steps=0), {"grad_relative": {"a": 1e-4, "b": 1.0}}),
        (GradCollapseRule(), {"grad_norm": 1.0, "loss": 2.0}),
    ):
        for i in range(6):
            rule.judge(StepContext(0, i), Measures(**feed))
        clone = type(rule)()
        clone.load_state_dict(rule.state_dict())
        assert clone.state_dict() == rule.state_dict()


# -- grad_explode between two measurements: the weights' move bounds the gradient under plain SGD ------------------
SGD_GROUP = {"lr": 0.1, "momentum": 0.9, "dampening": 0, "nesterov": False, "weight_decay": 0}


@pytest.mark.parametrize(
    ("groups", "scale"),
    [
        ([SGD_GROUP], (0.1, 0.9)),
        ([SGD_GROUP, {**SGD_GROUP, "lr": 0.2}], None),  # two learning rates: no one bound
        ([{**SGD_GROUP, "weight_decay": 1e-4}], None),  # decay moves the weights without a gradient
        ([{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0}], None),  # Adam rescales
    ],
)
def test_sgd_step_scale_table(groups, scale):
    assert sgd_step_scale(groups) == scale


def _weights(norms, sizes, sgd):
    """The measures of the weights' norms before a measured step (``sgd``: (lr, momentum) of plain SGD, or None)."""
    return Measures(weight_norms=WeightNorms(norms, sizes, sgd))


def test_weights_moved_beyond_what_small_gradients_explain_is_grad_explode():
    rule = GradBandRule()
    ctx = StepContext(0, 0)
    assert rule.judge(ctx, _weights({"fc": 10.0}, {"fc": 100}, (0.1, 0.9))) == []
    # 5 steps at lr 0.1 with momentum 0.9: a move of 600 needs a gradient of RMS >= 600 * 0.1 / (0.1 * 5 * 10) = 12
    (alert,) = rule.judge(StepContext(0, 5), _weights({"fc": 610.0}, {"fc": 100}, (0.1, 0.9)))
    assert alert.rule == "grad_explode" and alert.value == pytest.approx(12.0) and alert.global_step == 5
    # a move of 400 is explained by gradients of RMS 8: quiet, its margin noted
    calm = GradBandRule()
    calm.judge(ctx, _weights({"fc": 10.0}, {"fc": 100}, (0.1, 0.9)))
    assert calm.judge(StepContext(0, 5), _weights({"fc": 410.0}, {"fc": 100}, (0.1, 0.9))) == []
    assert calm.peaks["grad_explode"] == pytest.approx(0.8)
    # not plain SGD: nothing is inferred, whatever the move
    adam = GradBandRule()
    adam.judge(ctx, _weights({"fc": 10.0}, {"fc": 100}, None))
    assert adam.judge(StepContext(0, 5), _weights({"fc": 1e9}, {"fc": 100}, None)) == []


def test_the_last_weight_reading_survives_a_round_trip():
    rule = GradBandRule()
    rule.judge(StepContext(0, 0), _weights({"fc": 10.0}, {"fc": 100}, (0.1, 0.0)))
    restored = GradBandRule()
    restored.load_state_dict(rule.state_dict())
    assert [a.rule for a in restored.judge(StepContext(0, 5), _weights({"fc": 1e4}, {"fc": 100}, (0.1, 0.0)))] == [
        "grad_explode"
    ]


# -- the update ratios of a measured step, fed as a measurement (issue 43) ---------------------------------------
@pytest.mark.parametrize("rule_class", [GradBandRule, GradSpreadRule, GradCollapseRule])
def test_update_ratios_fed_as_a_measurement_are_noted_without_their_non_finite_entries(rule_class):
    ratios = [{"h.0.fc": 1e-5, "h.1.fc": 0.12, "x": float("nan")}, {"h.0.fc": 2e-5, "h.1.fc": 0.1}] * 3
    kw = {"baseline_measurements": 2} if rule_class is GradCollapseRule else {}
    fed, finite = rule_class(**kw), rule_class(**kw)
    for i, r in enumerate(ratios):
        assert fed.judge(StepContext(0, i), Measures(update_ratios=r, loss=2.0)) == []
        finite.judge(StepContext(0, i), Measures(update_ratios={k: v for k, v in r.items() if k != "x"}))
    assert fed.state_dict() == finite.state_dict()
    assert fed.state_dict() != rule_class().state_dict()  # the ratios changed the state


def test_collapse_leaves_the_loss_of_update_ratios_unread():
    rule = GradCollapseRule()
    rule.judge(StepContext(0, 1), Measures(update_ratios={"fc": 1e-3}, loss=0.01))
    assert rule.early_losses == [] and rule.initial_loss is None and rule.early == []
