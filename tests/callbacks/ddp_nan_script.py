"""Run by test_ddp.py: 2 CPU processes (gloo); the loss is NaN on rank 1 only, at global step 6."""

import json
import math
import os
import sys

import pytorch_lightning as pl
import torch

from lightning_diag import AnomalyAlarm, GradientFlowMonitor


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        if self.global_rank == 1 and self.global_step == 6:
            loss = loss * math.nan
        return loss

    def train_dataloader(self):
        x = torch.randn(128, 4, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


if __name__ == "__main__":
    root = sys.argv[1]
    strategy = sys.argv[2] if len(sys.argv) > 2 else "ddp"
    alarm = AnomalyAlarm()
    # a tiny explode threshold makes every layer alert, so the ranks' gradient decisions can be compared
    monitor = GradientFlowMonitor(log_every_n_steps=1, vanish_threshold=1e-9, explode_threshold=1e-2)
    model = Model()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=2,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        callbacks=[alarm, monitor],
    )
    trainer.fit(model)
    if strategy == "ddp":
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        out = {
            "rank": trainer.global_rank,
            "step": trainer.global_step,
            "finite": finite,
            "alerts": [a.to_dict() for a in alarm.alerts],
            "grad_alerts": [a.to_dict() for a in monitor.alerts],
            "grad_streaks": monitor.band_rule.streaks,
        }
        with open(os.path.join(root, f"rank{trainer.global_rank}.json"), "w") as fh:
            json.dump(out, fh)
