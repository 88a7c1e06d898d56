"""Run by test_silent_ddp.py: 2 CPU processes (gloo); with ``perturb``, rank 1's weights are nudged after step 3;
with ``nosync``, a DDP communication hook returns each rank's own gradient without the all-reduce (what a model
never wrapped in DDP, or whose gradient hooks were lost by a conversion after wrapping, does): every rank trains its
own model from the first step."""

import json
import os
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_diag import AnomalyAlarm, GradientFlowMonitor


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.last = nn.Linear(4, 16), nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.last(torch.relu(self.first(x))), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Perturb(pl.Callback):
    """One rank's weights changed outside the optimizer: a rank-dependent bug."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.global_step == 3:
            with torch.no_grad():
                pl_module.last.weight.add_(1e-3)


def _no_allreduce(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class NoAllReduce(pl.Callback):
    """Registers the hook on the DDP wrapper (Lightning's own ``ddp_comm_hook`` argument applies on CUDA only)."""

    def on_train_start(self, trainer, pl_module):
        trainer.strategy.model.register_comm_hook(None, _no_allreduce)


if __name__ == "__main__":
    root, mode = Path(sys.argv[1]), sys.argv[2]
    pl.seed_everything(0)
    alarm = AnomalyAlarm(rules={"ddp_desync": {"every_n_steps": 2}})
    gfm = GradientFlowMonitor(log_every_n_steps=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=8,
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        callbacks=[
            alarm,
            gfm,
            *([Perturb()] if mode == "perturb" else []),
            *([NoAllReduce()] if mode == "nosync" else []),
        ],
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 4, generator=g)
    trainer.fit(Net(), DataLoader(TensorDataset(x, x[:, :1] * 0.5), batch_size=8))
    out = {
        "alerts": [a.to_dict() for a in alarm.alerts + gfm.alerts if a.severity != "info"],
        "checks": alarm.desync_rule.checks,
        "max_diff": alarm.desync_rule.last_max_diff,
    }
    (root / f"{mode}{trainer.global_rank}.json").write_text(json.dumps(out))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank has written its results
    # End without the interpreter's teardown: gloo's threads can abort it after a fit that passed ("terminate called
    # without an active exception", seen in CI); nothing is left to run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
