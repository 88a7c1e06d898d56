"""Run by test_nonfinite_recovery.py: 2 CPU processes (gloo), ``on_nonfinite="rollback"``.

Rank 1's module ``net.1`` outputs NaN at global step 7 (rank 0 stays finite): both ranks must localise it the
same way (rank 1 replays, the finding is broadcast), roll back together to the same snapshot and end with the
same weights. Usage: ``ddp_rollback_script.py ROOT``.
"""

import json
import os
import sys

import pytorch_lightning as pl
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_diag import AnomalyAlarm
from tests.callbacks.nonfinite_models import Regression


class RankFault(Regression):
    def training_step(self, batch, batch_idx):
        self.fault_steps = (7,) if self.global_rank == 1 else ()
        return super().training_step(batch, batch_idx)


if __name__ == "__main__":
    root = sys.argv[1]
    alarm = AnomalyAlarm(on_nonfinite="rollback", rules={"nonfinite_rollback": {"every_n_steps": 3}})
    model = RankFault(fault="forward")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=12,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        callbacks=[alarm],
    )
    trainer.fit(model)
    out = {
        "step": trainer.global_step,
        "alerts": [a.to_dict() for a in alarm.alerts],
        "rollbacks": alarm.rollbacks,
        "lr_scale": alarm.lr_scale,
        "params": [p.detach().flatten().tolist() for p in model.parameters()],
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
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
