"""``GradientFlowMonitor`` keeps the loss as the step returned it, not as a gradient scaler scaled it for backward."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.precision import MixedPrecision

from lightning_diag import GradientFlowMonitor
from lightning_diag.callbacks.common.outputs import loss_scale


class _Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _Losses(pl.Callback):
    """The loss each batch returned, by global step before the update, and the scale its backward used."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}
        self.scales: dict[int, float | None] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: object) -> None:
        self.scales[trainer.global_step] = loss_scale(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.losses[trainer.global_step - 1] = float(outputs["loss"])


def _fit(tmp_path, plugins: list) -> tuple[_Losses, list[float]]:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    gfm, seen = GradientFlowMonitor(log_every_n_steps=4), _Losses()
    kept: list[float] = []
    feed = gfm.feed

    def spy(ctx, measures):  # type: ignore[no-untyped-def]
        if measures.loss is not None:
            kept.append(float(measures.loss))
        return feed(ctx, measures)

    gfm.feed = spy  # type: ignore[method-assign]  # our own object: records what grad_collapse is fed
    trainer = pl.Trainer(
        max_steps=8, log_every_n_steps=4, plugins=plugins, callbacks=[gfm, seen], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(_Regression(), torch.utils.data.DataLoader(data, batch_size=8))
    return seen, kept


def test_no_scaler_has_no_scale(tmp_path) -> None:  # type: ignore[no-untyped-def]
    seen, _ = _fit(tmp_path, [])
    assert set(seen.scales.values()) == {None}


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_grad_collapse_is_fed_the_unscaled_loss_under_a_gradient_scaler(tmp_path) -> None:  # type: ignore[no-untyped-def]
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    seen, kept = _fit(tmp_path, [plugin])
    scales = [s for s in seen.scales.values() if s is not None]
    assert scales and min(scales) > 1.0  # the backward's loss really was scaled
    # measured at step 0 (grad_collapse's baseline) and at the cadence steps 3 and 7: the losses the steps returned
    expected = [seen.losses[s] for s in (0, 3, 7)]
    assert list(dict.fromkeys(kept)) == expected  # each of a step's feeds carries the step's loss
