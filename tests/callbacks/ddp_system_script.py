"""Run by test_system_monitor_ddp.py: 2 CPU processes (gloo); rank 1's dataset sleeps (a straggler).

Usage: ``ddp_system_script.py ROOT``. Each rank writes ``sys<rank>.json``; rank zero's scalars go to TensorBoard.
"""

import json
import os
import sys
import time

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger

from lightning_diag import SystemMonitor


class Data(torch.utils.data.Dataset):
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.rank == 1:
            time.sleep(0.01)
        return self.x[i]


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).pow(2).mean()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(Data(self.global_rank), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


if __name__ == "__main__":
    root = sys.argv[1]
    torch.set_num_threads(1)
    monitor = SystemMonitor(log_every_n_steps=4)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=16,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=TensorBoardLogger(root, name="tb", version=0),
        callbacks=[monitor],
    )
    trainer.fit(Model())
    out = {"alerts": [a.to_dict() for a in monitor.alerts], "state": monitor.state_dict()}
    with open(os.path.join(root, f"sys{trainer.global_rank}.json"), "w") as fh:
        json.dump(out, fh)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank has written its results
    # End without the interpreter's teardown: gloo's threads can abort it after a fit that passed ("terminate called
    # without an active exception", seen in CI); nothing is left to run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
