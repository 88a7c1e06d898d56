"""Tiny models for the loss-noise scenario tests (``test_loss_noise.py``): an MLP classifier on Gaussian clusters,
with the learning-rate schedules people train with and the alternating 40x rate of the swing fault."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["ClusterMLP", "cluster_loader"]


def cluster_loader(
    samples: int, batch_size: int = 32, seed: int = 0, classes: int = 4, spread: float = 1.5
) -> DataLoader:
    """Samples of ``classes`` Gaussian clusters in 16 dimensions (overlapping: the loss never reaches 0)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, 16, generator=g)
    y = torch.randint(0, classes, (samples,), generator=g)
    x = centres[y] + spread * torch.randn(samples, 16, generator=g)
    order = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True, generator=order)


class ClusterMLP(pl.LightningModule):
    """A 2-layer MLP classifier (width 64) trained with Adam (or plain SGD).

    Args:
        lr: The sane learning rate.
        schedule: ``"constant"``, ``"alternate"`` (every other epoch ``factor`` times the rate: the fault),
            ``"cyclic"`` (triangular CyclicLR between ``lr / factor`` and ``lr``, by step, ``cycle_steps`` up),
            ``"restarts"`` (cosine annealing with warm restarts every ``cycle_steps`` steps), ``"onecycle"``.
        factor: The alternating or cyclic factor.
        cycle_steps: Steps of the cyclic half-cycle or of a restart period.
        total_steps: One-cycle's length.
        optimizer: ``"adam"`` or ``"sgd"``.
    """

    def __init__(
        self,
        lr: float = 1e-3,
        schedule: str = "constant",
        factor: float = 40.0,
        cycle_steps: int = 16,
        total_steps: int = 100,
        optimizer: str = "adam",
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        self.lr, self.schedule, self.factor = lr, schedule, factor
        self.cycle_steps, self.total_steps = cycle_steps, total_steps
        self.optimizer = optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self) -> Any:
        opt: torch.optim.Optimizer
        if self.optimizer == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        else:
            opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        sched: Any
        if self.schedule == "constant":
            return opt
        if self.schedule == "alternate":
            factor = self.factor
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: factor if epoch % 2 == 1 else 1.0)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}
        if self.schedule == "cyclic":
            sched = torch.optim.lr_scheduler.CyclicLR(
                opt, base_lr=self.lr / self.factor, max_lr=self.lr, step_size_up=self.cycle_steps, cycle_momentum=False
            )
        elif self.schedule == "restarts":
            sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=self.cycle_steps)
        elif self.schedule == "onecycle":
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.lr, total_steps=self.total_steps)
        else:
            raise ValueError(self.schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


