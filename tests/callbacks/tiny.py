"""A tiny attention model and helpers shared by the setup tests (real ``Trainer.fit`` runs in seconds)."""

from __future__ import annotations

import math
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn

from lightning_diag import AnomalyAlarm, AttentionEntropyMonitor, GradientFlowMonitor

FAST: dict[str, Any] = dict(
    accelerator="cpu",
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
    num_sanity_val_steps=0,
)
SEQ, VOCAB, WIDTH = 6, 16, 8


def every_callback(**overrides: dict[str, Any]) -> list[Any]:
    """One of each library callback, measuring every step. Extend here when a callback is added."""
    kinds = (GradientFlowMonitor, AttentionEntropyMonitor, AnomalyAlarm)
    return [kind(**{"log_every_n_steps": 1, **overrides.get(kind.__name__, {})}) for kind in kinds]


def by_type(callbacks: list[Any], kind: type) -> Any:
    return next(cb for cb in callbacks if isinstance(cb, kind))


def serious(callbacks: list[Any]) -> list[str]:
    return [a.format() for cb in callbacks for a in cb.alerts if a.severity != "info"]


class TinyAttention(pl.LightningModule):
    """Embedding -> MultiheadAttention -> mean pool -> linear regression on token ids.

    Args:
        nan_at_step: Multiply the loss by NaN at this global step.
        returns: What ``training_step`` returns: ``"loss"``, ``"dict"``, ``"none"`` (every third batch) or
            ``"vector"`` (the per-sample losses; manual optimization, since Lightning's backward needs a scalar).
        samples: Dataset size (batch size 4).
        repeat: Every batch holds the same 4 samples, so a run resumed mid-epoch (whose plain dataloader starts
            over) sees exactly the batches of an uninterrupted run.
    """

    def __init__(
        self, nan_at_step: int | None = None, returns: str = "loss", samples: int = 32, repeat: bool = False
    ) -> None:
        super().__init__()
        self.nan_at_step = nan_at_step
        self.returns = returns
        self.samples = samples
        self.automatic_optimization = returns != "vector"
        g = torch.Generator().manual_seed(0)
        torch.manual_seed(0)  # the same initial weights in every instance: runs can be compared
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.head = nn.Linear(WIDTH, 1)
        self.ids = torch.randint(0, VOCAB, (4 if repeat else samples, SEQ), generator=g)
        if repeat:
            self.ids = self.ids.repeat(samples // 4, 1)
        self.y = self.ids.float().mean(dim=1, keepdim=True) / VOCAB

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h, _ = self.attn(h, h, h, need_weights=False)
        return self.head(h.mean(dim=1))

    def per_sample_loss(self, batch: Any) -> torch.Tensor:
        ids, y = batch
        loss = (self(ids) - y).pow(2).squeeze(1)
        if self.nan_at_step is not None and self.global_step == self.nan_at_step:
            loss = loss * math.nan
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.returns == "vector":
            losses = self.per_sample_loss(batch)
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(losses.mean())
            opt.step()
            return losses
        loss = self.per_sample_loss(batch).mean()
        if self.returns == "dict":
            return {"loss": loss, "size": len(batch[0])}
        if self.returns == "none" and batch_idx % 3 == 2:
            return None
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.per_sample_loss(batch).mean())

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self.per_sample_loss(batch).mean())

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def _loader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.ids, self.y), batch_size=4)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader()

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader()

    def test_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader()

    def predict_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)
