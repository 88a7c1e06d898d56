"""Tiny models for the logger tests: an MLP regression (NaN loss on demand) and a two-optimizer manual GAN-like
model. Also a script: ``python logger_models.py wandb|mlflow ROOT [nan_at]`` runs one fit (cross-process tests)."""

from __future__ import annotations

import math
import sys
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import Logger
from torch import nn

FAST: dict[str, Any] = dict(
    accelerator="cpu",
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
    num_sanity_val_steps=0,
)


class Regression(pl.LightningModule):
    """Two linear layers, width 16, on 64 fixed samples (batch 4); the loss is NaN at global step ``nan_at``."""

    def __init__(self, nan_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.nan_at = nan_at
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 8, generator=g)
        self.y = self.x.sum(1, keepdim=True)

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        loss = (self.net(x) - y).pow(2).mean()
        if self.nan_at is not None and self.global_step == self.nan_at:
            loss = loss * math.nan
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("user_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x, self.y), batch_size=4)


class TwoOptimizers(Regression):
    """Manual optimization with two optimizers stepped every batch (a GAN's shape): ``global_step`` advances by
    two per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.critic = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
        opt_g, opt_d = self.optimizers()  # type: ignore[misc]
        loss_g = self.loss(batch)
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()
        loss_d = self.critic(batch[0]).pow(2).mean()
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        self.log("user_loss", loss_g)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.net.parameters(), lr=0.01), torch.optim.SGD(self.critic.parameters(), lr=0.01)


def make_logger(kind: str, root: str) -> Any:
    """An offline ``WandbLogger`` or an ``MLFlowLogger`` on a sqlite store under ``root`` (its artifact store
    beside it, in ``<root>_artifacts``: copies of the diag files are not runs of ``root``)."""
    if kind == "wandb":
        from pytorch_lightning.loggers import WandbLogger

        return WandbLogger(save_dir=root, offline=True, project="diagtest")
    from pytorch_lightning.loggers import MLFlowLogger

    return MLFlowLogger(
        tracking_uri=f"sqlite:///{root}/mlflow.db", save_dir=None, artifact_location=root.rstrip("/") + "_artifacts"
    )


def fit(kind: str, root: str, nan_at: int | None = None, **callback_kwargs: Any) -> tuple[pl.Trainer, Any, Any]:
    """One fit of :class:`Regression` with an AnomalyAlarm and the given logger; returns trainer, logger, alarm."""
    from lightning_diag import AnomalyAlarm

    logger = make_logger(kind, root)
    alarm = AnomalyAlarm(log_every_n_steps=1, **callback_kwargs)
    trainer = pl.Trainer(max_steps=6, logger=logger, default_root_dir=root, callbacks=[alarm], **FAST)
    trainer.fit(Regression(nan_at=nan_at))
    if kind == "wandb":
        logger.experiment.finish()
    return trainer, logger, alarm


if __name__ == "__main__":
    torch.set_num_threads(1)
    fit(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)


class MemoryLogger(Logger):
    """The user's own logger: keeps every ``log_metrics`` call in memory (its ``save_dir`` is ``None``, so the run's
    diagnostics go under ``default_root_dir``, as with a remote MLflow or W&B server)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((step, dict(metrics)))

    def user_metrics(self) -> list[tuple[int | None, dict[str, float]]]:
        """What the user logged (``self.log``), without the diagnostics' ``diag/`` series."""
        out = []
        for step, metrics in self.calls:
            mine = {k: v for k, v in metrics.items() if not k.startswith("diag/")}
            if mine:
                out.append((step, mine))
        return out
