"""Issue 43: the step loss is a measurement the driver provides. On a batch of their logging cadence
``GradientFlowMonitor`` copies the loss to the host with its norms (for ``grad_collapse``) and ``AnomalyAlarm`` logs
it (``diag/loss/train_step``): when both read the same quantity (automatic optimization, no accumulation, no
scaler, one rank), the measurement's host copy is the one read and the alarm takes its value from the driver. Every
logged value stays bitwise what each callback logs alone; with accumulation they are different quantities and each
reads its own."""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch.overrides import TorchFunctionMode

from lightning_diag import AnomalyAlarm, GradientFlowMonitor
from lightning_diag.callbacks.common.driver import driver_of
from lightning_diag.callbacks.common.shared import Shared, SharedMeasurements
from tests.callbacks.nonfinite_models import Regression
from tests.output.logger_models import FAST, MemoryLogger

#: The tensor methods that read a value on the host.
HOST_READS = frozenset({"__float__", "item", "tolist", "numpy", "__bool__", "__int__", "__index__"})
EVERY = 5
STEPS = 20


class _HostReads(TorchFunctionMode):
    """Counts the host reads of tensors (every call of a :data:`HOST_READS` method) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in HOST_READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


class _PerBatch(pl.Callback):
    """The host reads from one batch's start to the next's, by the global step the batch started at (first in
    ``trainer.callbacks``: the whole batch, every callback's hooks included, lies between two of its starts)."""

    def __init__(self, reads: _HostReads) -> None:
        self.reads = reads
        self.by_step: dict[int, int] = {}
        self._start = 0
        self._step: int | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._step is not None:
            self.by_step[self._step] = self.reads.count - self._start
        self._start, self._step = self.reads.count, trainer.global_step


class _Offered(pl.Callback):
    """After ours in ``trainer.callbacks``: the loss the driver holds at each batch end, and the loss handed."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[float | None, float]] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        driver = driver_of(trainer)
        assert driver is not None
        self.seen[trainer.global_step] = (driver.step_loss(), float(outputs["loss"]))


def _fit(tmp_path: Any, name: str, callbacks: list[pl.Callback], **trainer: Any) -> tuple[dict[int, int], MemoryLogger]:
    torch.manual_seed(0)
    reads, logger = _HostReads(), MemoryLogger()
    per_batch = _PerBatch(reads)
    fit = pl.Trainer(
        default_root_dir=tmp_path / name,
        max_steps=STEPS,
        logger=logger,
        log_every_n_steps=EVERY,
        callbacks=[per_batch, *callbacks],
        **{**FAST, **trainer},
    )
    with reads:
        fit.fit(Regression())
    return per_batch.by_step, logger


def _series(logger: MemoryLogger, prefix: str) -> dict[tuple[int | None, str], float]:
    return {(step, k): v for step, metrics in logger.calls for k, v in metrics.items() if k.startswith(prefix)}


def test_a_cadence_batch_reads_the_step_loss_on_the_host_once(tmp_path):
    both, both_log = _fit(tmp_path, "both", [AnomalyAlarm(), GradientFlowMonitor()])
    alarm, alarm_log = _fit(tmp_path, "alarm", [AnomalyAlarm()])
    flow, flow_log = _fit(tmp_path, "flow", [GradientFlowMonitor()])
    none, _ = _fit(tmp_path, "none", [])
    cadence = [step for step in both if (step + 1) % EVERY == 0]
    assert cadence == [4, 9, 14]  # the batches the fit reached the next batch start after
    for step in cadence:  # one read fewer than the two callbacks alone: the alarm's float(loss)
        assert both[step] == alarm[step] + flow[step] - none[step] - 1, step
    for step in set(both) - set(cadence) - {0}:  # no read added on any other batch
        assert both[step] <= alarm[step] + flow[step] - none[step], step
    # the values logged are each callback's own, to the bit
    assert _series(both_log, "diag/loss/") == _series(alarm_log, "diag/loss/")
    assert len(_series(both_log, "diag/loss/train_step")) == STEPS // EVERY
    assert _series(both_log, "diag/grad/") == _series(flow_log, "diag/grad/")


@pytest.mark.parametrize("flow_first", [False, True])
def test_both_readers_get_the_value_the_batch_end_would_read(tmp_path, flow_first):
    offered = _Offered()
    ours: list[pl.Callback] = [AnomalyAlarm(), GradientFlowMonitor()]
    _fit(tmp_path, "both", [*(ours[::-1] if flow_first else ours), offered])
    for step, (held, handed) in offered.seen.items():
        if step % EVERY == 0:  # a cadence batch (global step after it): the measurement's copy, float(loss)'s value
            assert held is not None and held == handed, step
        else:
            assert held is None, step


def test_with_accumulation_the_two_losses_differ_and_each_reads_its_own(tmp_path):
    offered = _Offered()
    _, both_log = _fit(tmp_path, "both", [AnomalyAlarm(), GradientFlowMonitor(), offered], accumulate_grad_batches=2)
    _, alarm_log = _fit(tmp_path, "alarm", [AnomalyAlarm()], accumulate_grad_batches=2)
    assert offered.seen and all(held is None for held, _ in offered.seen.values())
    assert _series(both_log, "diag/loss/") == _series(alarm_log, "diag/loss/")


def test_a_loss_is_offered_only_when_requested_and_shared():
    shared = SharedMeasurements()
    shared.decide(frozenset({Shared.STEP_LOSS}))
    shared.offer_loss(3, 1.5)
    assert shared.step_loss(3) is None  # not one quantity for every reader (the driver decides at the fit's start)
    shared.loss_shared = True
    shared.offer_loss(3, 1.5)
    assert shared.step_loss(3) == 1.5
    assert shared.step_loss(4) is None  # another batch
    shared.decide(frozenset({Shared.GRADIENT_SQUARES}))
    shared.offer_loss(5, 2.5)
    assert shared.step_loss(5) is None  # not requested in that batch
    shared.offer_loss(6, 3.5)
    shared.clear()
    assert shared.step_loss(6) is None  # a new fit holds no loss


def test_a_step_loss_request_alone_measures_no_gradient_squares():
    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.ones(3)
    opt = torch.optim.SGD([w], lr=0.1)
    shared = SharedMeasurements()
    shared.decide(frozenset({Shared.STEP_LOSS}))  # the alarm's logging batch without GradientFlowMonitor's cadence
    assert shared.gradient_squares(opt, 1) is None
    shared.decide(frozenset({Shared.STEP_LOSS, Shared.GRADIENT_SQUARES}))
    assert shared.gradient_squares(opt, 1) is not None
