"""Run by test_ddp.py: 2 CPU processes (gloo); the loss is NaN on rank 1 only, at global step 6.

Usage: ``ddp_nan_script.py ROOT [ddp|ddp_spawn|warn]``.
"""

import atexit
import json
import math
import os
import sys

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_diag import AnomalyAlarm, AttentionEntropyMonitor, GradientFlowMonitor


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(4, 2, batch_first=True)
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x = batch[0]
        h, _ = self.attn(x, x, x, need_weights=False)
        loss = self.layer(h.mean(dim=1)).pow(2).mean()
        if self.global_rank == 1 and self.global_step == 6:
            loss = loss * math.nan
        return loss

    def train_dataloader(self):
        x = torch.randn(128, 5, 4, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class RecordAccumulators(pl.Callback):
    """Each rank's own partial loss sums at the end of the step a checkpoint is written (before it is)."""

    def __init__(self, alarm, at_step):
        self.alarm, self.at_step, self.local = alarm, at_step, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at_step:
            self.local = self.alarm.state_dict()["accumulators"]


def _destroy_process_group():
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class DestroyProcessGroupAtExit(pl.Callback):
    """Spawned workers end through the interpreter's teardown, where gloo's threads can abort a process whose fit
    passed ("terminate called without an active exception", seen in CI under ``ddp_spawn``): each worker destroys
    its process group at exit, while the interpreter is whole (Lightning does the same for NCCL only)."""

    def setup(self, trainer, pl_module, stage):
        atexit.register(_destroy_process_group)


def run_warn(root):
    """on_nonfinite="warn": the NaN (rank 1, step 6) is read back late; a checkpoint is written at step 8."""
    alarm = AnomalyAlarm(on_nonfinite="warn", log_every_n_steps=5)
    record = RecordAccumulators(alarm, 8)
    checkpoint = ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), every_n_train_steps=8, save_top_k=-1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=8,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        callbacks=[alarm, record, checkpoint],
    )
    trainer.fit(Model())
    out = {"alerts": [a.to_dict() for a in alarm.alerts], "local": record.local}
    with open(os.path.join(root, f"warn{trainer.global_rank}.json"), "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    root = sys.argv[1]
    strategy = sys.argv[2] if len(sys.argv) > 2 else "ddp"
    if strategy == "warn":
        run_warn(root)
        sys.exit(0)
    alarm = AnomalyAlarm()
    # a tiny explode threshold makes every layer alert, so the ranks' gradient decisions can be compared
    monitor = GradientFlowMonitor(
        log_every_n_steps=1, rules={"grad_vanish": {"threshold": 1e-9}, "grad_explode": {"threshold": 1e-2}}
    )
    # a ceiling far below uniform makes every head alert, so the ranks' attention decisions can be compared
    attention = AttentionEntropyMonitor(
        log_every_n_steps=1,
        rules={
            "attn_entropy_low": {"threshold": 0.05},
            "attn_entropy_high": {"threshold": 0.1, "uniform_fraction": 0.5, "warmup_steps": 0},
            "attn": {"patience": 1},
        },
    )
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
        callbacks=[alarm, monitor, attention, DestroyProcessGroupAtExit()],
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
            "attn_alerts": [a.to_dict() for a in attention.alerts],
            "attn_state": attention.state_dict(),
        }
        with open(os.path.join(root, f"rank{trainer.global_rank}.json"), "w") as fh:
            json.dump(out, fh)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank has written its results
    # End without the interpreter's teardown: gloo's threads can abort it after a fit that passed ("terminate called
    # without an active exception", seen in CI); nothing is left to run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
