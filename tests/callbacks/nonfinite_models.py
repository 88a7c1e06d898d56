"""Models for the localisation and rollback tests (and the DDP script): a 3-layer linear regression with faults.

The linear stack (no activation, no clipping) is the point: a few steps of huge inputs drive its weights into a
region where SGD diverges, so the loss stays finite but explodes and turns non-finite a step or two later, and
a too-high learning rate makes it diverge slowly (NaN ~20 steps later), like the loss spikes of large models.
"""

from __future__ import annotations

import math
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn

BATCH, BATCHES = 16, 32


class _NanGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * math.nan


class Faulty(nn.Module):
    """A linear layer that, when armed, makes its output NaN (``"forward"``) or its input gradient NaN."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.armed: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed == "backward":
            x = _NanGrad.apply(x)
        y = self.inner(x)
        return y * math.nan if self.armed == "forward" else y


class Regression(pl.LightningModule):
    """``y = X w`` learned by ``Linear(4, 16) -> [BatchNorm, Dropout] -> Faulty(16) -> Linear(16, 1)`` with SGD.

    Args:
        lr: SGD learning rate.
        burst: Global steps whose inputs are multiplied by 1e4 (finite, huge).
        spike: ``(step, factor)``: from that global step on, a LambdaLR multiplies the learning rate by factor.
        fault: ``"input"`` (a NaN in the batch), ``"forward"`` / ``"backward"`` (in ``net.1``, ``net.3`` when
            noisy), ``"loss"`` (log(0)).
        fault_steps: Global steps the fault fires at (``"input"``: the batch indices holding the NaN).
        noisy: Add BatchNorm and dropout (training state the replay must not change).
    """

    def __init__(
        self,
        lr: float = 0.02,
        burst: tuple[int, ...] = (),
        spike: tuple[int, float] | None = None,
        fault: str | None = None,
        fault_steps: tuple[int, ...] = (),
        noisy: bool = False,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lr, self.burst, self.spike = lr, burst, spike
        self.fault, self.fault_steps = fault, fault_steps
        extra: list[nn.Module] = [nn.BatchNorm1d(16), nn.Dropout(0.2)] if noisy else []
        self.net = nn.Sequential(nn.Linear(4, 16), *extra, Faulty(16), nn.Linear(16, 1))
        self.faulty = self.net[-2]
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(BATCH * BATCHES, 4, generator=g)
        self.y = self.x @ torch.randn(4, 1, generator=g)
        if fault == "input":
            for index in fault_steps:
                self.x[index * BATCH, 2] = math.nan
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        step = self.global_step
        if step in self.burst:
            x = x * 1e4
        armed = self.fault in ("forward", "backward") and step in self.fault_steps
        self.faulty.armed = self.fault if armed else None
        loss = (self(x) - y).pow(2).mean()
        if self.fault == "loss" and step in self.fault_steps:
            loss = loss + torch.log(torch.zeros((), device=loss.device))
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x, self.y), batch_size=BATCH)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        if self.spike is None:
            return opt
        at, factor = self.spike
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: factor if s >= at else 1.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def clean_loss(self) -> float:
        """Mean squared error over the whole data set (eval mode, no fault)."""
        with torch.no_grad():
            was = self.training
            self.eval()
            self.faulty.armed = None
            x = torch.nan_to_num(self.x)
            value = float((self(x.to(self.device)) - self.y.to(self.device)).pow(2).mean())
            self.train(was)
        return value
