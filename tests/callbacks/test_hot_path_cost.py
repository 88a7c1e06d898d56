"""The per-step bookkeeping the quiet path does not repeat: the checkpoint key built once per set of arguments, one
copy of the loss shared by the loss sums and the run-time checks, and what a quiet step dispatches (no host read
but the guard's one decision)."""

from __future__ import annotations

import collections

import pytest
import pytorch_lightning as pl
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_diag import AnomalyAlarm, NonFiniteError
from lightning_diag.callbacks.anomaly_alarm import guard_pass
from lightning_diag.stats.loss_sums import LossSums
from tests.callbacks.nonfinite_models import Regression
from tests.callbacks.op_names import OpNames
from tests.callbacks.tiny import FAST


def test_the_state_key_follows_its_arguments():
    # (how it is kept cheap for Lightning's reads at every hook call is the base class's business: during a fit a
    # plain attribute on main, a cached string before)
    alarm = AnomalyAlarm()
    first = alarm.state_key
    assert alarm.state_key == first
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


def test_a_quiet_step_runs_the_check_and_reads_one_number_back(tmp_path, monkeypatch):
    """``on_nonfinite="stop"``: the fused check of the gradients and the loss, and its one read (the decision
    before the update); the loss is not copied (automatic optimization: Lightning's own loss, by reference), and the
    loss sums, the run-time checks and the counters add no operator and no host read.

    The ``detach`` is the loss's ``.data``: a shallow copy of the tensor object that reaches the dispatcher only
    while a dispatch mode (this count) is active, no kernel. On the CPU the flag is read from its memory (a Python
    buffer over it), not by a dispatched ``item()``: each quiet step reads it once, and a flag set there stops the
    update (the NaN tests)."""
    reads = []
    original = guard_pass.OptimizerPass.clean

    def counted(self, losses):
        reads.append(self._view is not None)
        return original(self, losses)

    monkeypatch.setattr(guard_pass.OptimizerPass, "clean", counted)
    names, steps = _quiet_ops(AnomalyAlarm(log_every_n_steps=10), tmp_path)
    assert steps > 20
    assert names == {"detach.default": steps, "_amp_foreach_non_finite_check_and_unscale_.default": steps}
    assert len(reads) >= steps and all(reads)  # every step's pass, each read from the CPU flag's memory


def test_a_quiet_step_in_warn_mode_reads_nothing_back(tmp_path):
    names, steps = _quiet_ops(AnomalyAlarm(on_nonfinite="warn", log_every_n_steps=10), tmp_path)
    assert steps > 20 and "_local_scalar_dense.default" not in names and "item.default" not in names


class _Losses(pl.Callback):
    """Placed before the alarm: every loss handed to ``on_before_backward``, its value and version then."""

    def __init__(self) -> None:
        self.seen: list[tuple[torch.Tensor, float, int]] = []

    def on_before_backward(self, trainer, pl_module, loss):
        self.seen.append((loss, float(loss.detach()), loss._version))


class _EarlyNanLoss(Regression):
    """A NaN in the loss of the first micro-batch of global step 5 only, through a path without gradient: its
    gradients stay finite, so only the check of that micro-batch's own loss can find it."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step == 5 and batch_idx % self.trainer.accumulate_grad_batches == 0:
            loss = loss + torch.tensor(float("nan"))
        return loss


def _fit_weights(tmp_path, callbacks, model=None, **kwargs):
    model = model or Regression()
    trainer = pl.Trainer(default_root_dir=tmp_path, logger=False, callbacks=callbacks, **{**FAST, **kwargs})
    trainer.fit(model)
    return model, trainer


def test_the_loss_kept_by_reference_is_left_as_it_was(tmp_path):
    """Under automatic optimization the check reads Lightning's own loss in place: after the steps, every loss
    handed to the hooks has its value and its version (no in-place write seen by autograd); the weights are
    bitwise those of a run without the alarm, with accumulation."""
    losses, alarm = _Losses(), AnomalyAlarm()
    model, _ = _fit_weights(tmp_path / "alarm", [losses, alarm], max_steps=12, accumulate_grad_batches=3)
    assert alarm.guard.keep_references and len(losses.seen) > 30
    assert all(float(loss.detach()) == value and loss._version == version for loss, value, version in losses.seen)
    bare, _ = _fit_weights(tmp_path / "bare", [], max_steps=12, accumulate_grad_batches=3)
    for a, b in zip(model.parameters(), bare.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("action", ["stop", "raise", "skip", "rollback", "warn"])
def test_a_nan_loss_of_an_early_micro_batch_is_caught_at_its_step(tmp_path, action):
    """Accumulation of 3: the first micro-batch's loss is NaN, the next two and every gradient are finite; its
    reference must still be read at the step (found at that step, or read back later with that step in warn)."""
    alarm = AnomalyAlarm(on_nonfinite=action)
    model = _EarlyNanLoss()
    try:
        _fit_weights(tmp_path, [alarm], model=model, max_steps=10, accumulate_grad_batches=3)
    except NonFiniteError:
        assert action == "raise"
    # rollback: the step is undone with a warning that names the loss
    rule = "nonfinite_rollback" if action == "rollback" else "nonfinite_loss"
    found = [a for a in alarm.alerts if a.rule == rule]
    assert [(a.rule, a.global_step) for a in found[:1]] == [(rule, 5)]
    assert "loss" in found[0].message
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_manual_optimization_copies_the_users_loss(tmp_path):
    """The user's own loss (``manual_backward``) is copied for the check, never read in place."""

    class Manual(Regression):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            loss = super().training_step(batch, batch_idx)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            return loss

    losses, alarm = _Losses(), AnomalyAlarm()
    _fit_weights(tmp_path, [losses, alarm], model=Manual(), max_steps=6)
    assert len(losses.seen) == 6
    assert not alarm.guard.keep_references
    assert all(float(loss.detach()) == value and loss._version == version for loss, value, version in losses.seen)


def test_the_replay_keeps_exactly_the_micro_batches_of_the_step_being_checked(tmp_path):
    """With accumulation, at every optimizer step (the first group included) the micro-batches a replay would use
    are exactly that step's: the quiet path lets them go after its check as the full one does."""
    alarm = AnomalyAlarm()
    kept: list[list[int]] = []

    class Inspect(pl.Callback):  # placed before the alarm: what a failing step would replay
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            kept.append([idx for _, idx, _ in alarm.recovery._batches])

    _fit_weights(tmp_path, [Inspect(), alarm], max_steps=7, accumulate_grad_batches=3)
    assert kept == [[3 * k, 3 * k + 1, 3 * k + 2] for k in range(7)]


@pytest.mark.parametrize("case", ["finite", "nan", "inf", "sum_overflows", "large_sums", "loss_nan"])
def test_the_large_gradients_pass_decides_as_the_probe(case):
    """Gradients large enough to be summed: the pass decides on the host from the sums when they prove every value
    finite, and otherwise as ``finite_probe`` does (NaN/Inf, or a float32 total that overflows: the full check then
    decides); a clean step dispatches the sums only, and leaves the flag at 0."""
    from lightning_diag.stats.norms import SUM_MIN_ELEMENTS, finite_probe

    n = 2 * SUM_MIN_ELEMENTS  # the step's loss counts as one more tensor
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n)) for _ in range(2)]
    for p in params:
        p.grad = torch.randn(n)
    losses = [torch.tensor(0.5)]
    if case == "nan":
        params[1].grad[7] = float("nan")
    elif case == "inf":
        params[0].grad[3] = float("-inf")
    elif case == "sum_overflows":  # each sum finite (3e38), their float32 total not
        for p in params:
            p.grad.fill_(3e38 / n)
    elif case == "large_sums":  # a total of 1.8e38, finite, past the host's margin: the probe decides
        for p in params:
            p.grad.fill_(9e37 / n)
    elif case == "loss_nan":
        losses = [torch.tensor(float("nan"))]
    expected = finite_probe([p.grad for p in params] + losses).item() == 0
    assert expected == (case in ("finite", "large_sums"))
    guard = guard_pass.OptimizerPass([{"params": params}])
    assert guard.sums
    with OpNames() as ops:
        clean = guard.clean(losses)
    assert clean == expected
    if case == "finite":
        assert ops.names == {"sum.default": 3}, ops.names
        assert guard.found.item() == 0.0
    else:  # the probe ran on the flag, as before
        assert "mul_.Tensor" in ops.names
