"""Run by test_silent_errors.py: 2 CPU processes (gloo), manual optimization with (``healthy``) or without
(``no_zero_grad``) ``zero_grad``; each rank writes its grad_not_zeroed alerts."""

import json
import os
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_diag import GradientFlowMonitor


class Net(pl.LightningModule):
    def __init__(self, zero):
        super().__init__()
        torch.manual_seed(0)
        self.zero = zero
        self.automatic_optimization = False
        self.first, self.last = nn.Linear(4, 16), nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        self.manual_backward(nn.functional.mse_loss(self.last(torch.relu(self.first(x))), y))
        opt.step()
        if self.zero:
            opt.zero_grad()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


if __name__ == "__main__":
    torch.set_num_threads(1)
    root, mode = Path(sys.argv[1]), sys.argv[2]
    gfm = GradientFlowMonitor(log_every_n_steps=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=6, default_root_dir=str(root),
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, logger=False,
        callbacks=[gfm],
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 4, generator=g)
    trainer.fit(Net(zero=mode == "healthy"), DataLoader(TensorDataset(x, x[:, :1] * 0.5), batch_size=8))
    out = {"alerts": [a.to_dict() for a in gfm.alerts if a.rule == "grad_not_zeroed"],
           "checks": gfm.not_zeroed_rule.checks}
    (root / f"{mode}{trainer.global_rank}.json").write_text(json.dumps(out))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank has written its results
    # End without the interpreter's teardown: gloo's threads can abort it after a fit that passed ("terminate called
    # without an active exception", seen in CI); nothing is left to run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
