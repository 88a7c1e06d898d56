"""All seven callbacks together in every training setup of the matrix (issue 23 §5): bf16, gradient
accumulation, clipping, manual optimization, torch.compile (slow), a mid-epoch resume, fast_dev_run, no logger
and a CSV logger only. One small model and a few steps per setup; each fit carries all seven callbacks, so the
matrix costs one fit per setup. ``tests/callbacks/test_setups.py`` holds the detailed per-setup checks of the
gradient, attention and anomaly callbacks; ``docs/compatibility.md`` is the matrix these tests back.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_diag import (
    AnomalyAlarm,
    AttentionEntropyMonitor,
    DataDiagnostics,
    GradientFlowMonitor,
    QuantizationProbe,
    SharpnessProbe,
    SystemMonitor,
)
from lightning_diag.output.writer import set_logger_series
from tests.callbacks.system_models import FakeTime
from tests.callbacks.tiny import FAST, SEQ, VOCAB, TinyAttention

#: What each callback writes when it ran (a scalar tag of its own).
EVIDENCE = {
    "GradientFlowMonitor": "diag/grad_norm/total",
    "AnomalyAlarm": "diag/loss/train_step",
    "AttentionEntropyMonitor": "diag/attn_entropy/attn/mean",
    "DataDiagnostics": "diag/data/train/samples",
    "SystemMonitor": "diag/system/step_time_s",
    "SharpnessProbe": "diag/sharpness/gap",
    "QuantizationProbe": "diag/quant/end_to_end",
}


def all_seven(**probe: Any) -> list[Any]:
    """One of each callback with its defaults, measuring often enough for a run of a few steps. The
    SystemMonitor runs on a fake clock, so that its state is the same in a resumed and an uninterrupted run."""
    monitor = SystemMonitor(log_every_n_steps=2)
    monitor.time_source = FakeTime()
    return [
        GradientFlowMonitor(log_every_n_steps=1),
        AnomalyAlarm(log_every_n_steps=1),
        AttentionEntropyMonitor(log_every_n_steps=1),
        DataDiagnostics(),
        monitor,
        SharpnessProbe(**probe),
        QuantizationProbe(backend="fake", **probe),  # the torchao engine: tests/callbacks/test_probes.py
    ]


class Split(TinyAttention):
    """The tiny attention model with a validation set of its own (the shared one copies the training set, which
    DataDiagnostics rightly calls leakage)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        g = torch.Generator().manual_seed(1)
        self.val_ids = torch.randint(0, VOCAB, (16, SEQ), generator=g)
        self.val_y = self.val_ids.float().mean(dim=1, keepdim=True) / VOCAB

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        data = torch.utils.data.TensorDataset(self.val_ids, self.val_y)
        return torch.utils.data.DataLoader(data, batch_size=4)


class ManualSplit(Split):
    """Manual optimization with two optimizers (a GAN-style step)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = torch.zeros(())
        for opt in self.optimizers():
            loss = self.per_sample_loss(batch).mean()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def configure_optimizers(self) -> Any:
        first = [*self.embed.parameters(), *self.attn.parameters()]
        return torch.optim.SGD(first, lr=0.05), torch.optim.SGD(self.head.parameters(), lr=0.05)


def serious(callbacks: list[Any]) -> list[str]:
    return [a.format() for cb in callbacks for a in cb.alerts if a.severity != "info"]


def scalar_tags(log_dir: Any) -> set[str]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return set(acc.Tags()["scalars"])


def check_all_ran(callbacks: list[Any], log_dir: Any, without: tuple[str, ...] = ()) -> None:
    assert serious(callbacks) == []
    tags = scalar_tags(log_dir)
    missing = {name: tag for name, tag in EVIDENCE.items() if tag not in tags and name not in without}
    assert missing == {}, sorted(tags)


SETUPS: dict[str, dict[str, Any]] = {
    "bf16-mixed": {"precision": "bf16-mixed"},
    "accumulation": {"accumulate_grad_batches": 2},
    "clipping": {"gradient_clip_val": 1e-3},
    "no-logger": {"logger": False},
}


@pytest.mark.parametrize("setup", list(SETUPS))
def test_every_callback_in_the_setup(tmp_path, setup):
    callbacks = all_seven()
    trainer = pl.Trainer(max_steps=8, default_root_dir=tmp_path, callbacks=callbacks, **{**FAST, **SETUPS[setup]})
    trainer.fit(Split())  # 8 batches an epoch: the probes run at the validation closing it
    assert trainer.global_step == 8
    check_all_ran(callbacks, tmp_path / "diag" if setup == "no-logger" else trainer.log_dir)


def test_every_callback_with_manual_optimization(tmp_path):
    # training_step steps the optimizers itself: the probes take the loss from loss_fn (as documented)
    callbacks = all_seven(loss_fn=lambda module, batch: module.per_sample_loss(batch).mean())
    trainer = pl.Trainer(max_steps=16, default_root_dir=tmp_path, callbacks=callbacks, **FAST)
    trainer.fit(ManualSplit())
    assert trainer.global_step == 16  # 8 batches, two optimizer steps each
    check_all_ran(callbacks, trainer.log_dir)
    assert "diag/grad_norm/total/optimizer_1" in scalar_tags(trainer.log_dir)


def test_every_callback_with_fast_dev_run(tmp_path):
    callbacks = all_seven()
    trainer = pl.Trainer(fast_dev_run=True, default_root_dir=tmp_path, callbacks=callbacks, **FAST)
    trainer.fit(Split())
    # one training batch and one validation batch: the SystemMonitor logs nothing before its first interval ends
    check_all_ran(callbacks, tmp_path / "diag", without=("SystemMonitor",))


def test_every_callback_with_a_csv_logger_only(tmp_path):
    callbacks = all_seven()
    logger = CSVLogger(tmp_path, name="csv")
    set_logger_series("all", logger)  # every series, not only the summary
    trainer = pl.Trainer(max_steps=8, logger=logger, default_root_dir=tmp_path, callbacks=callbacks, **FAST)
    trainer.fit(Split())
    check_all_ran(callbacks, tmp_path / "csv" / "version_0" / "diag")  # the library's own writer beside the CSV
    header = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().splitlines()[0]
    assert all(tag in header for tag in EVIDENCE.values()), header


@pytest.mark.slow
def test_every_callback_with_torch_compile(tmp_path, caplog):
    callbacks = all_seven()
    trainer = pl.Trainer(max_steps=8, default_root_dir=tmp_path, callbacks=callbacks, **FAST)
    with caplog.at_level(logging.INFO, logger="lightning_diag"):
        trainer.fit(torch.compile(Split()))
    # a compiled graph runs no forward hooks inside it: the quantization probe sees no layer, and says so once
    check_all_ran(callbacks, trainer.log_dir, without=("QuantizationProbe",))
    messages = [r.getMessage() for r in caplog.records]
    assert sum("QuantizationProbe: probe skipped: no nn.Linear" in m for m in messages) == 1, messages


class Crash(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 7:
            raise RuntimeError("simulated crash")


def test_every_callbacks_state_survives_a_mid_epoch_resume(tmp_path):
    def fit(root: Any, callbacks: list[Any], ckpt_path: Any = None, crash: bool = False) -> None:
        extra: list[Any] = []
        if crash:
            extra = [Crash(), ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=6, save_top_k=-1)]
        kwargs = {**FAST, "enable_checkpointing": crash, "limit_val_batches": 2, "val_check_interval": 4}
        trainer = pl.Trainer(max_steps=12, default_root_dir=root, callbacks=[*callbacks, *extra], **kwargs)
        trainer.fit(Split(samples=64, repeat=True), ckpt_path=ckpt_path)

    whole = all_seven()
    fit(tmp_path / "whole", whole)
    first = all_seven()
    with pytest.raises(RuntimeError, match="simulated crash"):  # 16 batches an epoch: step 6 is mid-epoch
        fit(tmp_path / "a", first, crash=True)
    (ckpt,) = (tmp_path / "a" / "ckpt").glob("*step=6*.ckpt")
    second = all_seven()
    fit(tmp_path / "b", second, ckpt_path=ckpt)
    def state(callback: Any) -> str:
        saved = callback.state_dict()
        if isinstance(callback, DataDiagnostics):
            # a resumed fit measures its data again at its start (as every fit does): one measurement more,
            # the same values and latches
            saved["rules"].pop("measurements", None)
        if isinstance(callback, SystemMonitor):
            # the checkpoint is written inside step 6, before its interval (steps 5-6) is reported, so the resumed
            # run never counts those two steps (tests/callbacks/test_system_monitor.py); the RSS history is the
            # process's. The rules' latches are compared.
            assert saved.pop("steps_seen") in (12, 10)
            # the steps judged from the fit's start (the warm-up bypass) miss the same two steps; the resumed
            # fit's first step is a known one-time cause (no previous batch end to time its data wait from)
            assert len(saved.pop("run_window")) in (12, 10)
            assert len(saved.pop("run_pressure")) in (12, 10)  # and their CPU pressure, the machine's of the moment
            saved["memory"] = saved["memory"]["latch"]
        return json.dumps(saved, sort_keys=True)

    for full, before, after in zip(whole, first, second, strict=True):
        name = type(full).__name__
        assert state(after) == state(full), name
        # the alerts of the two halves are those of the uninterrupted run
        halves = [a.to_dict() for a in before.alerts if a.global_step <= 6] + [a.to_dict() for a in after.alerts]
        assert halves == [a.to_dict() for a in full.alerts], name
    assert serious(whole) == []
