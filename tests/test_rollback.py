"""Snapshots for rollback: bit-exact restores, no aliasing, the trust test; and the rollback policy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_diag.instrument.snapshots import SnapshotStore
from lightning_diag.rules.base import StepContext
from lightning_diag.rules.measures import Measures, Rollback
from lightning_diag.rules.rollback import RollbackRule


def _setup() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return net, opt, sched


def _train(net: nn.Module, opt: torch.optim.Optimizer, sched: object, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        net(torch.randn(4, 3)).pow(2).mean().backward()
        opt.step()
        sched.step()  # type: ignore[attr-defined]


def test_restore_is_bit_exact_and_leaves_the_snapshot_intact():
    net, opt, sched = _setup()
    _train(net, opt, sched, 3)
    store = SnapshotStore(keep=2)
    store.take(3, net, [opt], [sched], None, {"mine": 1})
    saved = {k: v.clone() for k, v in net.state_dict().items()}
    saved_moments = [s["exp_avg"].clone() for s in opt.state.values()]
    lr = opt.param_groups[0]["lr"]
    for _ in range(2):  # restore, train on, restore again: the snapshot was not aliased
        _train(net, opt, sched, 4)
        assert store.restore(3, net, [opt], [sched], None) == {"mine": 1}
        assert all(torch.equal(saved[k], v) for k, v in net.state_dict().items())
        assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(saved_moments, opt.state.values(), strict=True))
        assert opt.param_groups[0]["lr"] == lr and sched.last_epoch == 3
    assert opt.param_groups[0]["params"] == list(net.parameters())  # the optimizer still drives the model


def test_keep_and_drop_after():
    net, opt, sched = _setup()
    store = SnapshotStore(keep=2)
    for step in (0, 5, 10):
        store.take(step, net, [opt], [sched], None)
    assert store.steps() == [5, 10]
    store.drop_after(5)
    assert store.steps() == [5]
    with pytest.raises(KeyError, match="no snapshot of step 0"):
        store.get(0)
    assert store.nbytes > 0


def test_snapshots_taken_while_the_loss_spikes_are_not_trusted():
    net, opt, sched = _setup()
    store = SnapshotStore(keep=5, spike_factor=3.0)
    step = 0
    for losses in ([1.0, 1.1, 0.9, 1.0], [1.0, 0.9, 1.2, 1.0], [50.0, 80.0, 1e3, 2.0], [1.1, 0.9, 1.0, 1.0]):
        for value in losses:
            store.observe_loss(torch.tensor(value))
            step += 1
        store.take(step, net, [opt], [sched], None)
    assert store.trusted() == [True, True, False, True]


def test_rollback_policy_goes_further_back_and_gives_up():
    rule = RollbackRule(lr_factor=0.5, max_rollbacks=2, repeat_window=10)
    first = rule.choose([0, 10, 20], [True, True, False], now=25)
    assert (first.step, first.drop_after) == (10, 10) and "spiking" in first.reason
    assert rule.record(10, now=25) == 0.5
    again = rule.choose([0, 10], [True, True], now=30)  # within the window: not snapshot 10 again
    assert again.step == 0 and "again" in again.reason
    rule.record(0, now=30)
    assert rule.lr_scale == 0.25 and rule.exhausted
    assert rule.choose([0], [True], now=100).step is None
    (alert,) = rule.judge(StepContext(1, 30), Measures(rollback=Rollback(0, "NaN in the loss", "net.4", "")))
    assert alert.rule == "nonfinite_rollback" and alert.severity == "warning" and alert.source == "net.4"
    assert "step 0" in alert.message and "x0.25" in alert.message
    restored = RollbackRule(lr_factor=0.5, max_rollbacks=2, repeat_window=10)
    restored.load_state_dict(rule.state_dict())
    assert (restored.rollbacks, restored.lr_scale, restored.last_restored_step) == (2, 0.25, 0)


def test_no_trusted_snapshot_falls_back_to_the_oldest_and_none_left_stops():
    rule = RollbackRule(lr_factor=0.5, max_rollbacks=3, repeat_window=10)
    assert rule.choose([5, 10], [False, False], now=12).step == 5
    assert rule.choose([], [], now=12).step is None
