"""Diagnostics on the user's step axis and cadence (issue 37 item 2), in CSV, TensorBoard and W&B (offline).

Real ``Trainer.fit`` runs with the default callbacks and ``log_every_n_steps=5`` on 40 batches: a manual GAN with
two optimizers (``global_step`` 80), gradient accumulation 2, and plain automatic optimization with an attention
layer. Lightning writes the user's ``self.log`` values at the batches that stepped, when ``(n + 1) % 5 == 0``;
every diagnostic row of every logger must be on one of those steps, and every such step must carry the gradient
norm. The same fits check what each logger gets (issue 34 item 6): TensorBoard every series, CSV and W&B the
bounded summary.
"""

from __future__ import annotations

import csv
import fnmatch
import os
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from lightning_diag import AnomalyAlarm, AttentionEntropyMonitor, GradientFlowMonitor, SystemMonitor
from lightning_diag.callbacks.common.step_axis import StepAxis
from lightning_diag.output.writer import SUMMARY_SERIES
from tests.output.logger_models import FAST, Regression, TwoOptimizers

BATCHES = 40
EVERY = 5


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", os.environ.get("TMPDIR", "/tmp"))
    torch.set_num_threads(1)


def _data(model: Regression) -> None:
    g = torch.Generator().manual_seed(0)
    model.x = torch.randn(4 * BATCHES, 8, generator=g)
    model.y = model.x.sum(1, keepdim=True)


class Gan(TwoOptimizers):
    """The issue's case: manual optimization, two optimizers stepped every batch."""

    def __init__(self) -> None:
        super().__init__()
        _data(self)


class Attention(Regression):
    """Automatic optimization through an ``nn.MultiheadAttention`` over 2 tokens of 4 features."""

    def __init__(self) -> None:
        super().__init__()
        _data(self)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        tokens = x.reshape(-1, 2, 4)
        mixed, _ = self.attn(tokens, tokens, tokens)
        return (self.net(mixed.reshape(-1, 8)) - y).pow(2).mean()


class SpyWandb(WandbLogger):
    """The W&B logger (offline), keeping each ``log_metrics`` call's keys and step."""

    calls: list[tuple[int, set[str]]]

    def log_metrics(self, metrics: Any, step: Any = None) -> None:
        self.calls.append((int(step), set(metrics)))
        super().log_metrics(metrics, step)


def _fit(tmp_path: Path, model: pl.LightningModule, accumulate: int = 1) -> dict[str, dict[str, set[int]]]:
    """One fit with TensorBoard (first: it gets every series), CSV and W&B; tag -> steps, per logger."""
    tb = TensorBoardLogger(tmp_path / "tb")
    csv_logger = CSVLogger(tmp_path / "csv")
    wandb = SpyWandb(save_dir=str(tmp_path), offline=True, project="axis")
    wandb.calls = []
    callbacks = [GradientFlowMonitor(), AnomalyAlarm(), SystemMonitor(), AttentionEntropyMonitor()]
    trainer = pl.Trainer(
        max_epochs=1,
        logger=[tb, csv_logger, wandb],
        log_every_n_steps=EVERY,
        accumulate_grad_batches=accumulate,
        callbacks=callbacks,
        default_root_dir=tmp_path,
        **FAST,
    )
    trainer.fit(model)
    wandb.experiment.finish()
    out: dict[str, dict[str, set[int]]] = {"tb": {}, "csv": {}, "wandb": {}}
    acc = EventAccumulator(tb.log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    for tag in acc.Tags()["scalars"]:
        out["tb"][tag] = {e.step for e in acc.Scalars(tag)}
    with open(Path(csv_logger.log_dir) / "metrics.csv", newline="") as fh:
        for row in csv.DictReader(fh):
            for key, value in row.items():
                if key != "step" and value not in ("", None):
                    out["csv"].setdefault(key, set()).add(int(row["step"]))
    for step, keys in wandb.calls:
        for key in keys:
            out["wandb"].setdefault(key, set()).add(step)
    out["global_step"] = {"": {trainer.global_step}}
    return out


def _check_axis(series: dict[str, dict[str, set[int]]], stepped: int) -> None:
    want = {s for s in range(stepped) if (s + 1) % EVERY == 0}
    for name in ("tb", "csv", "wandb"):
        tags = series[name]
        assert tags["user_loss"] == want, name
        diag = {tag: steps for tag, steps in tags.items() if tag.startswith("diag/")}
        off = {tag: sorted(steps - want) for tag, steps in diag.items() if steps - want}
        assert not off, (name, off)
        assert tags["diag/grad_norm/total"] == want, name  # every logging batch is measured


@pytest.mark.parametrize(
    ("case", "stepped"),
    [("gan", BATCHES), ("accumulate", BATCHES // 2), ("automatic", BATCHES)],
)
def test_every_diag_row_is_on_a_step_of_the_users_metrics(tmp_path, case, stepped):
    model = Gan() if case == "gan" else Attention()
    series = _fit(tmp_path, model, accumulate=2 if case == "accumulate" else 1)
    if case == "gan":
        assert series["global_step"][""] == {2 * BATCHES}
        assert series["tb"]["diag/grad_norm/total/optimizer_1"] == series["tb"]["user_loss"]
    else:
        assert any(tag.startswith("diag/attn_entropy/attn/") for tag in series["tb"])
    _check_axis(series, stepped)
    # Which logger gets what: TensorBoard every series, CSV and W&B the summary (bounded, documented).
    tb_diag = {t for t in series["tb"] if t.startswith("diag/")}
    for name in ("csv", "wandb"):
        # the alert table (a row per alert, when one fires on this loaded machine) is the alerts, not a series
        got = {t for t in series[name] if t.startswith("diag/") and t != "diag/alerts_table"}
        assert all(any(fnmatch.fnmatchcase(t, p) for p in SUMMARY_SERIES) for t in got), sorted(got)
        assert "diag/grad_norm/total" in got and "diag/alerts/count" in got
        assert len(got) <= 12, sorted(got)
        assert len(tb_diag) > 2 * len(got), (len(tb_diag), sorted(got))
    if case == "automatic":
        assert "diag/attn_entropy/mean" in series["csv"]
        assert "diag/loss/train_step" in series["csv"]


def test_step_axis_cadence_counts_batches_that_step():
    axis = StepAxis()
    axis.stepped, axis.pending = 4, True
    assert axis.cadence_step == 5 and axis.logs(5) and not axis.logs(3)
    axis.pending = False  # an accumulating micro-batch: Lightning writes nothing there
    assert not axis.logs(5)


def test_the_axis_follows_an_accumulation_schedule_across_epochs(tmp_path):
    # The step axis reads what decides a stepping batch once per epoch (after every epoch start, where the
    # scheduler sets the accumulation): epoch 0 steps every batch, epoch 1 every third and its short last one.
    from pytorch_lightning.callbacks import GradientAccumulationScheduler

    tb = TensorBoardLogger(tmp_path / "tb")
    trainer = pl.Trainer(
        max_epochs=2,
        limit_train_batches=10,
        logger=tb,
        log_every_n_steps=2,
        callbacks=[GradientFlowMonitor(), AnomalyAlarm(), GradientAccumulationScheduler({0: 1, 1: 3})],
        default_root_dir=tmp_path,
        **FAST,
    )
    trainer.fit(Attention())
    assert trainer.global_step == 10 + 4  # 10 steps, then batches 2, 5, 8 and the last one, 9
    acc = EventAccumulator(tb.log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    steps = {tag: {e.step for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    want = {s for s in range(14) if (s + 1) % 2 == 0}
    assert steps["user_loss"] == want
    assert steps["diag/grad_norm/total"] == want
    off = {tag: sorted(s - want) for tag, s in steps.items() if tag.startswith("diag/") and s - want}
    assert not off, off
