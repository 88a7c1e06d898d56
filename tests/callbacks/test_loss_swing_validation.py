"""Issues 44 and 45 (item 6): ``loss_swing``'s validation view, through real ``Trainer.fit`` runs.

The validation loss is measured on the same samples at every run, so a change between two runs is the model's,
judged against the runs' standard errors (from the values ``validation_step`` returns, else each validation sample
as noisy as a training step). Up-and-down changes of more than 10% on 3 consecutive runs fire ``loss_swing`` with
the validation metric as its source; a validation loss that falls steadily, or only climbs, does not.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_diag import AnomalyAlarm
from lightning_diag.demo.run import run_demo
from lightning_diag.report import build_report
from tests.callbacks.tiny import FAST

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class FlippingTarget(pl.LightningModule):
    """A 2-layer MLP (width 64) regressing ``y = x @ w``; with ``flip``, every other epoch's training batches carry
    ``-y`` (a label convention that alternates between epochs): the model follows, and its validation loss on the
    fixed convention swings up and down. ``returns`` makes ``validation_step`` return its loss."""

    def __init__(self, flip: bool, returns: bool = False, lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))
        self.flip, self.returns, self.lr = flip, returns, lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        sign = -1.0 if self.flip and self.current_epoch % 2 else 1.0
        loss = nn.functional.mse_loss(self.net(x), sign * y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("val_loss", loss)
        return loss if self.returns else None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _loader(n: int, batch_size: int, seed: int, shuffle: bool) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.linspace(-1.0, 1.0, 8)[:, None] + 0.1 * torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle, generator=g)


def _fit(tmp_path: Any, alarm: AnomalyAlarm, flip: bool, steps: int, epochs: int, returns: bool = False,
         ckpt_path: str | None = None, logger: Any = False) -> pl.Trainer:
    batch_size = 16
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_epochs=epochs, default_root_dir=tmp_path, callbacks=[alarm], logger=logger,
                         log_every_n_steps=5, **FAST)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(FlippingTarget(flip, returns), _loader(steps * batch_size, batch_size, 0, True),
                    _loader(128, 32, 1, False), ckpt_path=ckpt_path)
    return trainer


def _serious(alarm: AnomalyAlarm) -> list[tuple[str, str, int]]:
    return [(a.rule, a.source, a.epoch) for a in alarm.alerts if a.severity != "info"]


@pytest.mark.parametrize(
    ("steps", "returns"),
    [(4, False), (16, False), (16, True), (64, False), pytest.param(256, False, marks=pytest.mark.slow)],
)
def test_the_validation_view_fires_at_each_epoch_length(tmp_path, steps, returns):
    alarm = AnomalyAlarm()
    _fit(tmp_path, alarm, True, steps, 6, returns)
    fired = [(epoch, source) for rule, source, epoch in _serious(alarm) if rule == "loss_swing"]
    # the 4th validation run (epoch 3) closes the 3rd up-and-down change: the earliest the contract allows
    assert (3, "val_loss") in fired, _serious(alarm)
    twin = AnomalyAlarm()
    _fit(tmp_path, twin, False, steps, 6, returns)
    assert _serious(twin) == []
    assert len(twin.swing_rule.val_history) == 4 and twin.swing_rule.val_last_z == twin.swing_rule.val_last_z


def test_the_validation_view_survives_a_resume(tmp_path):
    straight = AnomalyAlarm()
    _fit(tmp_path / "a", straight, True, 16, 6)
    first = AnomalyAlarm()
    trainer = _fit(tmp_path / "b", first, True, 16, 3)  # validation runs 0-2: two swinging changes, no alert yet
    assert first.swing_rule.val_streak[0] == 2 and not [a for a in first.alerts if a.source == "val_loss"]
    ckpt = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed = AnomalyAlarm()
    _fit(tmp_path / "b", resumed, True, 16, 6, ckpt_path=str(ckpt))
    val_alerts = [(a.global_step, a.epoch) for a in straight.alerts if a.source == "val_loss"]
    assert val_alerts and [(a.global_step, a.epoch) for a in resumed.alerts if a.source == "val_loss"] == val_alerts


@pytest.mark.parametrize("flip", [True, False])
def test_the_report_replays_the_validation_view(tmp_path, flip):
    from pytorch_lightning.loggers import TensorBoardLogger

    alarm = AnomalyAlarm()
    trainer = _fit(tmp_path, alarm, flip, 16, 6, logger=TensorBoardLogger(str(tmp_path), name="run"))
    live = [a.global_step for a in alarm.alerts if a.rule == "loss_swing" and a.source == "val_loss"]
    assert bool(live) == flip
    (Path(trainer.log_dir) / "diag" / "alerts.jsonl").unlink(missing_ok=True)  # the replay alone must find it
    (report,) = build_report(tmp_path)
    (row,) = [c for c in report.checks if c.id == "loss_swing"]
    # the logged validation losses and the standard errors they were judged with (diag/loss/val_se) replay it
    assert (row.status, row.alerts) == (("fail", 0) if flip else ("pass", 0)), row
    if flip:  # its training loss does not swing by the numbers: the row fails on the validation view, as live
        assert [a.source for a in alarm.alerts if a.rule == "loss_swing"] == ["val_loss"]
        # on the user's step axis (the step Lightning logged the epoch's last batch at: one before the global step)
        assert row.first_alert_step == live[0] - 1 and row.replayed == 1


@pytest.mark.slow
def test_the_batch_size_one_oscillation_is_caught_on_its_second_seed(tmp_path):
    # SGD with momentum 0.9 at 0.1, batch size 1: validation losses 8.5, 6.5, 13.0, 7.6, 13.8 on the same samples
    # (seed 0 and both twins: tests/callbacks/test_output_collapse.py); the healthy twin at 1e-3 falls steadily
    fault = run_demo("oscillation_bs1", root=str(tmp_path / "fault"), seed=1)
    assert [(a.source, a.epoch) for a in fault.alerts if a.rule == "loss_swing"] == [("val_loss", 4)]
    healthy = run_demo("healthy_bs1", root=str(tmp_path / "healthy"), seed=1)
    assert [a.format() for a in healthy.alerts if a.severity != "info"] == []
