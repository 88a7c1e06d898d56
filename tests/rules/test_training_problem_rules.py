"""Unit tests of the rules for the published training problems (issue 45, items 1-4): ``dead_units``,
``activation_saturation``, ``update_too_small`` and ``grad_vanish``'s depth test, and the activation watch."""

import pytest
import torch
from torch import nn

from lightning_diag.instrument.activation_watch import MIN_ROWS, ActivationWatch
from lightning_diag.rules.activations import ActivationRule
from lightning_diag.rules.base import StepContext
from lightning_diag.rules.grad_norm_band import GradBandRule, rank_correlation
from lightning_diag.rules.measures import Measures
from lightning_diag.rules.records import ActivationReading
from lightning_diag.rules.update_size import UpdateSizeRule
from lightning_diag.stats.layer_roles import role_of


def _ctx(step):
    return StepContext(0, step)


def _band(relative, roles=None):
    """The measures of a gradient measurement with relative gradients only, every matrix in the blocks."""
    return Measures(grad_rms={}, grad_relative=relative, blocks=set(relative), layer_roles=roles)


def _act(rule, readings, step, **measures):
    """The activation rule judging `readings` at `step` (with the other `measures`)."""
    return rule.judge(_ctx(step), Measures(activations=readings, **measures))


# -- dead_units ---------------------------------------------------------------------------------------------------
def test_dead_units_is_one_alert_naming_every_dead_layer_and_how_the_share_moved():
    rule = ActivationRule(patience=2)
    alerts = []
    for step, share in ((5, 0.12), (10, 0.75), (15, 0.81), (20, 0.81)):
        readings = [ActivationReading(f"net.{2 * i}", "ReLU", dead=share, zero_grad=share) for i in range(5)]
        readings.append(ActivationReading("net.10", "ReLU", dead=0.3, zero_grad=0.3))
        alerts += _act(rule, readings, step, loss=0.693)
    # most units dead from step 10, the loss flat: judged once two windows of 2 losses are known (step 20)
    assert [(a.rule, a.global_step) for a in alerts] == [("dead_units", 20)]
    message = alerts[0].message
    assert "5 layers" in message and "net.10" not in message
    assert "from 12% at step 5 to 81% at step 20" in message
    assert "81% of their weights' gradient entries are exactly zero" in message
    assert "not a vanishing gradient" in message and "the loss is not falling" in message
    assert rule.dead_layers() == {f"net.{2 * i}" for i in range(5)}
    # latched: the same event does not alert again
    assert _act(rule, [ActivationReading("net.0", "ReLU", dead=0.9)], 25, loss=0.693) == []


def test_most_units_idle_while_the_loss_falls_is_not_dead_units():
    # a healthy net fed correlated rows (windows of one series) leaves 60-75% of a layer's units idle for a batch
    rule = ActivationRule(patience=2)
    losses = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5]
    reading = [ActivationReading("fc", "ReLU", dead=0.75)]
    assert [a for i, loss in enumerate(losses) for a in _act(rule, reading, i, loss=loss)] == []


def test_nearly_every_unit_dead_needs_no_loss():
    rule = ActivationRule(patience=2)
    alerts = [a for i in range(2) for a in _act(rule, [ActivationReading("fc", "ReLU", dead=1.0)], i)]
    assert [(a.rule, a.global_step) for a in alerts] == [("dead_units", 1)]


def test_a_sparse_healthy_relu_layer_is_quiet_and_its_margin_is_noted():
    rule = ActivationRule(patience=1)
    for step in range(10):
        assert _act(rule, [ActivationReading("fc", "ReLU", dead=0.35)], step, loss=0.69) == []
    assert rule.peaks["dead_units"] == pytest.approx(0.35 / 0.5)


def test_a_layer_fed_by_a_frozen_part_needs_nearly_every_unit_dead():
    # a head on a frozen encoder (progressive unfreezing): its inputs barely vary across the batch, so about half of
    # its units are inactive for every sample while the slowly learning model's loss looks flat
    rule = ActivationRule(patience=2)
    head = [ActivationReading("head.0", "ReLU", dead=0.59, after_frozen=True)]
    assert [a for i in range(8) for a in _act(rule, head, i, loss=1.3)] == []
    assert rule.peaks["dead_units"] == pytest.approx(0.59 / 0.95)  # against `certain`: the loss does not count
    dead = [ActivationReading("head.0", "ReLU", dead=1.0, after_frozen=True)]
    assert [a.rule for i in range(8, 10) for a in _act(rule, dead, i, loss=1.3)] == ["dead_units"]
    # the same share in a layer that nothing frozen feeds, with the loss flat: dead units
    trained = ActivationRule(patience=2)
    fc = [ActivationReading("fc", "ReLU", dead=0.59)]
    assert [a.rule for i in range(4) for a in _act(trained, fc, i, loss=1.3)] == ["dead_units"]
    assert trained.peaks["dead_units"] == pytest.approx(0.59 / 0.5)


def test_dead_units_margin_is_the_smallest_share_of_the_patience_window():
    rule = ActivationRule(patience=3)
    for i, share in enumerate((0.9, 0.2, 0.9, 0.9)):  # over the threshold three times, never three in a row
        assert _act(rule, [ActivationReading("fc", "ReLU", dead=share)], i, loss=0.69) == []
    assert rule.peaks["dead_units"] == pytest.approx(0.2 / 0.5)


def test_a_layer_that_recovers_is_not_dead():
    rule = ActivationRule(patience=3)
    shares = (1.0, 1.0, 0.2, 1.0, 1.0, 0.2)
    readings = [[ActivationReading("fc", "ReLU", dead=s)] for s in shares]
    assert [a for i, r in enumerate(readings) for a in _act(rule, r, i)] == []


# -- activation_saturation --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("first", "rms", "cause"),
    [
        (True, 101.0, "unscaled inputs"),
        (True, 1.0, "first layer's weights are too large"),
        (False, 1.0, "weights too large"),
    ],
)
def test_saturation_names_the_likely_cause(first, rms, cause):
    rule = ActivationRule(patience=2)
    reading = [ActivationReading("net.0", "Tanh", saturated=0.91, limit=5.0, first=first)]
    alerts = [a for step in (5, 10) for a in _act(rule, reading, step, input_rms=rms)]
    assert [a.rule for a in alerts] == ["activation_saturation"]
    assert cause in alerts[0].message and "Tanh beyond ±5" in alerts[0].message and "`net.0`" in alerts[0].message


def test_half_saturated_is_below_the_threshold():
    rule = ActivationRule(patience=1)
    assert _act(rule, [ActivationReading("net.0", "Tanh", saturated=0.4, limit=5.0)], 0) == []


def test_activation_rule_state_round_trips():
    rule = ActivationRule(patience=2)
    _act(rule, [ActivationReading("fc", "ReLU", dead=1.0)], 5)
    restored = ActivationRule(patience=2)
    restored.load_state_dict(rule.state_dict())
    assert [a.rule for a in _act(restored, [ActivationReading("fc", "ReLU", dead=1.0)], 10)] == ["dead_units"]
    with pytest.raises(KeyError, match="first_seen"):
        ActivationRule().load_state_dict({"streaks": {}, "latch": {}})


# -- update_too_small --------------------------------------------------------------------------------------------------
def _feed(rule, ratios, losses):
    measures = [Measures(update_ratios=r, loss=loss) for r, loss in zip(ratios, losses, strict=True)]
    return [a for i, m in enumerate(measures) for a in rule.judge(_ctx(i), m)]


def test_tiny_updates_with_a_flat_loss_alert_once_the_loss_trend_is_known():
    rule = UpdateSizeRule(patience=3)
    alerts = _feed(rule, [{"a": 1e-7, "b": 3e-7, "c": 2e-7}] * 8, [0.69, 0.691, 0.689, 0.69, 0.69, 0.688, 0.69, 0.69])
    # the third measurement: the first eligible one (the ratios' streak of 3 and the loss's trend over 3 points)
    assert [(a.rule, a.global_step) for a in alerts] == [("update_too_small", 2)]
    assert "while the loss is not falling (its trend over 3 measurements: 0.689, from 0.69)" in alerts[0].message
    assert "2e-07" in alerts[0].message and "learning rate is far too small" in alerts[0].message


def test_tiny_updates_with_a_falling_loss_are_quiet():
    rule = UpdateSizeRule(patience=3)
    assert _feed(rule, [{"a": 1e-7}] * 8, [1.0, 0.95, 0.9, 0.8, 0.7, 0.6, 0.55, 0.5]) == []


def test_updates_that_decayed_after_healthy_ones_are_quiet():
    # the end of a cosine schedule, or a converged model: the ratio was healthy once
    rule = UpdateSizeRule(patience=3)
    ratios = [{"a": 1e-3}] * 3 + [{"a": 1e-8}] * 6
    assert _feed(rule, ratios, [0.69] * 9) == []


def test_a_warm_up_from_zero_is_not_judged_while_it_grows():
    rule = UpdateSizeRule(patience=3)
    ratios = [{"a": 1e-7 * 2**i} for i in range(8)]
    assert _feed(rule, ratios, [0.69] * 8) == []


def test_layers_kept_still_are_left_out_of_the_median():
    # a backbone at learning rate 0 (ratio exactly 0) and a head that moves: the median is the head's
    rule = UpdateSizeRule(patience=1)
    ratios = [{"backbone.0": 0.0, "backbone.1": 0.0, "head": 1e-3}] * 4
    assert _feed(rule, ratios, [0.69] * 4) == []
    # the head's 1e-3 is the median: the model moved, so the rule can no longer fire and its margin is 0
    assert rule.peaks["update_too_small"] == 0.0
    still = UpdateSizeRule(patience=1)
    alerts = _feed(still, [{"backbone.0": 0.0, "head": 1e-7}] * 3, [0.69] * 3)
    assert [a.value for a in alerts] == [pytest.approx(1e-7)]


def test_update_too_small_margin_is_the_gated_statistic():
    # tiny updates while the loss falls: quiet, and the margin says so (below 1) although the ratio is 100x below
    falling = UpdateSizeRule(patience=2)
    assert _feed(falling, [{"a": 1e-7}] * 6, [1.0, 0.9, 0.7, 0.6, 0.5, 0.4]) == []
    assert falling.peaks["update_too_small"] == 0.0
    # the same updates with a flat loss fire: the margin is the threshold over the streak's largest median
    flat = UpdateSizeRule(patience=2)
    assert len(_feed(flat, [{"a": 2e-7}, {"a": 1e-7}, {"a": 2e-7}, {"a": 1e-7}], [0.69] * 4)) == 1
    assert flat.peaks["update_too_small"] == pytest.approx(1e-5 / 2e-7)


def test_without_a_loss_nothing_is_judged():
    rule = UpdateSizeRule(patience=1)
    assert _feed(rule, [{"a": 1e-9}] * 4, [None] * 4) == []


# -- grad_vanish's depth test ------------------------------------------------------------------------------------------
def _stack(first, factor, n=9):
    return {f"net.{2 * i}": first * factor**i for i in range(n)}


def test_a_plain_stack_whose_gradient_decays_with_depth_vanishes_whatever_adam_does():
    rel = _stack(1e-7, 7.0)  # 1e-7 .. 0.58 from the first layer to the last
    roles = {k: role_of(k) for k in rel}
    rule = GradBandRule(patience=2, warmup_steps=50)
    rule.judge(_ctx(0), Measures(update_ratios=dict.fromkeys(rel, 2e-3)))  # Adam: every layer moves alike
    alerts = [a for step in (4, 9) for a in rule.judge(_ctx(step), _band(rel, roles))]
    assert [a.rule for a in alerts] == ["grad_vanish"]
    assert alerts[0].source == "net.0" and "along the stack `net.*`" in alerts[0].message
    # the same values without the roles: the update test clears them (the old verdict)
    old = GradBandRule(patience=2, warmup_steps=50)
    old.judge(_ctx(0), Measures(update_ratios=dict.fromkeys(rel, 2e-3)))
    assert [a for step in (4, 9) for a in old.judge(_ctx(step), _band(rel))] == []


def test_a_small_matrix_without_a_decay_is_not_a_stack_that_vanishes():
    # one matrix 1e6 below its peers, the others flat: architecture, not depth (the update test decides)
    rel = {**dict.fromkeys([f"h.{i}.fc" for i in range(1, 6)], 1e-1), "h.0.fc": 1e-7}
    roles = {k: role_of(k) for k in rel}
    rule = GradBandRule(patience=1, warmup_steps=0)
    rule.judge(_ctx(0), Measures(update_ratios=dict.fromkeys(rel, 2e-3)))
    assert rule.depth_decay(rel, roles) == {}  # rank correlation 0.65: the first block alone is no decay
    flat = {**dict.fromkeys([f"h.{i}.fc" for i in range(0, 5)], 1e-1), "h.5.fc": 1e-7}
    assert rule.depth_decay(flat, {k: role_of(k) for k in flat}) == {}  # the weakest is the last block
    short = {f"h.{i}.fc": 10.0 ** (-7 + 3 * i) for i in range(3)}
    assert rule.depth_decay(short, {k: role_of(k) for k in short}) == {}  # three blocks are not a deep stack
    gentle = _stack(1e-3, 2.0)  # 256x over 9 blocks: healthy spread
    assert rule.depth_decay(gentle, {k: role_of(k) for k in gentle}) == {}


def test_grad_vanish_defers_to_dead_units():
    rel = _stack(1e-7, 7.0)
    roles = {k: role_of(k) for k in rel}
    rule = GradBandRule(patience=1, warmup_steps=0)
    rule.observe_dead(["net.4"])
    assert rule.judge(_ctx(60), _band(rel, roles)) == []
    rule.observe_dead([])
    assert [a.rule for a in rule.judge(_ctx(65), _band(rel, roles))] == ["grad_vanish"]


def test_rank_correlation():
    assert rank_correlation([1.0, 2.0, 3.0]) == 1.0
    assert rank_correlation([3.0, 1.0, 2.0]) == pytest.approx(-0.5)
    assert rank_correlation([1.0]) == 0.0
    assert rank_correlation([2.0, 2.0, 2.0]) == 0.0


# -- the activation watch ---------------------------------------------------------------------------------------
def _forward(net, x, watch):
    watch.attach(net)
    out = net(x)
    watch.detach()
    out.sum().backward()
    return watch.readings(dict(net.named_modules()))


def test_watch_counts_units_dead_for_every_sample_not_zeros_of_one_sample():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 1))
    with torch.no_grad():
        net[0].bias[:6] = -100.0  # 6 of 8 units dead for any input
    readings, rms = _forward(net, torch.randn(32, 4), ActivationWatch())
    (reading,) = readings
    assert reading.layer == "0" and reading.dead == pytest.approx(6 / 8) and not reading.after_frozen
    assert reading.zero_grad == pytest.approx(6 / 8)  # their rows of the weight gradient are exactly 0
    assert rms == pytest.approx(1.0, rel=0.3)


def test_watch_does_not_count_dead_units_on_a_single_sample():
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    watch = ActivationWatch()
    readings, _ = _forward(net, torch.randn(MIN_ROWS - 1, 4), watch)
    assert readings == [] and watch.too_few_rows


def test_watch_counts_channels_after_a_convolution():
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 1))
    with torch.no_grad():
        net[0].bias[:1] = -100.0
    readings, _ = _forward(net, torch.randn(2, 1, 6, 6), ActivationWatch())
    assert readings[0].dead == pytest.approx(1 / 4)


def test_watch_measures_saturation_only_where_something_trainable_follows():
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1), nn.Sigmoid())
    readings, rms = _forward(net, 100.0 * torch.randn(32, 4), ActivationWatch())
    assert [(r.layer, r.activation, r.first) for r in readings] == [("0", "Tanh", True)]
    assert readings[0].saturated > 0.5 and readings[0].limit == 5.0 and rms > 50


def test_watch_skips_activations_after_a_frozen_layer_and_leaves_no_hook():
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    net[0].requires_grad_(False)
    watch = ActivationWatch()
    readings, _ = _forward(net, torch.randn(32, 4), watch)
    assert [(r.layer, r.after_frozen) for r in readings] == [("2", True)]  # layer 2 reads the frozen part
    assert not watch.attached and not watch.pending
    assert all(not m._forward_pre_hooks for m in net.modules())


def test_a_reused_activation_module_is_read_after_each_layer():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.out, self.act = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 1), nn.ReLU()

        def forward(self, x):
            return self.out(self.act(self.fc2(self.act(self.fc1(x)))))

    readings, _ = _forward(Net(), torch.randn(32, 4), ActivationWatch())
    assert [r.layer for r in readings] == ["fc1", "fc2"]


def test_watch_counts_channels_after_a_norm_over_channels():
    net = nn.Sequential(nn.Conv1d(2, 4, 3), nn.BatchNorm1d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6, 1))
    with torch.no_grad():
        net[1].bias[:3] = -100.0  # 3 of 4 channels dead after the norm
    readings, _ = _forward(net, torch.randn(8, 2, 8), ActivationWatch())
    assert [(r.layer, r.dead) for r in readings] == [("1", pytest.approx(3 / 4))]
