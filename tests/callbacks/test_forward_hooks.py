"""The driver's forward hooks (issue 43): on a hooked step each module gets at most one forward pre-hook and one
forward hook, whatever the number of watches reading its forward (``GradientFlowMonitor``'s activation watch, the
alarm's ``zero_output`` and ``output_collapse`` watches, whose sampled steps are the cadence steps); none on the other
steps; every watch reads the same values as with hooks of its own."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_diag import AnomalyAlarm, GradientFlowMonitor
from lightning_diag.instrument.activation_watch import ActivationWatch
from lightning_diag.instrument.forward_hooks import ForwardHooks, ModuleHook
from lightning_diag.instrument.output_watch import OutputSpreadWatch, ZeroOutputWatch
from tests.output.logger_models import FAST

RUN = {**FAST, "logger": False, "log_every_n_steps": 5, "limit_val_batches": 0}
STEPS = 20


class _Net(pl.LightningModule):
    """An MLP with ReLU and Tanh activations; records, at each training forward's start, the hooks on every module
    (those of this test's own spy excepted)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
        with torch.no_grad():
            self.net[0].bias[:8].fill_(-100.0)  # a quarter of the first layer's units dead
        #: global step -> (most pre-hooks on one module, most forward hooks on one module, modules hooked)
        self.hooks: dict[int, tuple[int, int, int]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        subs = list(self.net.modules())
        pre = [len(m._forward_pre_hooks) for m in subs]
        post = [len(m._forward_hooks) for m in subs]
        hooked = sum(1 for a, b in zip(pre, post, strict=True) if a or b)
        self.hooks[self.global_step] = (max(pre), max(post), hooked)
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def _fit(root: Any, callbacks: list[pl.Callback]) -> _Net:
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    model = _Net()
    trainer = pl.Trainer(default_root_dir=root, max_steps=STEPS, callbacks=callbacks, deterministic=True, **RUN)
    trainer.fit(model, DataLoader(TensorDataset(x, x[:, :1]), batch_size=32))
    return model


def test_one_hook_per_module_and_point_on_the_cadence_steps_none_elsewhere(tmp_path):
    gfm, alarm = GradientFlowMonitor(), AnomalyAlarm()
    model = _fit(tmp_path, [gfm, alarm])
    cadence = [s for s in range(STEPS) if (s + 1) % 5 == 0]  # 4, 9, 14, 19
    assert sorted(s for s, (_, _, hooked) in model.hooks.items() if hooked) == cadence
    for step in cadence:
        most_pre, most_post, hooked = model.hooks[step]
        assert (most_pre, most_post) == (1, 1)  # three watches, one hook per module and point
        assert hooked == 6  # the Sequential and its five modules: every one has the alarm's forward hook
    # every watch read its forward: the alarm's two checks on each sampled (cadence) step
    assert alarm.zero_rule.checks == alarm.collapse_rule.checks == len(cadence)
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == 0  # all removed


def test_each_watch_reads_what_it_reads_with_hooks_of_its_own(tmp_path):
    """The activation watch with the alarm's watches on the same forward, and alone; the alarm's alone: the same
    readings (dead units, saturation, zero-output and spread state) and the same trained weights."""
    both_gfm, both_alarm = GradientFlowMonitor(), AnomalyAlarm()
    both = _fit(tmp_path / "both", [both_gfm, both_alarm])
    gfm = GradientFlowMonitor()
    alone = _fit(tmp_path / "gfm", [gfm])
    alarm = AnomalyAlarm()
    _fit(tmp_path / "alarm", [alarm])
    assert both_gfm.activation_rule.state_dict() == gfm.activation_rule.state_dict()
    assert any(k.startswith("dead_units:net.0") for k in gfm.activation_rule.first_seen)  # the watch read it
    assert both_alarm.zero_rule.state_dict() == alarm.zero_rule.state_dict()
    assert both_alarm.collapse_rule.state_dict() == alarm.collapse_rule.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(both.state_dict().values(), alone.state_dict().values(), strict=True))


def test_watches_on_one_hook_set_read_what_their_own_hooks_read():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    x = torch.randn(32, 4)

    def run(shared: bool) -> tuple[Any, ...]:
        hooks = ForwardHooks() if shared else None
        act, zero, spread = ActivationWatch(), ZeroOutputWatch(net), OutputSpreadWatch(net)
        act.attach(net, hooks)
        zero.start(hooks)
        spread.start(hooks)
        if shared:
            assert hooks is not None and hooks.hooked(ModuleHook.INPUTS) == 3 + 2  # layers and activations
            assert max(len(m._forward_hooks) for m in net.modules()) == 1
        net(x).sum().backward()
        act.detach()
        zero.stop()
        spread.stop()
        assert all(not m._forward_pre_hooks and not m._forward_hooks for m in net.modules())
        net.zero_grad()
        readings = act.readings()
        taken = spread.take()
        assert taken is not None
        return readings, zero.counts(signs=True).tolist(), taken[:2], [t.item() for t in taken[2]]

    assert run(shared=True) == run(shared=False)


def test_a_watch_leaving_keeps_the_others_hook_and_order():
    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    hooks, seen = ForwardHooks(), []
    first, second = object(), object()
    hooks.ask(first, ModuleHook.OUTPUTS, net[0], lambda m, a, o: seen.append("first"))
    hooks.ask(second, ModuleHook.OUTPUTS, net[0], lambda m, a, o: seen.append("second"))
    hooks.ask(second, ModuleHook.INPUTS, net[1], lambda m, a: seen.append("second-in"))
    net(torch.ones(1, 2))
    assert seen == ["first", "second", "second-in"]
    hooks.leave(second)
    assert hooks.holds(first) and not hooks.holds(second)
    assert len(net[0]._forward_hooks) == 1 and not net[1]._forward_pre_hooks
    seen.clear()
    net(torch.ones(1, 2))
    assert seen == ["first"]
    hooks.clear()
    assert not hooks.active and not net[0]._forward_hooks
