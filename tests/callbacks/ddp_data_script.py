"""Run by test_data_ddp.py: 2 CPU processes (gloo); each rank samples its shard and dumps its decisions."""

import json
import os
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_diag import DataDiagnostics
from tests.callbacks.test_data_diagnostics import TokenModel, labels, tokens

if __name__ == "__main__":
    root = Path(sys.argv[1])
    pl.seed_everything(0)
    xt, yt = tokens(400, 1), labels(400, 1)
    xv, yv = tokens(100, 2), labels(100, 2)
    # validation sample i (read by rank i % 2) copies training sample i + 1 (read by the other rank)
    xv[:40] = xt[1:41]
    features, val_features = torch.randn(400, 3), torch.randn(100, 3)
    features[7, 0] = float("nan")  # only rank 1 reads index 7
    val_features[:40] = features[1:41]  # whole samples are copied (the leakage search compares them whole)
    cb = DataDiagnostics(max_batches=None)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_find_unused_parameters_true",
        max_steps=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        callbacks=[cb],
    )

    class WithFeatures(TensorDataset):
        def __init__(self, x, y, extra):
            super().__init__(x, y)
            self.extra = extra

        def __getitem__(self, i):
            x, y = super().__getitem__(i)
            return {"input_ids": x, "labels": y, "extra": self.extra[i]}

    class Model(TokenModel):
        def _loss(self, batch):
            return super()._loss({"input_ids": batch["input_ids"], "labels": batch["labels"]})

    train = DataLoader(WithFeatures(xt, yt, features), batch_size=16, shuffle=True)
    val = DataLoader(WithFeatures(xv, yv, val_features), batch_size=16)
    trainer.fit(Model(), train, val)
    out = {"alerts": [a.to_dict() for a in cb.alerts], "last": cb.last, "latch": sorted(cb.data_rules.latch.active)}
    (root / f"rank{trainer.global_rank}.json").write_text(json.dumps(out))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank has written its results
    # End without the interpreter's teardown: gloo's threads can abort it after a fit that passed ("terminate called
    # without an active exception", seen in CI); nothing is left to run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
