"""Run by test_checkpoint_reduction_ddp.py: 2 CPU processes (gloo); every lightning_diag callback of the trainer,
two of them ``AnomalyAlarm``s (two checkpoint entries with declared state reduced over the ranks).

Usage: ``ddp_reduce_script.py ROOT``. A checkpoint is written at steps 6 and 12 during the fit and once after it
(``trainer.save_checkpoint`` after ``teardown``); then a second trainer resumes from the step-6 checkpoint
(``fit(ckpt_path=...)``). Each rank writes ``reduce<rank>.json``: for each checkpoint, the collectives the library
ran while the callbacks saved, the entries it saved and the entries a frozen copy of the per-callback logic of
before the driver reduced them (issue 43) saves from the same local state.
"""

import copy
import json
import os
import sys
import time
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import DDPStrategy

from lightning_diag import AnomalyAlarm, AttentionEntropyMonitor, GradientFlowMonitor, SystemMonitor
from lightning_diag.callbacks.common.base import DiagCallback
from lightning_diag.stats.reduced import ReducedState, Reduction


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(4, 2, batch_first=True)
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x = batch[0]
        h, _ = self.attn(x, x, x, need_weights=False)
        return self.layer(h.mean(dim=1)).pow(2).mean()

    def train_dataloader(self):
        x = torch.randn(128, 5, 4, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class CountingDDP(DDPStrategy):
    """DDP that notes each ``reduce`` and ``all_gather`` while :attr:`counting` (our subclass: Lightning's class is
    left as it is)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.counting = False
        self.calls: list[list[str]] = []

    def reduce(self, tensor, group=None, reduce_op="mean"):
        if self.counting:
            self.calls.append(["reduce", str(reduce_op)])
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def all_gather(self, tensor, group=None, sync_grads=False):
        if self.counting:
            self.calls.append(["all_gather", str(tuple(tensor.shape))])
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)


# -- a frozen copy of the per-callback logic before the driver reduced the checkpoint (DiagCallback.
# save_checkpoint_state and reduction.reduce_state at 0d16f32) --------------------------------------------------
def legacy_reduce_state(trainer, state, device):
    dtype = torch.float64
    groups: dict[Reduction, list[str]] = {}
    for name in state:
        groups.setdefault(state.specs[name].reduction, []).append(name)
    out: dict[str, Any] = {}
    for reduction, group in groups.items():
        if reduction is Reduction.CAT:
            for name in group:
                local = torch.as_tensor([float(v) for v in state[name]], dtype=dtype, device=device)
                lengths = trainer.strategy.all_gather(torch.tensor([local.numel()], device=device)).reshape(-1).tolist()
                padded = torch.zeros(max(lengths), dtype=dtype, device=device)
                padded[: local.numel()] = local
                gathered = trainer.strategy.all_gather(padded).reshape(len(lengths), -1)
                out[name] = [float(v) for rank, n in enumerate(lengths) for v in gathered[rank, : int(n)].tolist()]
            continue
        local = torch.stack([torch.as_tensor(state[n], dtype=dtype, device=device).reshape(()) for n in group])
        out.update(zip(group, trainer.strategy.reduce(local, reduce_op=reduction.value).tolist(), strict=True))
    return out


def legacy_save(trainer, device, saved):
    for cb in trainer.callbacks:
        if not isinstance(cb, DiagCallback):
            continue
        state = saved.get(cb.state_key)
        if state is None:
            continue
        for name, (_build, key) in cb._rule_declarations.items():
            declared = getattr(cb, name)
            if isinstance(declared, ReducedState):
                state[key] = {**state[key], **legacy_reduce_state(trainer, declared, device)}
            elif hasattr(declared, "all_ranks_state_dict"):
                state[key] = declared.all_ranks_state_dict(trainer, device)


def dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=repr)


class Open(pl.Callback):
    """First in the list: counts from here, and keeps the ranks' local entries as Lightning filled them."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.local = copy.deepcopy(checkpoint["callbacks"])
        trainer.strategy.calls = []
        trainer.strategy.counting = True
        self.started = time.perf_counter()


class Close(pl.Callback):
    """After every lightning_diag callback: what they ran and saved, and what the per-callback logic saves."""

    def __init__(self, opened: Open) -> None:
        self.opened = opened
        self.records: list[dict[str, Any]] = []

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        saving = time.perf_counter() - self.opened.started  # every lightning_diag callback's save
        strategy = trainer.strategy
        strategy.counting = False
        calls = strategy.calls
        expected = copy.deepcopy(self.opened.local)
        strategy.calls = []
        strategy.counting = True
        started = time.perf_counter()
        legacy_save(trainer, pl_module.device, expected)
        legacy = time.perf_counter() - started
        strategy.counting = False
        alarms = [cb for cb in trainer.callbacks if isinstance(cb, AnomalyAlarm)]
        self.records.append({
            "step": trainer.global_step,
            "calls": calls,
            "legacy_calls": strategy.calls,
            "seconds": saving,
            "legacy_seconds": legacy,
            "pending": [bool(alarm.pending_losses) for alarm in alarms],
            "local": dumps(self.opened.local),
            "saved": dumps(checkpoint["callbacks"]),
            "expected": dumps(expected),
        })


class Resumed(pl.Callback):
    """The alarms' restored state at the resumed fit's start."""

    def __init__(self, alarm) -> None:
        self.alarm, self.restored = alarm, None

    def on_train_start(self, trainer, pl_module):
        self.restored = dumps(self.alarm.state_dict())


def trainer_for(root, callbacks, max_steps):
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=CountingDDP(),
        max_steps=max_steps,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        callbacks=callbacks,
    )


if __name__ == "__main__":
    root = sys.argv[1]
    torch.set_num_threads(1)
    opened = Open()
    closed = Close(opened)
    ours = [
        AnomalyAlarm(log_every_n_steps=5),
        AnomalyAlarm(swing_window=4, log_every_n_steps=4),
        GradientFlowMonitor(log_every_n_steps=2),
        AttentionEntropyMonitor(log_every_n_steps=2),
        SystemMonitor(log_every_n_steps=4),
    ]
    checkpoint = ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), every_n_train_steps=6, save_top_k=-1)
    trainer = trainer_for(root, [opened, *ours, closed, checkpoint], 12)
    trainer.fit(Model())
    trainer.save_checkpoint(os.path.join(root, "after.ckpt"))  # after teardown: no callback attached any more
    rank = trainer.global_rank
    alarm = AnomalyAlarm(log_every_n_steps=5)
    resumed = Resumed(alarm)
    again = trainer_for(root, [alarm, resumed], 16)
    again.checkpoint_callback.dirpath = os.path.join(root, "ckpt_resumed")
    again.fit(Model(), ckpt_path=os.path.join(root, "ckpt", "epoch=0-step=6.ckpt"))
    out = {"records": closed.records, "resumed_step": again.global_step, "restored": resumed.restored}
    with open(os.path.join(root, f"reduce{rank}.json"), "w") as fh:
        json.dump(out, fh)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank has written its results
    # End without the interpreter's teardown: gloo's threads can abort it after a fit that passed (as in
    # ddp_nan_script.py); nothing is left to run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
