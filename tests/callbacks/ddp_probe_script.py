"""Run by test_probes_ddp.py: 2 CPU processes (gloo) fit a sharp model with an outlier weight and both probes."""

import json
import os
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_diag import QuantizationProbe, SharpnessProbe
from tests.callbacks.probe_models import FAST, pretrained, reparametrise, with_outlier

if __name__ == "__main__":
    root = Path(sys.argv[1])
    model = reparametrise(with_outlier(pretrained()))
    model.lr = 1e-6
    sharp, quant = SharpnessProbe(rules={"sharp_minimum": {"patience": 2}}), QuantizationProbe(backend="fake")
    trainer = pl.Trainer(
        **{**FAST, "accelerator": "cpu", "devices": 2, "strategy": "ddp"},
        max_epochs=2,
        default_root_dir=str(root),
        callbacks=[sharp, quant],
    )
    trainer.fit(model)
    out = {
        "sharp": [a.to_dict() for a in sharp.alerts],
        "quant": [a.to_dict() for a in quant.alerts],
        "sharp_state": sharp.state_dict(),
        "quant_state": quant.state_dict(),
        "measured": sharp.last_result is not None,
    }
    (root / f"rank{trainer.global_rank}.json").write_text(json.dumps(out))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank has written its results
    # End without the interpreter's teardown: gloo's threads can abort it after a fit that passed ("terminate called
    # without an active exception", seen in CI); nothing is left to run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
