"""Every callback in the training setups users have (issue 7), each through a real ``Trainer.fit`` on a tiny model.

The matrix these tests back is ``docs/compatibility.md``.
"""

import json
import logging
import math

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_diag import AnomalyAlarm, GradientFlowMonitor, read_alerts
from tests.callbacks.tiny import FAST, TinyAttention, by_type, every_callback, serious

# a baseline that never completes keeps every measured blocks' norm in `collapse_rule.early`
RECORD_NORMS = {"GradientFlowMonitor": {"rules": {"grad_collapse": {"baseline_measurements": 10_000}}}}


def scalar_tags(log_dir):
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return acc, set(acc.Tags()["scalars"])


class GradNorms(pl.Callback):
    """Brute-force global gradient norm at every optimizer step, taken where the monitor takes its own."""

    def __init__(self):
        self.norms = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [p.grad.flatten() for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.cat(grads).norm()))


# -- precision ------------------------------------------------------------------------------------------------
def test_bf16_mixed_measures_and_stops_before_a_nan_update(tmp_path):
    callbacks = every_callback(**RECORD_NORMS)
    model = TinyAttention(nan_at_step=3)
    trainer = pl.Trainer(max_steps=8, precision="bf16-mixed", default_root_dir=tmp_path, callbacks=callbacks, **FAST)
    trainer.fit(model)
    alarm, monitor = by_type(callbacks, AnomalyAlarm), by_type(callbacks, GradientFlowMonitor)
    assert [(a.rule, a.global_step) for a in alarm.alerts] == [("nonfinite_loss", 3)]
    assert trainer.global_step == 4 and all(torch.isfinite(p).all() for p in model.parameters())
    assert len(monitor.collapse_rule.early) == 3 and all(n > 0 for n in monitor.collapse_rule.early)
    _, tags = scalar_tags(trainer.log_dir)
    assert {"diag/grad_norm/total", "diag/attn_entropy/attn/mean", "diag/loss/train_step"} <= tags
    assert serious([c for c in callbacks if c is not alarm]) == []


# -- gradient accumulation and clipping -------------------------------------------------------------------------
def test_accumulation_measures_the_accumulated_gradient_once_per_optimizer_step(tmp_path):
    brute = GradNorms()
    callbacks = every_callback(**RECORD_NORMS, AnomalyAlarm={"swing_window": 2})
    trainer = pl.Trainer(
        max_steps=6,
        accumulate_grad_batches=4,
        default_root_dir=tmp_path,
        callbacks=[brute, *callbacks],
        limit_val_batches=0,
        **FAST,
    )
    trainer.fit(TinyAttention(samples=96))
    assert len(brute.norms) == 6  # 24 micro-batches, 6 optimizer steps
    acc, _ = scalar_tags(trainer.log_dir)
    assert [e.value for e in acc.Scalars("diag/grad_norm/total")] == pytest.approx(brute.norms, rel=1e-5)
    # step windows count optimizer steps, not micro-batches: windows of 2 close after optimizer steps 2, 4 and 6,
    # logged on the user's axis (Lightning's batches that stepped before the step: 1, 3, 5)
    assert [e.step for e in acc.Scalars("diag/loss/train_window")] == [1, 3, 5]
    assert [e.step for e in acc.Scalars("diag/attn_entropy/attn/mean")] == [0, 1, 2, 3, 4, 5]
    assert serious(callbacks) == []


def test_gradient_norms_are_measured_before_clipping(tmp_path):
    brute = GradNorms()
    callbacks = every_callback(**RECORD_NORMS)
    trainer = pl.Trainer(
        max_steps=4, gradient_clip_val=1e-4, default_root_dir=tmp_path, callbacks=[brute, *callbacks], **FAST
    )
    trainer.fit(TinyAttention())
    acc, _ = scalar_tags(trainer.log_dir)
    norms = [e.value for e in acc.Scalars("diag/grad_norm/total")]
    assert norms == pytest.approx(brute.norms, rel=1e-5)
    assert min(norms) > 100 * 1e-4  # the unclipped norm, far above the clipping threshold


# -- manual optimization ------------------------------------------------------------------------------------------
class TwoOptimizers(TinyAttention):
    """A GAN-style step: optimizer 0 updates ``embed`` and ``attn``, optimizer 1 updates ``head``."""

    def __init__(self, nan_at_batch=None):
        super().__init__()
        self.automatic_optimization = False
        self.nan_at_batch = nan_at_batch

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        for opt in (opt_a, opt_b):
            loss = self.per_sample_loss(batch).mean()
            if opt is opt_b and batch_idx == self.nan_at_batch:
                loss = loss * math.nan
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def configure_optimizers(self):
        first = [*self.embed.parameters(), *self.attn.parameters()]
        return torch.optim.SGD(first, lr=0.05), torch.optim.SGD(self.head.parameters(), lr=0.05)


def test_manual_optimization_two_optimizers_measures_both(tmp_path):
    # an even interval: the second optimizer always steps on odd global steps, and is still measured
    callbacks = every_callback()
    callbacks[0] = GradientFlowMonitor(log_every_n_steps=2)
    trainer = pl.Trainer(max_steps=8, default_root_dir=tmp_path, callbacks=callbacks, **FAST)
    trainer.fit(TwoOptimizers())
    acc, tags = scalar_tags(trainer.log_dir)
    assert {"diag/grad_norm/embed", "diag/grad_norm/attn.out_proj", "diag/grad_norm/head"} <= tags
    # on the user's axis and cadence: one step per batch however many optimizers stepped, every second batch
    # (batches 1 and 3 of 4, global_step 2-3 and 6-7), both optimizers in each
    assert [e.step for e in acc.Scalars("diag/grad_norm/total")] == [1, 3]
    assert [e.step for e in acc.Scalars("diag/grad_norm/total/optimizer_1")] == [1, 3]
    assert serious(callbacks) == []


def test_manual_optimization_nan_in_the_second_optimizer_is_blocked(tmp_path):
    callbacks = every_callback()
    model = TwoOptimizers(nan_at_batch=2)
    trainer = pl.Trainer(max_steps=20, default_root_dir=tmp_path, callbacks=callbacks, **FAST)
    trainer.fit(model)
    alarm = by_type(callbacks, AnomalyAlarm)
    assert [(a.rule, a.global_step) for a in alarm.alerts] == [("nonfinite_loss", 5)]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert trainer.global_step < 20


# -- torch.compile --------------------------------------------------------------------------------------------------
class CompiledInside(TinyAttention):
    def __init__(self):
        super().__init__()
        self.head = torch.compile(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)))


@pytest.mark.slow
@pytest.mark.parametrize("where", ["module", "submodule"])
def test_torch_compile(tmp_path, where):
    callbacks = every_callback(**RECORD_NORMS)
    model = torch.compile(TinyAttention()) if where == "module" else CompiledInside()
    trainer = pl.Trainer(max_steps=3, default_root_dir=tmp_path, callbacks=callbacks, **FAST)
    trainer.fit(model)
    assert len(by_type(callbacks, GradientFlowMonitor).collapse_rule.early) == 3
    _, tags = scalar_tags(trainer.log_dir)
    layer = "head.0" if where == "submodule" else "head"
    assert f"diag/grad_norm/{layer}" in tags  # the model's own names, without `_orig_mod`
    assert not any("_orig_mod" in t for t in tags)
    assert "diag/attn_entropy/attn/mean" in tags
    assert serious(callbacks) == []


# -- resume mid-run ---------------------------------------------------------------------------------------------------
class Crash(pl.Callback):
    """Kills the fit at the end of a step, after a checkpoint was written: what a resume starts from."""

    def __init__(self, at_step):
        self.at_step = at_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at_step:
            raise RuntimeError("simulated crash")


def _run(root, callbacks, max_steps, ckpt_every=None, ckpt_path=None, nan_at_step=None):
    extra = (
        [ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=ckpt_every, save_top_k=-1)] if ckpt_every else []
    )
    if ckpt_every:
        extra.insert(0, Crash(ckpt_every + 1))
    trainer = pl.Trainer(
        max_steps=max_steps,
        default_root_dir=root,
        callbacks=[*callbacks, *extra],
        **{**FAST, "enable_checkpointing": bool(ckpt_every)},
    )
    trainer.fit(TinyAttention(nan_at_step=nan_at_step, repeat=True), ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize(
    ("overrides", "nan_at_step"),
    [
        # a step window open at the checkpoint (windows of 4 close at 4 and 8), partial epoch sums
        ({"AnomalyAlarm": {"swing_window": 4}}, None),
        # warn mode: the first bad step (5) is pending, read back only at the logging step 8
        ({"AnomalyAlarm": {"on_nonfinite": "warn", "log_every_n_steps": 4}}, 5),
    ],
    ids=["healthy", "warn-pending"],
)
def test_resume_mid_epoch_restores_every_callbacks_state(tmp_path, overrides, nan_at_step):
    def fresh():
        return every_callback(**overrides)

    def same(state):  # NaN-aware comparison of two states
        return json.dumps(state, sort_keys=True)

    full = fresh()
    _run(tmp_path / "full", full, 10, nan_at_step=nan_at_step)
    first = fresh()
    with pytest.raises(RuntimeError, match="simulated crash"):  # 8 batches an epoch: the checkpoint is mid-epoch
        _run(tmp_path / "a", first, 10, ckpt_every=6, nan_at_step=nan_at_step)
    (ckpt,) = (tmp_path / "a" / "ckpt").glob("*step=6*.ckpt")
    second = fresh()
    _run(tmp_path / "b", second, 10, ckpt_path=ckpt, nan_at_step=nan_at_step)
    for whole, before, after in zip(full, first, second, strict=True):
        name = type(whole).__name__
        assert [a.to_dict() for a in before.alerts + after.alerts] == [a.to_dict() for a in whole.alerts], name
        assert same(after.state_dict()) == same(whole.state_dict()), name
    if nan_at_step is not None:
        (alert,) = by_type(second, AnomalyAlarm).alerts
        assert (alert.rule, alert.global_step) == ("nonfinite_loss", 5)
        assert "Last finite loss: nan" not in alert.message


# -- trainer modes and loggers ----------------------------------------------------------------------------------------
def test_fast_dev_run_writes_alerts_to_default_root_dir(tmp_path):
    callbacks = every_callback()
    trainer = pl.Trainer(fast_dev_run=True, default_root_dir=tmp_path, callbacks=callbacks, **FAST)
    trainer.fit(TinyAttention(nan_at_step=0))
    assert [a.rule for a in read_alerts(tmp_path / "diag" / "alerts.jsonl")] == ["nonfinite_loss"]
    _, tags = scalar_tags(tmp_path / "diag")
    assert {"diag/grad_norm/total", "diag/attn_entropy/attn/mean"} <= tags


def test_validate_test_predict_with_callbacks_attached(tmp_path):
    callbacks = every_callback()
    model = TinyAttention(nan_at_step=2)
    trainer = pl.Trainer(max_steps=6, default_root_dir=tmp_path, callbacks=callbacks, **FAST)
    trainer.fit(model)
    after_fit = [list(cb.alerts) for cb in callbacks]
    assert after_fit[2] and after_fit[2][0].rule == "nonfinite_loss"
    log = tmp_path / "lightning_logs" / "version_0" / "diag" / "alerts.jsonl"
    lines = log.read_text()
    assert trainer.validate(model, verbose=False)[0]["val_loss"] >= 0
    assert trainer.test(model, verbose=False)[0]["test_loss"] >= 0
    assert len(trainer.predict(model)) == 8
    # nothing is measured outside fit; the fit's alerts stay readable
    assert [list(cb.alerts) for cb in callbacks] == after_fit
    assert log.read_text() == lines
    fresh = every_callback()
    pl.Trainer(default_root_dir=tmp_path / "fresh", callbacks=fresh, **FAST).validate(TinyAttention(), verbose=False)
    assert [cb.alerts for cb in fresh] == [[], [], []]
    assert not (tmp_path / "fresh" / "lightning_logs" / "version_0" / "diag" / "alerts.jsonl").exists()


def test_logger_false_writes_to_default_root_dir(tmp_path):
    callbacks = every_callback()
    trainer = pl.Trainer(max_steps=6, logger=False, default_root_dir=tmp_path, callbacks=callbacks, **FAST)
    trainer.fit(TinyAttention(nan_at_step=4))
    assert [a.rule for a in read_alerts(tmp_path / "diag" / "alerts.jsonl")] == ["nonfinite_loss"]
    _, tags = scalar_tags(tmp_path / "diag")
    assert {"diag/grad_norm/total", "diag/attn_entropy/attn/mean", "diag/loss/train_step"} <= tags


def test_csv_logger_only(tmp_path):
    callbacks = every_callback()
    logger = CSVLogger(tmp_path, name="csv")
    trainer = pl.Trainer(max_steps=6, logger=logger, default_root_dir=tmp_path, callbacks=callbacks, **FAST)
    trainer.fit(TinyAttention(nan_at_step=4))
    diag = tmp_path / "csv" / "version_0" / "diag"
    assert trainer.log_dir == str(tmp_path / "csv" / "version_0")
    assert [a.rule for a in read_alerts(diag / "alerts.jsonl")] == ["nonfinite_loss"]
    _, tags = scalar_tags(diag)  # the library's own SummaryWriter, beside the CSV files
    assert {"diag/grad_norm/total", "diag/attn_entropy/attn/mean"} <= tags


# -- bad input at run time --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("returns", "needle"),
    [("dict", None), ("none", "returned None"), ("vector", "loss of shape (4,)")],
)
def test_training_step_outputs_are_explained_once(tmp_path, caplog, returns, needle):
    callbacks = every_callback()
    trainer = pl.Trainer(max_epochs=2, default_root_dir=tmp_path, callbacks=callbacks, **FAST)
    with caplog.at_level(logging.INFO, logger="lightning_diag"):
        trainer.fit(TinyAttention(returns=returns))
    # the run's diag folder is announced once at fit start; the rest are the explanations under test
    messages = [r.getMessage() for r in caplog.records if not r.getMessage().startswith("diagnostics of this run")]
    if needle is None:
        assert messages == []
    else:
        assert sum(needle in m for m in messages) == 1, messages
    assert trainer.global_step == 16
    # the loss trend still runs: both epochs reached loss_swing, each a point with its own steps' spread
    assert len(by_type(callbacks, AnomalyAlarm).swing_rule.recent) == 2
    assert serious(callbacks) == []


class Frozen(TinyAttention):
    """No trainable parameter in the model: the optimizer trains a free-standing scale."""

    def __init__(self):
        super().__init__()
        self.requires_grad_(False)
        self.scale = torch.ones((), requires_grad=True)

    def training_step(self, batch, batch_idx):
        return self.per_sample_loss(batch).mean() * self.scale

    def configure_optimizers(self):
        return torch.optim.SGD([self.scale], lr=0.01)


def test_model_without_trainable_parameters_is_explained_once(tmp_path, caplog):
    callbacks = every_callback()
    trainer = pl.Trainer(max_steps=6, default_root_dir=tmp_path, callbacks=callbacks, **FAST)
    with caplog.at_level(logging.INFO, logger="lightning_diag"):
        trainer.fit(Frozen())
    messages = [r.getMessage() for r in caplog.records]
    assert sum("no trainable parameters" in m for m in messages) == 1, messages
    assert trainer.global_step == 6
    assert serious(callbacks) == []


class NoAttention(TinyAttention):
    """Embedding, mean pool, linear: no attention module."""

    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Identity()

    def forward(self, ids):
        return self.head(self.embed(ids).mean(dim=1))


def test_model_without_attention_is_explained_once(tmp_path, caplog):
    callbacks = every_callback()
    trainer = pl.Trainer(max_steps=6, default_root_dir=tmp_path, callbacks=callbacks, **FAST)
    with caplog.at_level(logging.INFO, logger="lightning_diag"):
        trainer.fit(NoAttention())
    messages = [r.getMessage() for r in caplog.records]
    assert sum("no attention recognised" in m for m in messages) == 1, messages
    assert trainer.global_step == 6
    assert serious(callbacks) == []
