"""Small models for the probe tests: a ReLU regression MLP (trained in a second) and its data."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

FAST: dict[str, Any] = dict(
    accelerator="cpu",
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
    num_sanity_val_steps=0,
    logger=False,
)
IN, HIDDEN, OUT = 8, 32, 4


def dataset(n: int = 128, seed: int = 0) -> TensorDataset:
    teacher = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(0)) / IN**0.5
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n, IN, generator=g)
    y = torch.tanh(x @ teacher) + 0.05 * torch.randn(n, OUT, generator=g)
    return TensorDataset(x, y)


class ReluNet(pl.LightningModule):
    """Five ``Linear`` layers with ReLUs between them, regression; ``batchnorm`` adds a BatchNorm1d, ``dropout``
    a Dropout (state the probes must not touch)."""

    def __init__(self, lr: float = 0.05, batchnorm: bool = False, dropout: float = 0.0, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lr = lr
        layers: list[nn.Module] = [nn.Linear(IN, HIDDEN)]
        if batchnorm:
            layers.append(nn.BatchNorm1d(HIDDEN))
        layers += [nn.ReLU(), nn.Dropout(dropout)]
        for _ in range(3):
            layers += [nn.Linear(HIDDEN, HIDDEN), nn.ReLU()]
        layers.append(nn.Linear(HIDDEN, OUT))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(), batch_size=32, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(dataset(64, seed=1), batch_size=32)

    def linears(self) -> list[nn.Linear]:
        return [m for m in self.net if isinstance(m, nn.Linear)]


def pretrained(steps: int = 300, **kwargs: Any) -> ReluNet:
    """A ReluNet fitted with a plain loop (faster than a Trainer), in eval-ready state."""
    model = ReluNet(**kwargs)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = dataset().tensors
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model


def reparametrise(model: ReluNet, alpha: float = 100.0) -> ReluNet:
    """Dinh et al. (2017): first layer x alpha, second / alpha: the same function (ReLU is positively
    homogeneous), a far sharper minimum."""
    first, second = model.linears()[:2]
    with torch.no_grad():
        first.weight.mul_(alpha)
        first.bias.mul_(alpha)
        second.weight.div_(alpha)
    return model


def with_outlier(model: ReluNet, layer: int = 2, factor: float = 200.0) -> ReluNet:
    """One weight of a middle Linear set to ``factor`` x the layer's max: per-tensor INT8 loses that layer."""
    weight = model.linears()[layer].weight
    with torch.no_grad():
        weight[3, 5] = factor * weight.abs().max()
    return model
