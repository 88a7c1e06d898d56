"""The silent-error rules and their measures, table-driven (no Lightning)."""

import pytest
import torch
from torch import nn

from lightning_diag.instrument.positions import position_capacity
from lightning_diag.rules.base import StepContext
from lightning_diag.rules.data_sequences import SequenceMeasurement, SequenceRules
from lightning_diag.rules.replicas import DesyncRule, replica_differences
from lightning_diag.rules.train_mode import EvalModeRule
from lightning_diag.rules.updates import GradNotZeroedRule, LayerUpdate, UpdateRule
from lightning_diag.stats.updates import ElementSample, parameter_checksums, sample_positions, unchanged_counts


def _ctx(step=0):
    return StepContext(0, step)


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
    fired = [a.rule for step in range(3) for a in r.update({"fc": update}, _ctx(step))]
    assert fired == ([rule] if rule else [])


def test_update_rule_latches_clears_and_survives_its_state():
    r = UpdateRule(patience=1)
    stuck, moving = {"a": LayerUpdate(4, 4), "b": LayerUpdate(4, 4)}, {"a": LayerUpdate(4, 0), "b": LayerUpdate(4, 0)}
    (alert,) = r.update(stuck, _ctx(0))
    assert "2 layers: `a`, `b`" in alert.message and alert.source == "a"
    assert r.update(stuck, _ctx(1)) == []
    restored = UpdateRule(patience=1)
    restored.load_state_dict(r.state_dict())
    assert restored.update(stuck, _ctx(2)) == []  # still latched after a resume
    assert restored.update(moving, _ctx(3)) == [] and len(restored.update(stuck, _ctx(4))) == 1


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
    alerts = [a for step, loss in enumerate(losses) for a in r.update(half, _ctx(step), loss)]
    assert [a.rule for a in alerts] == fired
    assert all("while the loss is not falling (0.69, initial 0.69)" in a.message for a in alerts)
    assert r.peaks["update_stale"] == pytest.approx(margin)
    restored = UpdateRule(patience=2)
    restored.load_state_dict(r.state_dict())
    assert restored.losses.state_dict() == r.losses.state_dict()


def test_grad_not_zeroed_rule_alerts_once_and_rearms():
    r = GradNotZeroedRule()
    assert len(r.update(["fc"], _ctx(1))) == 1
    assert r.update(["fc"], _ctx(2)) == [] and r.update([], _ctx(3)) == [] and len(r.update(["fc"], _ctx(4))) == 1


def test_desync_rule_names_the_first_parameter_and_the_ranks():
    same = [1.0, 2.0, 3.0, 5.0, 6.0, 7.0]  # norms of a, b, c, then sums
    bad = [1.0, 2.0, 3.1, 5.0, 6.0, 7.0]
    r = DesyncRule(tolerance=1e-6)
    assert r.update([same, same, same], ["a", "b", "c"], _ctx(100)) == [] and r.last_max_diff == 0.0
    (alert,) = r.update([same, same, bad], ["a", "b", "c"], _ctx(200))
    assert alert.source == "c" and "rank(s) 2" in alert.message and alert.severity == "critical"
    assert r.update([same, same, bad], ["a", "b", "c"], _ctx(300)) == []
    assert replica_differences([[0.0], [float("nan")]]) == [[0.0], [float("inf")]]


def test_eval_mode_rule_warns_for_trained_modules_and_informs_once_for_frozen_batchnorm():
    r = EvalModeRule()
    alerts = r.update({"bn": "batchnorm_frozen", "drop": "dropout"}, _ctx(0))
    assert [(a.severity, a.source) for a in alerts] == [("warning", "drop"), ("info", "bn")]
    assert r.update({"bn": "batchnorm_frozen"}, _ctx(5)) == []


def test_sequence_rules_table():
    r = SequenceRules()
    healthy = SequenceMeasurement(label_positions=100, padded_labels=0, extent={"train": 20, "val": 20}, capacity=32)
    assert r.update(healthy, _ctx()) == []
    over = SequenceMeasurement(extent={"train": 20, "val": 20}, capacity=16, capacity_source="`wpe`")
    (alert,) = r.update(over, _ctx(1))
    assert alert.source == "capacity" and "`wpe`" in alert.message
    longer = SequenceMeasurement(extent={"train": 30})
    assert [a.source for a in r.update(longer, _ctx(2))] == ["train"]
    assert r.train_extent == 30
    assert SequenceRules().update(SequenceMeasurement(extent={"val": 40}), _ctx()) == []  # no training length


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
