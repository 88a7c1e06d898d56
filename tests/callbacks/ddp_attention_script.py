"""Run by test_attention_ddp.py: 2 CPU processes (gloo) train the `attention` fault; each rank dumps its decisions."""

import json
import os
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch

from lightning_diag import AttentionEntropyMonitor
from lightning_diag.demo import build_fault

if __name__ == "__main__":
    root = Path(sys.argv[1])
    pl.seed_everything(0)
    model, data, _ = build_fault("attention")
    monitor = AttentionEntropyMonitor(image_every_n_steps=5)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=40,  # the collapse from step 30 is measured at 34 and 39 (the user's cadence, 5): alert at 39
        log_every_n_steps=5,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[monitor],
    )
    trainer.fit(model, datamodule=data)
    out = {
        "alerts": [a.to_dict() for a in monitor.alerts],
        "streaks": monitor.entropy_rule.streaks,
        "log_dir": trainer.log_dir,
    }
    (root / f"rank{trainer.global_rank}.json").write_text(json.dumps(out))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank has written its results
    # End without the interpreter's teardown: gloo's threads can abort it after a fit that passed ("terminate called
    # without an active exception", seen in CI); nothing is left to run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
