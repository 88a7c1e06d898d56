"""Quiet batches switch a callback's batch hooks off (issue 37 §4): Lightning skips a hook that is not callable.

``GradientFlowMonitor`` and ``AttentionEntropyMonitor`` declare ``batch_hooks``: on a batch with nothing to measure
the trainer's driver skips them until the next batch that needs them. Real fits check that the hooks really are
skipped, that what is written and alerted is exactly what the same callbacks write with the hooks always on, that
``SystemMonitor``'s timers around those hooks survive the switching, and that nothing is left on the instance.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import Logger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_diag import AttentionEntropyMonitor, GradientFlowMonitor, SystemMonitor
from lightning_diag.callbacks.common.base import DiagCallback
from lightning_diag.callbacks.common.driver import driver_of
from tests.callbacks.test_step_axis import Attention
from tests.output.logger_models import FAST, MemoryLogger, TwoOptimizers

BATCHES = 40
EVERY = 5


def _counting(base: type) -> type:
    """``base`` with its batch hooks counting the batches they ran in (by the trainer's batch count)."""

    class Counting(base):  # type: ignore[valid-type, misc]
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.ran: dict[str, set[int]] = {hook: set() for hook in base.batch_hooks}

        def _count(self, hook: str, trainer: pl.Trainer) -> None:
            self.ran[hook].add(trainer.fit_loop.epoch_loop.batch_progress.total.ready - 1)

    for hook in base.batch_hooks:

        def counted(self: Any, trainer: pl.Trainer, *args: Any, _hook: str = hook, **kwargs: Any) -> Any:
            self._count(_hook, trainer)
            return getattr(base, _hook)(self, trainer, *args, **kwargs)

        setattr(Counting, hook, counted)
    Counting.__name__ = Counting.__qualname__ = base.__name__  # its own checkpoint key
    return Counting


def _fit(tmp_path: Path, model: pl.LightningModule, callbacks: list[pl.Callback], *loggers: Logger) -> MemoryLogger:
    torch.manual_seed(0)
    memory = MemoryLogger()
    pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=BATCHES * (2 if not model.automatic_optimization else 1),
        limit_train_batches=BATCHES,
        log_every_n_steps=EVERY,
        logger=[memory, *loggers],
        callbacks=callbacks,
        **FAST,
    ).fit(model)
    return memory


def _diag(memory: MemoryLogger) -> list[tuple[int, dict[str, float]]]:
    return [(int(step or 0), {k: v for k, v in row.items() if k.startswith("diag/")}) for step, row in memory.calls]


def _fits(tmp_path: Path, model_type: type) -> tuple[Any, Any, MemoryLogger, MemoryLogger]:
    switched = [_counting(GradientFlowMonitor)(), _counting(AttentionEntropyMonitor)()]
    always = [_counting(GradientFlowMonitor)(), _counting(AttentionEntropyMonitor)()]
    for cb in always:
        cb.batch_hooks = ()  # the same callback, its hooks called on every batch
    on = _fit(tmp_path / "switched", model_type(), switched)
    off = _fit(tmp_path / "always", model_type(), always)
    return switched, always, on, off


def test_quiet_batches_skip_the_batch_hooks_and_measure_the_same(tmp_path: Path) -> None:
    (gfm, attn), (gfm_always, attn_always), switched, always = _fits(tmp_path, Attention)
    assert all(ran == set(range(BATCHES)) for ran in gfm_always.ran.values()), gfm_always.ran
    assert all(ran == set(range(BATCHES)) for ran in attn_always.ran.values())
    cadence = {b for b in range(BATCHES) if (b + 1) % EVERY == 0}  # batches 4, 9, ..., 39
    for ran in gfm.ran.values():
        # every measured batch, the fit's first steps and the batch after each measurement (grad_not_zeroed's
        # watch): far fewer than all
        assert cadence <= ran
        assert len(ran) <= 2 * len(cadence) + 2, sorted(ran)
    assert attn.ran["on_before_backward"] == attn.ran["on_train_batch_end"] == cadence
    # what is written and alerted does not depend on the switching
    assert _diag(switched) == _diag(always)
    assert any("diag/grad" in k for _, row in _diag(switched) for k in row)
    assert any("diag/attn" in k for _, row in _diag(switched) for k in row)
    assert [a.rule for a in gfm.alerts] == [a.rule for a in gfm_always.alerts]
    # nothing left on the instances
    for cb in (gfm, attn):
        assert not set(vars(cb)) & set(type(cb).batch_hooks)


def test_several_optimizers_measure_the_same_with_the_hooks_switched(tmp_path: Path) -> None:
    (gfm, _), (gfm_always, _), switched, always = _fits(tmp_path, _Gan)
    assert len(gfm.ran["on_before_optimizer_step"]) < BATCHES
    assert _diag(switched) == _diag(always)
    assert [a.rule for a in gfm.alerts] == [a.rule for a in gfm_always.alerts]
    assert any("diag/grad" in k for _, row in _diag(switched) for k in row)


class _Gan(TwoOptimizers):
    def train_dataloader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4 * BATCHES, 8, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


class _Spy(pl.Callback):
    """Sees, at each batch's start (after the callbacks before it), whether the monitor's hook is switched off."""

    def __init__(self, monitor: GradientFlowMonitor) -> None:
        self.monitor = monitor
        self.off: dict[int, bool] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        driver = driver_of(trainer)
        assert driver is not None and driver.hosts(self.monitor)
        self.off[batch_idx] = not driver.runs(self.monitor, "on_before_optimizer_step")


def test_system_monitor_times_the_hooks_through_the_switching_and_both_leave_nothing(tmp_path: Path) -> None:
    gfm = GradientFlowMonitor()
    spy = _Spy(gfm)
    monitor = SystemMonitor(overhead_sample_every=1)
    _fit(tmp_path, Attention(), [gfm, spy, monitor], TensorBoardLogger(tmp_path, name="tb"))
    assert sum(spy.off.values()) >= BATCHES // 2  # most batches ran without the hook
    assert not all(spy.off.values())
    runs = [p.parent for p in tmp_path.rglob("events.out.tfevents.*")]
    shares = []
    for run in runs:
        acc = EventAccumulator(str(run))
        acc.Reload()
        if "diag/overhead/GradientFlowMonitor" in acc.Tags()["scalars"]:
            shares += [e.value for e in acc.Scalars("diag/overhead/GradientFlowMonitor")]
    assert shares and max(shares) > 0  # the timers still wrap the hooks that run
    assert not set(vars(gfm)) & set(GradientFlowMonitor.batch_hooks)  # neither None nor a timer left behind


def test_system_monitor_closes_every_batch_when_a_switching_callback_is_last(tmp_path: Path) -> None:
    # SystemMonitor closes each batch after the last callback's `on_train_batch_end`, by wrapping that hook: the
    # wrapper must run on quiet batches too, when the last callback switches its hooks off
    seen = {}
    for order in ("first", "last"):
        gfm, monitor = GradientFlowMonitor(), SystemMonitor()
        callbacks: list[pl.Callback] = [gfm, monitor] if order == "first" else [monitor, gfm]
        _fit(tmp_path / order, Attention(), callbacks)
        seen[order] = monitor.windows.steps_seen
        assert not set(vars(gfm)) & set(GradientFlowMonitor.batch_hooks)
    assert seen["last"] == seen["first"] >= BATCHES - EVERY


# -- AnomalyAlarm: its batch end off on the batches where it would only keep the loss --------------------------
class _Trending(pl.LightningModule):
    """A regression whose loss level is 4x every other window of 8 optimizer steps (``loss_swing``), with one
    spike (``loss_outlier``) and a learning rate of zero (``loss_stagnant``); ``kind="double"`` returns it in float64
    (the batch end's own path), ``kind="none"`` returns None on two quiet batches of each epoch."""

    def __init__(self, kind: str = "plain") -> None:
        super().__init__()
        self.kind = kind
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(4 * 60, 8, generator=g)
        self.y = self.x.sum(1, keepdim=True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = (self.net(x) - y).pow(2).mean() * (4.0 if (self.global_step // 8) % 2 else 1.0)
        loss = loss * 1e6 if self.global_step == 37 else loss
        loss = loss * math.nan if self.kind == "nan" and self.global_step == 43 else loss
        if self.kind == "none" and batch_idx in (12, 33):
            return None
        return loss.double() if self.kind == "double" else loss

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x, self.y), batch_size=4)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _alarm_fit(tmp_path: Path, alarm: Any, accumulate: int, kind: str) -> MemoryLogger:
    torch.manual_seed(0)
    memory = MemoryLogger()
    pl.Trainer(
        default_root_dir=tmp_path,
        max_epochs=2 * accumulate,  # 120 optimizer steps
        accumulate_grad_batches=accumulate,
        log_every_n_steps=EVERY,
        logger=memory,
        callbacks=[alarm],
        **FAST,
    ).fit(_Trending(kind))
    return memory


@pytest.mark.parametrize(("accumulate", "kind"), [(1, "plain"), (2, "plain"), (1, "double"), (1, "none")])
def test_anomaly_alarm_keeps_the_loss_at_backward_on_quiet_batches_and_alerts_the_same(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, accumulate: int, kind: str
) -> None:
    from lightning_diag import AnomalyAlarm

    switched, always = _counting(AnomalyAlarm)(swing_window=8), _counting(AnomalyAlarm)(swing_window=8)
    always.batch_hooks = ()
    full_starts = [0]  # the switched alarm's full batch starts (the short start skips the base's)
    base_start = DiagCallback.on_train_batch_start

    def counted(self: DiagCallback, *args: Any) -> None:
        full_starts[0] += self is switched
        base_start(self, *args)

    monkeypatch.setattr(DiagCallback, "on_train_batch_start", counted)
    with caplog.at_level(logging.INFO, logger="lightning_diag"):
        on = _alarm_fit(tmp_path / "switched", switched, accumulate, kind)
        off = _alarm_fit(tmp_path / "always", always, accumulate, kind)
    batches = 2 * accumulate * 60
    assert always.ran["on_train_batch_end"] == set(range(batches))
    if kind == "double":  # a loss the batch end must convert: it stays on from the first such batch
        assert len(switched.ran["on_train_batch_end"]) == batches
        assert full_starts[0] == batches  # no quiet batch: every start is full
    else:
        assert len(switched.ran["on_train_batch_end"]) < batches // 2, sorted(switched.ran["on_train_batch_end"])
        # a quiet batch that follows a quiet one starts on the short path (here runs of 2-7: at least half of
        # them); one that falls due (the cadence, the step window) starts in full
        quiet, short = batches - len(switched.ran["on_train_batch_end"]), batches - full_starts[0]
        assert quiet // 2 <= short < quiet, (short, quiet)
    # a quiet batch that returned None is told once per fit, as its batch end tells it
    skipped = [r for r in caplog.records if "returned None" in r.getMessage()]
    assert len(skipped) == (2 if kind == "none" else 0)
    # what is written, alerted and kept does not depend on the switching
    assert _diag(on) == _diag(off)
    assert any("diag/loss/train_step" in row for _, row in _diag(on))
    assert any("diag/loss/train_window" in row for _, row in _diag(on))
    described = [(a.rule, a.global_step, a.epoch, a.value, a.message) for a in switched.alerts]
    assert described == [(a.rule, a.global_step, a.epoch, a.value, a.message) for a in always.alerts]
    rules = {a.rule for a in switched.alerts}
    assert {"loss_swing", "loss_outlier", "loss_stagnant"} <= rules, rules
    assert switched.state_dict() == always.state_dict()
    assert not set(vars(switched)) & set(AnomalyAlarm.batch_hooks)


class _States(pl.Callback):
    """Placed after the alarm: the alarm's checkpoint state at every batch start (quiet ones included)."""

    def __init__(self, alarm: Any) -> None:
        self.alarm, self.states = alarm, []

    def on_train_batch_start(self, *args: Any) -> None:
        self.states.append(self.alarm.state_dict())


def test_anomaly_alarm_quiet_losses_are_handed_on_before_anything_reads_them(tmp_path: Path) -> None:
    """The quiet batches' losses are kept at their backward and handed on to the loss sums and ``loss_outlier``
    later: the checkpoint state at every batch start, the alerts of a NaN on a quiet step (their last finite loss)
    and the state at the end are those of a run whose batch end keeps every loss."""
    from lightning_diag import AnomalyAlarm

    runs = {}
    for name, hooks in (("switched", AnomalyAlarm.batch_hooks), ("always", ())):
        alarm = _counting(AnomalyAlarm)(swing_window=8)
        alarm.batch_hooks = hooks
        states = _States(alarm)
        torch.manual_seed(0)
        pl.Trainer(
            default_root_dir=tmp_path / name,
            max_epochs=1,
            log_every_n_steps=EVERY,
            logger=False,
            callbacks=[alarm, states],
            **FAST,
        ).fit(_Trending("nan"))
        runs[name] = (alarm, states.states)
    (switched, on), (always, off) = runs["switched"], runs["always"]
    # the fit stops after the NaN of step 43; the switched alarm's batch end ran on fewer than half the batches
    assert len(on) == len(off) == 44 and len(switched.ran["on_train_batch_end"]) < 22
    assert on == off
    described = [(a.rule, a.global_step, a.message) for a in switched.alerts]
    assert any(rule == "nonfinite_loss" and step == 43 for rule, step, _ in described), described
    assert described == [(a.rule, a.global_step, a.message) for a in always.alerts]
    assert repr(switched.state_dict()) == repr(always.state_dict())  # (the NaN loss is in both: nan != nan)


def test_anomaly_alarm_hands_on_quiet_losses_in_bounded_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A logging interval longer than the fit: the quiet losses held between two hand-ons stay under
    ``HAND_ON_EVERY`` (16 here, for a 60-batch epoch), and every loss reaches the loss sums (the epoch's mean is
    that of the always-on alarm)."""
    from lightning_diag import AnomalyAlarm
    from lightning_diag.callbacks.anomaly_alarm import quiet as alarm_quiet

    monkeypatch.setattr(alarm_quiet, "HAND_ON_EVERY", 16)

    held: list[int] = []

    class Held(pl.Callback):
        """Placed after the alarm: how many quiet losses it holds at each batch start."""

        def __init__(self, alarm: Any) -> None:
            self.alarm = alarm

        def on_train_batch_start(self, *args: Any) -> None:
            held.append(len(self.alarm._deferred))

    means = {}
    for name, hooks in (("switched", AnomalyAlarm.batch_hooks), ("always", ())):
        alarm = AnomalyAlarm(log_every_n_steps=1000)
        alarm.batch_hooks = hooks
        memory = MemoryLogger()
        pl.Trainer(
            default_root_dir=tmp_path / name,
            max_epochs=1,
            logger=memory,
            log_every_n_steps=1000,
            callbacks=[alarm, Held(alarm)] if name == "switched" else [alarm],
            **FAST,
        ).fit(_Trending())
        means[name] = [row["diag/loss/train_epoch"] for _, row in memory.calls if "diag/loss/train_epoch" in row]
    assert max(held) == 15 and len(held) == 60
    assert means["switched"] == means["always"] and len(means["switched"]) == 1
