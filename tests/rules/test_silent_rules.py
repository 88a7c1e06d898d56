"""The silent-error rules and their measures, table-driven (no Lightning)."""

import pytest
import torch
from torch import nn

from lightning_diag.instrument.positions import position_capacity
from lightning_diag.rules.base import StepContext
from lightning_diag.rules.data_sequences import SequenceRules
from lightning_diag.rules.grad_not_zeroed import GradNotZeroedRule
from lightning_diag.rules.measures import Measures, StaleGrads
from lightning_diag.rules.records import LayerUpdate, SequenceMeasurement
from lightning_diag.rules.replicas import DesyncRule, compare_replicas
from lightning_diag.rules.train_mode import EvalModeRule
from lightning_diag.rules.updates_applied import UpdateRule
from lightning_diag.stats.replicas import replica_differences
from lightning_diag.stats.updates import ElementSample, parameter_checksums, sample_positions, unchanged_counts


def _ctx(step=0):
    return StepContext(0, step)


def _stale(layers):
    """The measures of one check whose gradients of `layers` were not zeroed."""
    return Measures(stale_grads=StaleGrads(layers))


@pytest.mark.parametrize(
    "update, rule",
    [
        (LayerUpdate(32, 32), "update_none"),
        (LayerUpdate(32, 32, cause="no_optimizer"), "update_none"),
        (LayerUpdate(32, 32, low_precision=True, cause="lr_zero"), "update_none"),
        (LayerUpdate(32, 32, low_precision=True), "update_stale"),
        (LayerUpdate(32, 31, low_precision=True), "update_stale"),  # 97%: nearly every update lost
        (LayerUpdate(32, 20, low_precision=True), None),  # 62% with no loss to confirm: a converging bf16 run
        (LayerUpdate(32, 10, low_precision=True), None),
        (LayerUpdate(32, 31), None),  # one element moved: fp32 updates are applied
        (LayerUpdate(0, 0), None),  # nothing with a gradient: nothing to judge
    ],
)
def test_update_rule_table(update, rule):
    r = UpdateRule(patience=2)
    fired = [a.rule for step in range(3) for a in r.judge(_ctx(step), Measures(layer_updates={"fc": update}))]
    assert fired == ([rule] if rule else [])


def test_update_rule_latches_clears_and_survives_its_state():
    r = UpdateRule(patience=1)
    stuck, moving = {"a": LayerUpdate(4, 4), "b": LayerUpdate(4, 4)}, {"a": LayerUpdate(4, 0), "b": LayerUpdate(4, 0)}
    (alert,) = r.judge(_ctx(0), Measures(layer_updates=stuck))
    assert "2 layers: `a`, `b`" in alert.message and alert.source == "a"
    assert r.judge(_ctx(1), Measures(layer_updates=stuck)) == []
    restored = UpdateRule(patience=1)
    restored.load_state_dict(r.state_dict())
    assert restored.judge(_ctx(2), Measures(layer_updates=stuck)) == []  # still latched after a resume
    assert restored.judge(_ctx(3), Measures(layer_updates=moving)) == []
    assert len(restored.judge(_ctx(4), Measures(layer_updates=stuck))) == 1


@pytest.mark.parametrize(
    ("losses", "fired", "margin"),
    [
        ([0.69] * 6, ["update_stale"], 20 / 32 / 0.5),  # the loss flat: the updates that round away matter
        ([1.0, 0.8, 0.6, 0.5, 0.4, 0.3], [], 20 / 32 / 0.95),  # the loss falls: converging, judged on `certain`
    ],
)
def test_update_stale_below_certain_needs_a_flat_loss(losses, fired, margin):
    r = UpdateRule(patience=2)
    half = {"fc": LayerUpdate(32, 20, low_precision=True)}
    feed = [Measures(layer_updates=half, loss=loss) for loss in losses]
    alerts = [a for step, m in enumerate(feed) for a in r.judge(_ctx(step), m)]
    assert [a.rule for a in alerts] == fired
    assert all("while the loss is not falling (0.69, initial 0.69)" in a.message for a in alerts)
    assert r.peaks["update_stale"] == pytest.approx(margin)
    restored = UpdateRule(patience=2)
    restored.load_state_dict(r.state_dict())
    assert restored.losses.state_dict() == r.losses.state_dict()


def test_grad_not_zeroed_rule_alerts_once_and_rearms():
    r = GradNotZeroedRule()
    assert len(r.judge(_ctx(1), _stale(["fc"]))) == 1
    assert r.judge(_ctx(2), _stale(["fc"])) == [] and r.judge(_ctx(3), _stale([])) == []
    assert len(r.judge(_ctx(4), _stale(["fc"]))) == 1


def test_desync_rule_names_the_first_parameter_and_the_ranks():
    same = [1.0, 2.0, 3.0, 5.0, 6.0, 7.0]  # norms of a, b, c, then sums
    bad = [1.0, 2.0, 3.1, 5.0, 6.0, 7.0]
    r = DesyncRule(tolerance=1e-6)
    def checksums(*ranks):
        return Measures(replica_differences=compare_replicas(ranks, ["a", "b", "c"], tolerance=r.tolerance))

    assert r.judge(_ctx(100), checksums(same, same, same)) == [] and r.last_max_diff == 0.0
    (alert,) = r.judge(_ctx(200), checksums(same, same, bad))
    assert alert.source == "c" and "rank(s) 2" in alert.message and alert.severity == "critical"
    assert r.judge(_ctx(300), checksums(same, same, bad)) == []
    assert replica_differences([[0.0], [float("nan")]]) == [[0.0], [float("inf")]]


def test_eval_mode_rule_warns_for_trained_modules_and_informs_once_for_frozen_batchnorm():
    r = EvalModeRule()
    alerts = r.judge(_ctx(0), Measures(eval_mode={"bn": "batchnorm_frozen", "drop": "dropout"}))
    assert [(a.severity, a.source) for a in alerts] == [("warning", "drop"), ("info", "bn")]
    assert r.judge(_ctx(5), Measures(eval_mode={"bn": "batchnorm_frozen"})) == []


def test_sequence_rules_table():
    r = SequenceRules()
    healthy = SequenceMeasurement(label_positions=100, padded_labels=0, extent={"train": 20, "val": 20}, capacity=32)
    assert r.judge(_ctx(), Measures(sequences=healthy)) == []
    over = SequenceMeasurement(extent={"train": 20, "val": 20}, capacity=16, capacity_source="`wpe`")
    (alert,) = r.judge(_ctx(1), Measures(sequences=over))
    assert alert.source == "capacity" and "`wpe`" in alert.message
    longer = SequenceMeasurement(extent={"train": 30})
    assert [a.source for a in r.judge(_ctx(2), Measures(sequences=longer))] == ["train"]
    assert r.train_extent == 30
    no_training_length = Measures(sequences=SequenceMeasurement(extent={"val": 40}))
    assert SequenceRules().judge(_ctx(), no_training_length) == []


def test_sampling_and_counting_on_tensors():
    assert sample_positions(1000, 32).unique().numel() == 32
    w, g = torch.randn(5, 7), torch.randn(5, 7)
    sample = ElementSample([w, torch.ones(3)], size=4)
    before = sample.gather([w, torch.ones(3)])
    w2 = w.clone()
    w2.view(-1)[0] += 1.0  # the first sampled element moves
    counts = unchanged_counts(before, sample.gather([w2, torch.ones(3)]), sample.gather([g, None]), sample.segment, 2)
    assert counts.tolist() == [[4.0, 0.0], [3.0, 0.0]]
    sums = parameter_checksums([torch.tensor([3.0, -4.0]), torch.tensor([1, 2])])
    assert sums.dtype == torch.float64 and sums.tolist() == [[5.0, 2.23606797749979], [-1.0, 3.0]]


def test_position_capacity_finds_the_tightest_limit():
    net = nn.Module()
    net.config = type("Config", (), {"max_position_embeddings": 512})()
    net.pos_embed = nn.Parameter(torch.zeros(1, 64, 8))
    net.rotary = nn.Module()
    net.rotary.register_buffer("cos_cached", torch.zeros(128, 4))
    assert position_capacity(net) == (64, "`pos_embed` (learned positions)")


def test_grad_not_zeroed_an_undecided_check_counts_and_leaves_the_alarm_as_it_is():
    undecided = Measures(stale_grads=StaleGrads((), decided=False))
    r = GradNotZeroedRule()
    assert len(r.judge(_ctx(1), _stale(["fc"]))) == 1
    assert r.judge(_ctx(2), undecided) == [] and r.checks == 2
    assert r.judge(_ctx(3), _stale(["fc"])) == []  # still in alarm: the undecided check did not clear it
    assert r.judge(_ctx(4), _stale([])) == [] and r.judge(_ctx(5), undecided) == []
    assert len(r.judge(_ctx(6), _stale(["fc"]))) == 1  # cleared by the clean check at step 4
    fresh = GradNotZeroedRule()
    assert fresh.judge(_ctx(1), undecided) == [] and fresh.checks == 1
    assert len(fresh.judge(_ctx(2), _stale(["fc"]))) == 1
