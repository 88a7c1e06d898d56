import copy
import dataclasses
import json
import math

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_diag import AnomalyAlarm, NonFiniteError, read_alerts
from lightning_diag.demo import FAULTS, build_fault, run_demo

FAST = dict(enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", log_every_n_steps=5)


def serious(alerts):
    return [a for a in alerts if a.severity != "info"]


# -- configuration -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"on_nonfinite": "explode"}, ValueError, "on_nonfinite"),
        ({"on_nonfinite": 1}, TypeError, "on_nonfinite"),
        ({"swing_window": "step"}, ValueError, "swing_window"),
        ({"swing_window": 0}, ValueError, "swing_window"),
        ({"monitor": ""}, TypeError, "monitor"),
        ({"mode": "down"}, ValueError, "mode"),
        ({"log_every_n_steps": 0}, ValueError, "log_every_n_steps"),
    ],
)
def test_invalid_configuration(kwargs, error, names):
    with pytest.raises(error, match=f"`{names}`"):
        AnomalyAlarm(**kwargs)


@pytest.mark.parametrize(
    ("rule", "field", "value", "error"),
    [
        ("nonfinite_loss", "max_skips", -1, ValueError),
        ("nonfinite_loss", "max_skips", 1.5, TypeError),
        ("loss_swing", "threshold", 0, ValueError),
        ("loss_swing", "threshold", "10%", TypeError),
        ("loss_swing", "patience", 0, ValueError),
        ("loss_swing", "min_delta", -1.0, ValueError),
        ("val_decline", "threshold", 0, ValueError),
        ("val_decline", "min_delta", math.nan, ValueError),
        ("val_fluctuation", "threshold", -2, ValueError),
        ("val_fluctuation", "window", 2, ValueError),
        ("val_fluctuation", "min", -0.1, ValueError),
        ("val_fluctuation", "min_range", -1, ValueError),
        ("val_fluctuation", "min_rise", -1, ValueError),
        ("loss_stagnant", "threshold", 1.0, ValueError),
        ("loss_stagnant", "threshold", "10%", TypeError),
        ("loss_stagnant", "patience", 0, ValueError),
        ("loss_stagnant", "baseline_steps", 0, ValueError),
    ],
)
def test_invalid_rule_values_name_the_field_and_what_is_allowed(rule, field, value, error):
    with pytest.raises(error, match=rf"`rules\['{rule}'\]\['{field}'\]` to be (a number|an int)"):
        AnomalyAlarm(rules={rule: {field: value}})


def test_allowed_values_are_named():
    with pytest.raises(ValueError, match="'stop', 'raise', 'skip', 'warn'"):
        AnomalyAlarm(on_nonfinite="halt")


# -- scenarios -----------------------------------------------------------------------------------------------
def test_healthy_run_raises_nothing_and_logs_tags(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    alarm = AnomalyAlarm()
    result = run_demo("none", root=str(tmp_path), callbacks=[alarm])
    assert serious(alarm.alerts) == []
    assert result.epochs == FAULTS["none"].max_epochs
    acc = EventAccumulator(result.log_dir)
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for expected in (
        "diag/lr/AdamW/group_0",
        "diag/loss/train_epoch",
        "diag/loss/train_step",
        "diag/loss/val",
        "diag/loss/swing",
        "diag/loss/val_fluctuation",
        "val_loss",
    ):
        assert expected in tags, expected
    epochs = acc.Scalars("diag/loss/train_epoch")
    assert len(epochs) == FAULTS["none"].max_epochs
    assert epochs[-1].value < epochs[0].value
    lr = acc.Scalars("diag/lr/AdamW/group_0")
    assert lr and all(e.value == pytest.approx(3e-3) for e in lr)


class _Snapshot(pl.Callback):
    """Copies parameters and optimizer state at the end of every batch."""

    def __init__(self, at_step):
        self.at_step = at_step
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append(trainer.global_step)
        if trainer.global_step == self.at_step:  # the end of the last good batch
            self.params = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            self.opt_state = copy.deepcopy(trainer.optimizers[0].state_dict()["state"])


def _assert_unchanged(model, snap, optimizer):
    for k, v in model.state_dict().items():
        assert torch.equal(v, snap.params[k]), k
        assert torch.isfinite(v).all(), k
    state = optimizer.state_dict()["state"]
    for idx, entry in snap.opt_state.items():
        for name, value in entry.items():
            assert torch.equal(torch.as_tensor(state[idx][name]), torch.as_tensor(value)), (idx, name)


def test_nan_stop_blocks_the_update_and_returns(tmp_path):
    model, data, fault = build_fault("nan")
    alarm, snap = AnomalyAlarm(), _Snapshot(fault.onset_step)
    trainer = pl.Trainer(max_epochs=5, default_root_dir=tmp_path, callbacks=[alarm, snap], **FAST)
    trainer.fit(model, datamodule=data)  # returns normally
    assert snap.steps[-1] == fault.onset_step + 1  # the bad batch was the last one
    (alert,) = alarm.alerts
    assert (alert.rule, alert.severity, alert.global_step) == ("nonfinite_loss", "critical", fault.onset_step)
    for needle in (
        "epoch 1",
        f"global step {fault.onset_step}",
        "AdamW/group_0=0.003",
        "Last finite loss",
        "encoder.layers.0",
    ):
        assert needle in alert.message, needle
    _assert_unchanged(model, snap, trainer.optimizers[0])
    assert trainer.current_epoch < 5
    lines = (tmp_path / "lightning_logs" / "version_0" / "diag" / "alerts.jsonl").read_text().splitlines()
    assert [json.loads(x)["rule"] for x in lines] == ["nonfinite_loss"]


def test_nan_raise(tmp_path):
    model, data, fault = build_fault("nan")
    alarm, snap = AnomalyAlarm(on_nonfinite="raise"), _Snapshot(fault.onset_step)
    trainer = pl.Trainer(max_epochs=5, default_root_dir=tmp_path, callbacks=[alarm, snap], **FAST)
    with pytest.raises(NonFiniteError) as info:
        trainer.fit(model, datamodule=data)
    assert info.value.alert.rule == "nonfinite_loss"
    _assert_unchanged(model, snap, trainer.optimizers[0])
    assert len(read_alerts(tmp_path / "lightning_logs" / "version_0" / "diag" / "alerts.jsonl")) == 1


class _NanEveryOther(pl.LightningModule):
    """A linear model whose loss is NaN on odd global steps from step 4 on."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        if self.global_step >= 4 and self.global_step % 2 == 1:
            loss = loss * math.nan
        return loss

    def train_dataloader(self):
        x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_skip_goes_on_then_stops_at_the_limit(tmp_path):
    model = _NanEveryOther()
    alarm = AnomalyAlarm(on_nonfinite="skip", rules={"nonfinite_loss": {"max_skips": 3}})
    trainer = pl.Trainer(max_epochs=1, default_root_dir=tmp_path, callbacks=[alarm], **FAST)
    trainer.fit(model)
    # bad steps 5, 7, 9 are skipped (each its own episode: a good step clears the latch); the 4th (11)
    # exceeds max_skips and stops training
    assert [(a.rule, a.global_step, a.source) for a in alarm.alerts] == [
        ("nonfinite_loss", 5, "loss"),
        ("nonfinite_loss", 7, "loss"),
        ("nonfinite_loss", 9, "loss"),
        ("nonfinite_loss", 11, "loss"),
        ("nonfinite_loss", 11, "skip_limit"),
    ]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert trainer.global_step < 16


def test_warn_applies_the_update_and_alerts_once_per_episode(tmp_path):
    model, data, _ = build_fault("nan")
    alarm = AnomalyAlarm(on_nonfinite="warn")
    trainer = pl.Trainer(max_epochs=3, default_root_dir=tmp_path, callbacks=[alarm], **FAST)
    trainer.fit(model, datamodule=data)
    rules = [a.rule for a in serious(alarm.alerts)]
    assert rules and rules[0] == "nonfinite_loss"
    assert alarm.alerts[0].global_step == 30  # the first bad step, read back later without a per-step sync
    assert trainer.current_epoch == 3  # not stopped
    assert not all(torch.isfinite(p).all() for p in model.parameters())  # the NaN update went through


def test_warn_keeps_the_pending_steps_on_the_device_between_read_backs(tmp_path):
    model, data, _ = build_fault("nan")
    alarm = AnomalyAlarm(on_nonfinite="warn")
    kinds: list[tuple[int, bool]] = []

    class Inspect(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step > 0:  # after the first step (a fresh fit starts from numbers)
                pending = alarm.guard.deferred
                held = all(isinstance(pending[k], torch.Tensor) for k in ("loss_step", "grad_step"))
                kinds.append((trainer.global_step, held))

    trainer = pl.Trainer(max_epochs=2, default_root_dir=tmp_path, callbacks=[alarm, Inspect()], **FAST)
    trainer.fit(model, datamodule=data)
    assert len(kinds) > 2 * FAST["log_every_n_steps"]  # steps after several read-backs were inspected
    # a Python number there would be copied to the device (a host sync) by the next step that logs nothing
    assert [step for step, held in kinds if not held] == []
    assert alarm.alerts[0].rule == "nonfinite_loss" and alarm.alerts[0].global_step == 30  # unchanged findings


def test_swing_fault_fires_within_window(tmp_path):
    fault = FAULTS["swing"]
    alarm = AnomalyAlarm()
    run_demo("swing", root=str(tmp_path), callbacks=[alarm])
    swings = [a for a in alarm.alerts if a.rule == "loss_swing"]
    assert swings and swings[0].epoch <= fault.onset_epoch + fault.window
    assert not [a for a in alarm.alerts if a.rule.startswith("nonfinite")]


def test_overfit_fault_fires_val_decline(tmp_path):
    fault = FAULTS["overfit"]
    alarm = AnomalyAlarm()
    run_demo("overfit", root=str(tmp_path), callbacks=[alarm])
    declines = [a for a in alarm.alerts if a.rule == "val_decline"]
    assert declines and declines[0].epoch <= fault.onset_epoch + fault.window
    assert declines[0].source == "val_loss" and "consecutive" in declines[0].message


class _Regression(pl.LightningModule):
    """Linear regression on noisy targets; ``zigzag`` makes the logged val_loss alternate epoch by epoch."""

    def __init__(self, zigzag):
        super().__init__()
        self.zigzag = zigzag
        self.layer = torch.nn.Linear(8, 1)
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(256, 8, generator=g)
        self.y = self.x @ torch.randn(8, 1, generator=g) + 0.3 * torch.randn(256, 1, generator=g)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        if self.zigzag:
            loss = loss * (1.6 if self.current_epoch % 2 else 0.7)
        self.log("val_loss", loss)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x, self.y), batch_size=32)

    def val_dataloader(self):
        return self.train_dataloader()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.02)


@pytest.mark.parametrize("zigzag", [True, False])
def test_val_fluctuation(tmp_path, zigzag):
    alarm = AnomalyAlarm()
    trainer = pl.Trainer(max_epochs=8, default_root_dir=tmp_path, callbacks=[alarm], **FAST)
    trainer.fit(_Regression(zigzag))
    rules = [a.rule for a in serious(alarm.alerts)]
    if zigzag:
        assert "val_fluctuation" in rules
        first = next(a for a in alarm.alerts if a.rule == "val_fluctuation")
        assert first.epoch == alarm.val_fluctuation_rule.window  # the run after the first full window
    else:
        assert rules == []


def test_step_window_mode(tmp_path):
    # the swing demo's rate alternates every 64-step epoch: windows of 64 steps see the swing
    alarm = AnomalyAlarm(swing_window=64)
    result = run_demo("swing", root=str(tmp_path), callbacks=[alarm])
    assert alarm.swing_rule.unit.startswith("window")
    assert len(alarm.swing_rule.history) > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(result.log_dir)
    acc.Reload()
    assert len(acc.Scalars("diag/loss/train_window")) >= result.global_step // 64 - 1
    assert any(a.rule == "loss_swing" and "window of 64 step" in a.message for a in alarm.alerts)


def test_missing_monitor_is_reported_once(tmp_path, caplog):
    import logging

    alarm = AnomalyAlarm(monitor="val_f1")
    with caplog.at_level(logging.INFO, logger="lightning_diag"):
        run_demo("none", max_epochs=2, root=str(tmp_path), callbacks=[alarm])
    msgs = [r.getMessage() for r in caplog.records if "val_f1" in r.getMessage()]
    assert len(msgs) == 1 and "val_loss" in msgs[0]


def test_no_logger_writes_to_default_root_dir(tmp_path):
    model, data, _ = build_fault("nan")
    trainer = pl.Trainer(
        max_epochs=3,
        default_root_dir=tmp_path,
        logger=False,
        callbacks=[AnomalyAlarm()],
        enable_checkpointing=False,
        **FAST,
    )
    trainer.fit(model, datamodule=data)
    assert [a.rule for a in read_alerts(tmp_path / "diag" / "alerts.jsonl")] == ["nonfinite_loss"]


# -- resume --------------------------------------------------------------------------------------------------
def _overfit_trainer(tmp_path, max_epochs, alarm, ckpt_every=None):
    callbacks = [alarm]
    if ckpt_every:
        callbacks.append(ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=ckpt_every))
    return pl.Trainer(
        max_epochs=max_epochs,
        default_root_dir=tmp_path,
        callbacks=callbacks,
        enable_checkpointing=bool(ckpt_every),
        deterministic=True,
        **FAST,
    )


def _overfit_parts():

    from lightning_diag.demo import DemoConfig, SyntheticDataModule, TinyTransformerClassifier

    fault = FAULTS["overfit"]
    model = TinyTransformerClassifier(dataclasses.replace(DemoConfig(), **fault.config))
    return model, SyntheticDataModule(shuffle=False, **fault.data)


def test_resume_raises_the_same_alerts_at_the_same_epochs(tmp_path):
    key = lambda a: (a.rule, a.source, a.epoch, a.global_step)  # noqa: E731
    pl.seed_everything(0)
    full = AnomalyAlarm()
    _overfit_trainer(tmp_path / "full", 20, full).fit(*_overfit_parts())
    assert {a.rule for a in full.alerts} >= {"val_decline"}

    pl.seed_everything(0)
    first = AnomalyAlarm()
    _overfit_trainer(tmp_path / "a", 10, first, ckpt_every=1).fit(*_overfit_parts())
    ckpt = sorted((tmp_path / "a" / "ckpt").glob("epoch=9*.ckpt"))[0]
    state = torch.load(ckpt, weights_only=False)["callbacks"]
    assert any("AnomalyAlarm" in k for k in state)

    second = AnomalyAlarm()
    _overfit_trainer(tmp_path / "b", 20, second).fit(*_overfit_parts(), ckpt_path=ckpt)
    assert [key(a) for a in first.alerts + second.alerts] == [key(a) for a in full.alerts]
    assert second.val_decline_rule.state_dict() == full.val_decline_rule.state_dict()
    assert second.swing_rule.history == pytest.approx(full.swing_rule.history, rel=1e-4)


class _Returns(pl.LightningModule):
    """Returns the loss as a dict, or None on every third batch (a skipped batch)."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        if self.kind == "none" and batch_idx % 3 == 2:
            return None
        return {"loss": loss, "extra": 1} if self.kind == "dict" else loss

    def train_dataloader(self):
        x = torch.randn(48, 4, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("kind", ["dict", "none"])
def test_runtime_outputs_are_handled(tmp_path, caplog, kind):
    import logging

    alarm = AnomalyAlarm()
    trainer = pl.Trainer(max_epochs=2, default_root_dir=tmp_path, callbacks=[alarm], **FAST)
    with caplog.at_level(logging.INFO, logger="lightning_diag"):
        trainer.fit(_Returns(kind))
    skipped = [r for r in caplog.records if "returned None" in r.getMessage()]
    assert len(skipped) == (1 if kind == "none" else 0)  # said once, not every batch
    assert alarm.swing_rule.previous is not None  # the loss trend still got its epoch means
    assert serious(alarm.alerts) == []


class _TwoOptimizers(pl.LightningModule):
    """Manual optimization with two optimizers (a GAN-style step); the second loss is NaN at step 6."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.gen = torch.nn.Linear(4, 4)
        self.disc = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        g_loss = self.disc(self.gen(batch[0])).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        d_loss = self.disc(batch[0]).pow(2).mean()
        if batch_idx == 3:
            d_loss = d_loss * math.nan
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        return d_loss

    def train_dataloader(self):
        x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.Adam(self.gen.parameters()), torch.optim.Adam(self.disc.parameters())


def test_manual_optimization_two_optimizers(tmp_path):
    model = _TwoOptimizers()
    alarm = AnomalyAlarm()
    trainer = pl.Trainer(max_epochs=1, default_root_dir=tmp_path, callbacks=[alarm], **FAST)
    trainer.fit(model)
    assert [a.rule for a in alarm.alerts] == ["nonfinite_loss"]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert trainer.global_step < 32  # stopped early (each batch takes two optimizer steps)


def _scaler_trainer(tmp_path, alarm, init_scale):
    from pytorch_lightning.plugins.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    return pl.Trainer(
        max_epochs=1,
        default_root_dir=tmp_path,
        callbacks=[alarm],
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        **FAST,
    )


def test_gradscaler_overflows_are_the_scalers_business(tmp_path):
    # an absurd initial scale overflows for a few steps while the scaler calibrates: not a fault
    alarm = AnomalyAlarm()
    trainer = _scaler_trainer(tmp_path, alarm, 2.0**18)
    trainer.fit(_Returns("tensor"))
    assert trainer.precision_plugin.scaler.get_scale() < 2.0**18  # the scaler did skip overflow steps
    assert serious(alarm.alerts) == []
    assert trainer.global_step == 12  # not stopped


def test_gradscaler_persistent_overflow_alerts(tmp_path):
    alarm = AnomalyAlarm(rules={"nonfinite_grad": {"max_scaler_overflows": 3}})
    trainer = _scaler_trainer(tmp_path, alarm, 2.0**127)  # overflows far longer than 3 steps
    trainer.fit(_Returns("tensor"))
    assert [a.rule for a in alarm.alerts] == ["nonfinite_grad"]
    assert alarm.alerts[0].global_step == 2  # the 3rd overflow in a row


def test_accumulated_loss_is_on_the_same_scale(tmp_path):
    means = {}
    for accumulate in (1, 4):
        alarm = AnomalyAlarm()
        pl.seed_everything(0)
        trainer = pl.Trainer(
            max_epochs=1,
            default_root_dir=tmp_path / str(accumulate),
            callbacks=[alarm],
            accumulate_grad_batches=accumulate,
            **FAST,
        )
        trainer.fit(_Returns("tensor"))
        means[accumulate] = alarm.swing_rule.previous  # the epoch's mean: loss_swing's first point
    assert means[4] == pytest.approx(means[1], rel=0.3)  # not divided by 4


def test_the_alarm_keeps_all_its_state_through_the_declared_path():
    """Issue 33: no hand-written checkpoint code; every key is a declaration's, and a round trip restores it."""
    for hook in ("state_dict", "load_state_dict", "on_save_checkpoint", "on_load_checkpoint"):
        assert hook not in vars(AnomalyAlarm), hook
    alarm = AnomalyAlarm(on_nonfinite="warn")
    state = alarm.state_dict()
    assert list(state) == list(alarm.rule_state_keys)
    assert {"accumulators", "nonfinite", "pending_nonfinite", "rollback", "replicas", "runtime_pending"} <= set(state)
    alarm.loss_sums.add(torch.tensor(2.5))
    alarm.loss_sums.window_start = 7
    alarm.deferred.defer(4, torch.tensor(True), torch.tensor(False))
    alarm.pending_losses.add(torch.tensor(1.5), 3)
    alarm.policy.skips = 2
    restored = AnomalyAlarm(on_nonfinite="warn")
    restored.load_state_dict(alarm.state_dict())
    assert restored.state_dict() == alarm.state_dict()
    assert restored.loss_sums.window_start == 7 and float(restored.loss_sums.last_finite) == 2.5
    assert restored.deferred.steps == 1 and restored.policy.skips == 2
    assert restored.pending_losses.steps == [3]
