"""Run by test_fit_reduction_ddp.py: 2 CPU processes (gloo), two ``AnomalyAlarm``s in warn mode (one by epoch, one
by step window) with validation, twice: the alarms as they are (the driver reduces what every alarm reduces at a
point of the fit together, ``Driver.reduce_at``) and as each reduced its own before (the same classes, their
``_reduced_at`` answering ``None``: every part then runs its own collective, the code of before). A NaN loss on
rank 1 at step 6 gives warn-mode alerts; each epoch (8 steps) ends between two of each alarm's logging steps (5
and 3 apart) but the last, so both alarms' findings are read back at the first two epochs' ends.

Usage: ``ddp_fit_reduce_script.py ROOT [windows]``. Each rank writes ``fit_reduce<rank>.json``: for each way, the
collectives the strategy ran during the fit (reduce and all_gather, with their op or shape), every diag/ value logged
and every alert.
"""

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `tests` is importable

from lightning_diag import AnomalyAlarm
from tests.output.logger_models import MemoryLogger


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.layer(x) - y).pow(2).mean()
        if self.global_step == 6 and self.global_rank == 1:
            loss = loss * float("nan")
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.layer(x) - y).pow(2).mean()
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_b", loss, sync_dist=True)  # a second monitored quantity (the two-window alarms)
        return loss

    def _data(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(64, 4, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)

    def train_dataloader(self):
        return self._data(0)

    def val_dataloader(self):
        return self._data(1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class CountingDDP(DDPStrategy):
    """DDP that notes each ``reduce`` and ``all_gather`` (our subclass: Lightning's class is left as it is)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls: list[list[str]] = []

    def reduce(self, tensor, group=None, reduce_op="mean"):
        self.calls.append(["reduce", str(reduce_op), str(tensor.dtype)])
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def all_gather(self, tensor, group=None, sync_grads=False):
        self.calls.append(["all_gather", str(tuple(tensor.shape))])
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)


class OwnReductions(AnomalyAlarm):
    """The alarm as before the driver reduced during the fit: each part runs its own collectives."""

    def _reduced_at(self, trainer, pl_module, point):
        return None


def fit(root: str, alarm_class: type[AnomalyAlarm], windows: bool) -> dict[str, Any]:
    """Two alarms: one on epochs and one on 3-step windows, or (``windows``) both on 3-step windows, closing at the
    same batch's end (the first closes before the second has the batch's loss)."""
    torch.manual_seed(0)
    alerts: list[list[Any]] = []
    first = {"swing_window": 3, "monitor": "val_b"} if windows else {}
    alarms = [
        alarm_class(
            on_nonfinite="warn", log_every_n_steps=5, **first,
            on_alert=lambda a: alerts.append(["epoch", a.to_dict()]),
        ),
        alarm_class(
            on_nonfinite="warn", swing_window=3, log_every_n_steps=3,
            on_alert=lambda a: alerts.append(["window", a.to_dict()]),
        ),
    ]
    strategy, logger = CountingDDP(), MemoryLogger()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=3, default_root_dir=root,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, logger=logger,
        num_sanity_val_steps=0, log_every_n_steps=4, callbacks=alarms,
    )
    trainer.fit(Model())
    values = [  # every diag/ value logged, in order (the floats' repr: compared to the bit)
        [step, key, repr(float(metrics[key]))]
        for step, metrics in logger.calls
        for key in sorted(metrics)
        if key.startswith("diag/") and not key.startswith("diag/overhead")
    ]
    return {"calls": strategy.calls, "values": values, "alerts": alerts, "rank": trainer.global_rank}


if __name__ == "__main__":
    root, windows = sys.argv[1], sys.argv[2:] == ["windows"]
    torch.set_num_threads(1)
    driven = fit(os.path.join(root, "driven"), AnomalyAlarm, windows)
    own = fit(os.path.join(root, "own"), OwnReductions, windows)
    with open(os.path.join(root, f"fit_reduce{driven['rank']}.json"), "w") as fh:
        json.dump({"driven": driven, "own": own}, fh, default=repr)
