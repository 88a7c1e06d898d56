"""Trainer.fit scenarios of the published training problems (issue 45, items 1-4): each fault is caught at the first
eligible measurements by the rule that names its class, its healthy twin and the healthy look-alikes stay quiet,
and the rules' state survives a resume."""

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_diag import GradientFlowMonitor
from lightning_diag.demo import run_demo
from lightning_diag.demo.faults import build_fault
from lightning_diag.demo.models import DemoConfig
from lightning_diag.demo.problem_models import BinaryDataModule, PlainMLP, make_binary_dataset
from lightning_diag.demo.schedules import run_scenario

FAST = dict(
    accelerator="cpu",
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
    logger=False,
    num_sanity_val_steps=0,
    log_every_n_steps=5,
)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _warnings(alerts):
    return [a for a in alerts if a.severity != "info"]


def _first(alerts, rule):
    return next((a for a in alerts if a.rule == rule), None)


# -- each fault, by the rule that names its class ---------------------------------------------------------------------
def test_plain_sigmoid_stack_is_vanishing_at_the_third_measurement(tmp_path):
    result = run_demo("vanish_plain", root=str(tmp_path))
    vanish = _first(result.alerts, "grad_vanish")
    assert vanish is not None, [a.format() for a in result.alerts]
    assert vanish.global_step <= 15  # measurements at steps 4, 9, 14: patience 3
    assert vanish.source == "net.0" and "along the stack `net.*`" in vanish.message
    assert _first(result.alerts, "dead_units") is None and _first(result.alerts, "activation_saturation") is None


def test_dead_relu_units_are_dead_units_not_vanishing(tmp_path):
    result = run_demo("dead_relu", root=str(tmp_path))
    dead = [a for a in result.alerts if a.rule == "dead_units"]
    assert len(dead) == 1 and dead[0].global_step <= 15, [a.format() for a in result.alerts]
    assert "33 layers" in dead[0].message and "gradient entries are exactly zero" in dead[0].message
    assert _first(result.alerts, "grad_vanish") is None


def test_unscaled_inputs_saturate_the_first_tanh_and_are_named(tmp_path):
    result = run_demo("saturated_tanh", root=str(tmp_path))
    saturated = [a for a in result.alerts if a.rule == "activation_saturation"]
    assert len(saturated) == 1 and saturated[0].global_step <= 15, [a.format() for a in result.alerts]
    assert saturated[0].source == "net.0" and "unscaled inputs" in saturated[0].message
    assert saturated[0].value > 0.9  # the published condition: over 90% of the inputs beyond ±5


def test_a_learning_rate_far_too_small_is_update_too_small(tmp_path):
    result = run_demo("tiny_lr", root=str(tmp_path))
    small = _first(result.alerts, "update_too_small")
    assert small is not None and small.global_step <= 30, [a.format() for a in result.alerts]
    assert small.value < 1e-5 and "learning rate is far too small" in small.message


@pytest.mark.parametrize(
    "name", ["healthy_plain_deep", "healthy_deep_relu", "healthy_sparse_relu", "healthy_tanh", "healthy_lr"]
)
def test_healthy_twins_raise_no_warning(tmp_path, name):
    result = run_demo(name, root=str(tmp_path))
    assert [a.format() for a in _warnings(result.alerts)] == []


# -- healthy look-alikes -----------------------------------------------------------------------------------------------
class _Scheduled(PlainMLP):
    """The 2-layer ReLU MLP under a schedule: ``cosine`` decays to 0 over the fit, ``warmup`` rises linearly from 0."""

    def __init__(self, schedule, steps, lr=3e-3):
        super().__init__(DemoConfig(model="plain_mlp", head_depth=2, d_model=32, lr=lr))
        self.schedule, self.steps = schedule, steps

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.config.lr)
        if self.schedule == "cosine":
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, self.steps, eta_min=0.0)
        else:
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, step / self.steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@pytest.mark.parametrize("schedule", ["cosine", "warmup"])
def test_a_decayed_or_warming_learning_rate_is_not_too_small(tmp_path, schedule):
    # cosine: the last measurements' updates are orders of magnitude below 1e-3 at the end of the schedule;
    # warmup: the first ones are, while the learning rate rises from 0
    steps = 160
    monitor = GradientFlowMonitor()
    pl.Trainer(default_root_dir=tmp_path, max_steps=steps, callbacks=[monitor], **FAST).fit(
        _Scheduled(schedule, steps), datamodule=BinaryDataModule()
    )
    assert [a.format() for a in _warnings(monitor.alerts)] == []
    assert monitor.update_size_rule.moved


class _Backbone(pl.LightningModule):
    """A frozen ReLU backbone (one of its layers is dead: every unit inactive) under a trainable head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        with torch.no_grad():
            self.backbone[2].bias[:48] = -100.0  # 75% of the frozen layer's units are dead
        self.backbone.requires_grad_(False)
        self.head = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.head.parameters(), lr=1e-3)


def test_a_frozen_part_is_not_judged(tmp_path):
    monitor = GradientFlowMonitor(expect_frozen=["backbone.*"])
    pl.Trainer(default_root_dir=tmp_path, max_steps=40, callbacks=[monitor], **FAST).fit(
        _Backbone(), DataLoader(make_binary_dataset(512, 0), batch_size=32, shuffle=True)
    )
    assert [a.format() for a in _warnings(monitor.alerts)] == []
    assert "backbone.2" not in monitor.activation_rule.first_seen and monitor.activation_rule.first_seen


@pytest.mark.slow
def test_a_head_on_a_frozen_encoder_is_judged_on_nearly_every_unit_dead(tmp_path):
    # progressive unfreezing (the calibration's schedule): the randomly initialised encoder stays frozen for two
    # epochs, so the head's inputs barely vary across a batch: about half of its first layer's units are inactive
    # for all 32 samples from the first measurement, while the mostly frozen model's loss falls slowly
    monitor = GradientFlowMonitor()
    run_scenario("unfreezing", [monitor], root=str(tmp_path), seed=0, max_steps=40, limit_val_batches=0)
    assert [a for a in monitor.alerts if a.rule == "dead_units"] == []
    assert monitor.activation_rule.first_seen["dead_units:net.head.0"][0] > 0.3  # measured, not skipped
    # the same frozen backbone with a head whose units are all dead: reported
    dead = _Backbone()
    with torch.no_grad():
        dead.head[0].bias.fill_(-100.0)
    monitor = GradientFlowMonitor(expect_frozen=["backbone.*"])
    pl.Trainer(default_root_dir=tmp_path, max_steps=20, callbacks=[monitor], **FAST).fit(
        dead, DataLoader(make_binary_dataset(512, 0), batch_size=32, shuffle=True)
    )
    assert [(a.rule, a.source) for a in monitor.alerts if a.rule == "dead_units"] == [("dead_units", "head.0")]


def test_batch_size_one_counts_no_dead_units_and_says_so(tmp_path, caplog):
    model, _, _ = build_fault("healthy_sparse_relu")
    monitor = GradientFlowMonitor()
    loader = DataLoader(make_binary_dataset(64, 0), batch_size=1)
    with caplog.at_level("INFO", logger="lightning_diag"):
        pl.Trainer(default_root_dir=tmp_path, max_steps=30, callbacks=[monitor], **FAST).fit(model, loader)
    assert [a for a in monitor.alerts if a.rule == "dead_units"] == []
    assert not any(k.startswith("dead_units") for k in monitor.activation_rule.first_seen)
    assert "fewer than 16 rows per unit" in caplog.text


# -- cost and side effects ---------------------------------------------------------------------------------------------
class _HookSpy(PlainMLP):
    """Records, per training step, whether any module had a forward pre-hook during the forward."""

    def __init__(self):
        super().__init__(DemoConfig(model="plain_mlp", head_depth=2, d_model=32))
        self.hooked = {}

    def training_step(self, batch, batch_idx):
        self.hooked[self.global_step] = any(m._forward_pre_hooks for m in self.modules())
        return super().training_step(batch, batch_idx)


def test_hooks_are_attached_for_measured_forwards_only_and_the_weights_are_unchanged(tmp_path):
    spy = _HookSpy()
    pl.seed_everything(0)
    pl.Trainer(default_root_dir=tmp_path, max_steps=12, callbacks=[GradientFlowMonitor()], **FAST).fit(
        spy, datamodule=BinaryDataModule()
    )
    assert [s for s, hooked in spy.hooked.items() if hooked] == [4, 9]  # the logging steps (every 5th)
    assert not any(m._forward_pre_hooks for m in spy.modules())
    plain = _HookSpy()
    pl.seed_everything(0)
    pl.Trainer(default_root_dir=tmp_path, max_steps=12, **FAST).fit(plain, datamodule=BinaryDataModule())
    assert all(torch.equal(a, b) for a, b in zip(spy.state_dict().values(), plain.state_dict().values(), strict=True))


def test_switched_off_activation_rules_attach_no_hook(tmp_path):
    spy = _HookSpy()
    monitor = GradientFlowMonitor(rules={"dead_units": False, "activation_saturation": False})
    pl.Trainer(default_root_dir=tmp_path, max_steps=6, callbacks=[monitor], **FAST).fit(
        spy, datamodule=BinaryDataModule()
    )
    assert not any(spy.hooked.values())


# -- resume -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fault", "rule", "stop"), [("tiny_lr", "update_too_small", 10), ("dead_relu", "dead_units", 10)]
)
def test_a_resumed_fit_alerts_at_the_same_step_as_an_uninterrupted_one(tmp_path, fault, rule, stop):
    def fit(max_steps, monitor, ckpt=None):
        model, data, _ = build_fault(fault)
        pl.seed_everything(0)
        trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=max_steps, callbacks=[monitor], **FAST)
        trainer.fit(model, datamodule=data, ckpt_path=ckpt)
        return trainer

    whole = GradientFlowMonitor()
    fit(40, whole)
    expected = [a.global_step for a in whole.alerts if a.rule == rule]
    assert expected and expected[0] > stop

    first = GradientFlowMonitor()
    fit(stop, first).save_checkpoint(tmp_path / "mid.ckpt")
    assert [a for a in first.alerts if a.rule == rule] == []
    second = GradientFlowMonitor()
    fit(40, second, ckpt=tmp_path / "mid.ckpt")
    assert [a.global_step for a in second.alerts if a.rule == rule] == expected


class _Skips(_HookSpy):
    """Skips the backward of its first measured batch, the last of the epoch (``training_step`` returns None);
    validation follows."""

    skipped = 0
    val_hooked = None

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.hooked[self.global_step] and not self.skipped:
            self.skipped += 1
            return None
        return loss

    def validation_step(self, batch, batch_idx):
        self.val_hooked = bool(self.val_hooked) or any(m._forward_pre_hooks for m in self.modules())
        return super().validation_step(batch, batch_idx)


def test_a_measured_batch_without_a_backward_leaves_no_hook_behind(tmp_path):
    model = _Skips()
    trainer = pl.Trainer(
        default_root_dir=tmp_path, max_epochs=1, limit_train_batches=5, callbacks=[GradientFlowMonitor()], **FAST
    )
    trainer.fit(model, datamodule=BinaryDataModule())
    assert model.skipped == 1 and model.val_hooked is False
    assert not any(m._forward_pre_hooks for m in model.modules())
