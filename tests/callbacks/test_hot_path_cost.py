"""The per-step bookkeeping the quiet path does not repeat: the checkpoint key built once per set of arguments, one
copy of the loss shared by the loss sums and the run-time checks, and what a quiet step dispatches (no host read
but the guard's one decision)."""

from __future__ import annotations

import collections

import pytorch_lightning as pl
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_diag import AnomalyAlarm
from lightning_diag.stats.loss_sums import LossSums
from tests.callbacks.nonfinite_models import Regression
from tests.callbacks.tiny import FAST


def test_the_state_key_is_built_once_and_follows_its_arguments():
    alarm = AnomalyAlarm()
    first = alarm.state_key
    assert alarm.state_key is first  # Lightning reads it at every hook call: the cached string
    alarm.monitor = "other_metric"
    assert alarm.state_key != first and "other_metric" in alarm.state_key


def test_the_loss_sums_copy_is_shared_and_never_written():
    sums = LossSums(baseline_steps=2)
    loss = torch.tensor(1.5)
    sums.add(loss)
    copy = sums.latest
    assert copy is not None and copy is not loss and float(copy) == 1.5
    loss.add_(1.0)  # the caller's tensor changes; the copy does not
    for value in range(70):  # past a fold: the held copies are stacked, not written
        sums.add(torch.tensor(float(value)))
    assert float(copy) == 1.5


class _Ops(TorchDispatchMode):
    """The aten operators dispatched inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def _quiet_ops(alarm: AnomalyAlarm, tmp_path, every: int = 10, steps: int = 40) -> tuple[collections.Counter, int]:
    """The operators the alarm's hooks dispatch on quiet steps (neither they nor their neighbours log), and how
    many quiet optimizer steps there were."""
    ops = _Ops()
    quiet_steps = set()
    for hook in ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step", "on_train_batch_end"):
        original = getattr(alarm, hook)

        def timed(trainer, *args, _original=original, _hook=hook, **kwargs):
            step = trainer.global_step - (_hook == "on_train_batch_end")  # the batch end comes after the step
            if step < 2 or step % every in (every - 1, 0, 1):
                return _original(trainer, *args, **kwargs)
            quiet_steps.add(step)
            with ops:
                return _original(trainer, *args, **kwargs)

        setattr(alarm, hook, timed)
    model = Regression()
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=steps, logger=False, callbacks=[alarm], **FAST)
    trainer.fit(model)
    return ops.names, len(quiet_steps)


def test_a_quiet_step_copies_the_loss_once_and_reads_one_number_back(tmp_path):
    """``on_nonfinite="stop"``: the loss's copy for the check, the fused check, and its one read (the decision
    before the update); the loss sums, the run-time checks and the counters add no operator and no host read."""
    names, steps = _quiet_ops(AnomalyAlarm(log_every_n_steps=10), tmp_path)
    assert steps > 20
    assert names == {
        "detach.default": steps,
        "clone.default": steps,
        "_amp_foreach_non_finite_check_and_unscale_.default": steps,
        "_local_scalar_dense.default": steps,
    }


def test_a_quiet_step_in_warn_mode_reads_nothing_back(tmp_path):
    names, steps = _quiet_ops(AnomalyAlarm(on_nonfinite="warn", log_every_n_steps=10), tmp_path)
    assert steps > 20 and "_local_scalar_dense.default" not in names and "item.default" not in names
