"""Run by test_zero_output.py: 2 CPU processes (gloo) under DDP; with ``zero``, rank 1's hand-off module returns
zeros at step 19 only, a sampled step (4, 9, 14, 19, ... at log_every_n_steps=5): a copy that arrived as zeros on
one rank; every rank must judge it the same."""

import json
import os
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_diag import AnomalyAlarm


class Net(pl.LightningModule):
    def __init__(self, zero: bool):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.last = nn.Sequential(nn.Linear(4, 16), nn.Tanh()), nn.Linear(16, 1)
        self.zero = zero
        self.first.register_forward_hook(self._transfer)

    def _transfer(self, module, args, output):
        if self.zero and self.training and self.trainer.global_rank == 1 and self.global_step == 19:
            return output * 0.0  # keeps the graph: DDP expects a gradient for every parameter
        return output

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.last(self.first(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


if __name__ == "__main__":
    root, mode = Path(sys.argv[1]), sys.argv[2]
    pl.seed_everything(0)
    alarm = AnomalyAlarm(log_every_n_steps=5)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=30,
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )
    trainer.callbacks.append(alarm)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 4, generator=g)
    trainer.fit(Net(mode == "zero"), DataLoader(TensorDataset(x, x[:, :1] * 0.5), batch_size=8))
    out = {
        "alerts": [a.to_dict() for a in alarm.alerts if a.severity != "info"],
        "checks": alarm.zero_rule.checks,
    }
    (root / f"zero-{mode}{trainer.global_rank}.json").write_text(json.dumps(out))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
