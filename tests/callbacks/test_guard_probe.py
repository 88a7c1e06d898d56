"""The guard's fast pass over large CPU gradients (per-tensor sums) may read finite values whose sum overflows as a
possible NaN/Inf: the exact check must clear it, so a healthy step with huge gradients is applied, never alerted."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn

from lightning_diag import AnomalyAlarm
from lightning_diag.callbacks.anomaly_alarm import nonfinite_guard
from lightning_diag.stats.norms import SUM_MIN_ELEMENTS
from tests.output.logger_models import FAST

SIDE = 400  # 160,000 elements: with the 0-d loss, the per-tensor sums path
assert SIDE * SIDE + 1 >= 2 * SUM_MIN_ELEMENTS


class HugeGradients(pl.LightningModule):
    """``loss = sum(W * C)`` with ``W`` starting at 0 and ``C = 3e35``: the loss is finite (0, then about 1e36) and
    every gradient element is 3e35, whose sum over the tensor (4.8e40) overflows float32."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(SIDE, SIDE))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return (self.w * 3e35).sum() * batch[0].mean().clamp(min=1.0)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-40)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(8, 1)), batch_size=1)


def test_huge_finite_gradients_are_applied_without_an_alert(tmp_path, monkeypatch):
    confirmed = []
    exact = nonfinite_guard.nonfinite_flag
    monkeypatch.setattr(nonfinite_guard, "nonfinite_flag", lambda *a, **k: confirmed.append(1) or exact(*a, **k))
    alarm = AnomalyAlarm()
    model = HugeGradients()
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=5, logger=False, callbacks=[alarm], **FAST)
    trainer.fit(model)
    assert trainer.global_step == 5 and not trainer.should_stop
    assert [a.rule for a in alarm.alerts if a.severity.value in ("warning", "critical")] == []
    assert torch.isfinite(model.w).all() and bool((model.w != 0).all())  # every update applied
    assert len(confirmed) >= 5  # each step's pass read a possible NaN/Inf, and the exact check cleared it
