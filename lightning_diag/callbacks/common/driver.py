"""The driver: one per trainer, what every lightning_diag callback attached to it shares (issue 43).

A :class:`Driver` holds the trainer's session (:class:`~lightning_diag.callbacks.common.session.DiagSession`: the
run's folder, writer, alert log), its step axis (:class:`~lightning_diag.callbacks.common.step_axis.StepAxis`), the
measurements of the current optimizer step (:class:`StepCache`) and the ordered list of the callbacks attached to
it. A callback attaches in ``setup`` (:func:`attach`) and detaches in ``teardown``; the driver lives as long as the
trainer (a second ``fit`` on the same trainer continues its step axis).

Once per training batch the driver moves the step axis and decides, for every attached callback, whether the batch
is on its logging cadence (:meth:`Driver.batch_started`, set as each callback's ``on_cadence``): the first attached
callback whose ``on_train_batch_start`` runs in the batch (Lightning calls them in ``trainer.callbacks`` order)
triggers it, and the others read the decision: a callback whose :attr:`Driver.batches` count has moved since its
last batch start knows the batch is decided. The epoch's start is the same (:meth:`Driver.epoch_started`, once per
epoch).
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from typing import Any, Protocol

import pytorch_lightning as pl

from lightning_diag.callbacks.common.session import DiagSession, ThresholdSource, run_log_dir
from lightning_diag.callbacks.common.step_axis import StepAxis

__all__ = ["AttachedCallback", "Driver", "StepCache", "attach", "driver_of", "gradient_squares_key"]


class StepCache:
    """What one optimizer step measured, computed once by the first callback that needs it and read by the others
    (issue 43: one read of the gradients per measuring step, however many callbacks use it).

    Entries live for one step: an entry put at another ``global_step`` is gone. A reader checks that an entry
    describes what it would have measured itself (the same tensors, unchanged) before using it.

    Example:
        >>> cache = StepCache()
        >>> cache.put(10, "grad_squares", 1.0)
        >>> cache.get(10, "grad_squares"), cache.get(11, "grad_squares")
        (1.0, None)
    """

    def __init__(self) -> None:
        self._step: int | None = None
        self._values: dict[Hashable, Any] = {}

    def put(self, step: int, name: Hashable, value: Any) -> None:
        """Keep ``value`` under ``name`` for ``step`` (the entries of an earlier step are dropped)."""
        if step != self._step:
            self._step = step
            self._values = {}
        self._values[name] = value

    def get(self, step: int, name: Hashable) -> Any | None:
        """The value put under ``name`` at ``step``, else ``None``."""
        return self._values.get(name) if step == self._step else None

    def clear(self) -> None:
        """Drop every entry."""
        self._step = None
        self._values = {}


def gradient_squares_key(optimizer: Any) -> tuple[str, int]:
    """The :class:`StepCache` entry of the squared gradient norms measured at an ``optimizer``'s step (a
    :class:`~lightning_diag.instrument.grad_measure.GradientSquares`)."""
    return ("grad_squares", id(optimizer))


class AttachedCallback(ThresholdSource, Protocol):
    """What the driver reads and sets on an attached callback (a
    :class:`~lightning_diag.callbacks.common.base.DiagCallback`)."""

    #: Whether the current training batch is on the callback's logging cadence: set by :meth:`Driver.batch_started`.
    on_cadence: bool

    def every_n_steps(self, trainer: pl.Trainer) -> int:
        """The callback's logging interval."""
        ...


class Driver:
    """What is per trainer: the session, the step axis, the step's measurements and the attached callbacks.

    Attributes:
        step_axis: The user's step axis (one per trainer, kept across fits; saved by the callbacks' checkpoint
            hooks under :data:`~lightning_diag.callbacks.common.step_axis.STEP_AXIS_KEY`).
        step_cache: What the current optimizer step measured (:class:`StepCache`).
        session: The session of the current run folder, while a callback is attached; else ``None``.
        callbacks: The attached callbacks, in ``trainer.callbacks`` order from ``on_fit_start`` (before: the order
            they attached in, which is Lightning's ``setup`` order, the same).
        batches: The training batches decided so far (:meth:`batch_started`): a callback that finds it where it
            was at its own last batch start is the first of the batch, and calls :meth:`batch_started`.
    """

    def __init__(self) -> None:
        self.step_axis = StepAxis()
        self.step_cache = StepCache()
        self.session: DiagSession | None = None
        self.callbacks: list[AttachedCallback] = []
        self.batches = 0
        self._epoch: tuple[int, int] | None = None  # (epoch, global step) of the last epoch start
        # the attached callbacks grouped by logging interval, read at the fit's first batch
        self._cadence: list[_Interval] | None = None

    def attach(self, trainer: pl.Trainer, callback: AttachedCallback) -> DiagSession:
        """Attach ``callback`` (from its ``setup``, on every rank: :func:`run_log_dir` broadcasts from rank zero).

        Returns:
            The session of the trainer's current run folder (a new one when there is none or the folder changed),
            with one more user.
        """
        log_dir = run_log_dir(trainer)
        session = self.session
        if session is None or session.log_dir != log_dir:
            session = self.session = DiagSession(log_dir, trainer, trainer.is_global_zero, self.step_axis)
        session.users += 1
        if not any(cb is callback for cb in self.callbacks):
            self.callbacks.append(callback)
            self._changed()
        return session

    def detach(self, callback: AttachedCallback, session: DiagSession) -> None:
        """Detach ``callback``, a user of ``session`` (from its ``teardown``); the last user closes the session."""
        kept = [cb for cb in self.callbacks if cb is not callback]
        if len(kept) != len(self.callbacks):
            self.callbacks = kept
            self._changed()
        session.users -= 1
        if session.users <= 0:
            session.close()
            if self.session is session:
                self.session = None

    def start_fit(self, trainer: pl.Trainer) -> None:
        """A fit starts (every attached callback's ``on_fit_start``; the first call does the work): fix the order
        of :attr:`callbacks` to ``trainer.callbacks``' and let the session record the thresholds in effect
        (:meth:`DiagSession.start_fit`)."""
        order = {id(cb): i for i, cb in enumerate(trainer.callbacks)}  # type: ignore[attr-defined]
        ordered = sorted(self.callbacks, key=lambda cb: order.get(id(cb), len(order)))
        if any(a is not b for a, b in zip(ordered, self.callbacks, strict=True)):
            self.callbacks = ordered
            self._changed()
        if self.session is not None:
            self.session.start_fit(trainer, self.callbacks)

    def _changed(self) -> None:
        self._cadence = None
        self._epoch = None

    def batch_started(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int) -> bool:
        """A training batch starts (the first attached callback's ``on_train_batch_start`` in the batch): move the
        step axis, count the batch in :attr:`batches` and set every attached callback's ``on_cadence``: whether
        :attr:`StepAxis.cadence_step <lightning_diag.callbacks.common.step_axis.StepAxis.cadence_step>` is a
        multiple of its logging interval (``every_n_steps(trainer)``, read once per fit).

        Returns:
            Whether this call decided (``False``: a second call in the same batch, which changes nothing).
        """
        axis = self.step_axis
        cadence = self._cadence
        if not axis.batch_started(trainer, pl_module, batch_idx) and cadence is not None:
            return False
        self.batches += 1
        if cadence is None:
            groups: dict[int, list[AttachedCallback]] = {}
            for cb in self.callbacks:
                groups.setdefault(cb.every_n_steps(trainer), []).append(cb)
            cadence = self._cadence = [_Interval(every, callbacks) for every, callbacks in groups.items()]
        count = axis.stepped + 1  # `axis.cadence_step`, without the property
        for interval in cadence:
            on = count % interval.every == 0
            if on is not interval.on:  # set only when it changes (a quiet run's batches leave it)
                interval.on = on
                for cb in interval.callbacks:
                    cb.on_cadence = on
        return True

    def epoch_started(self, trainer: pl.Trainer) -> None:
        """A training epoch starts (every attached callback's ``on_train_epoch_start``; the first call of the epoch
        does the work): move the step axis past the previous epoch's last batch."""
        epoch = (trainer.current_epoch, trainer.global_step)
        if epoch != self._epoch:
            self._epoch = epoch
            self.step_axis.epoch_started(trainer)


class _Interval:
    """The attached callbacks of one logging interval, and the cadence last set on them (``None``: not yet)."""

    __slots__ = ("callbacks", "every", "on")

    def __init__(self, every: int, callbacks: list[AttachedCallback]) -> None:
        self.every = every
        self.callbacks = callbacks
        self.on: bool | None = None


_DRIVERS: weakref.WeakKeyDictionary[pl.Trainer, Driver] = weakref.WeakKeyDictionary()


def driver_of(trainer: pl.Trainer) -> Driver | None:
    """The trainer's driver, once a lightning_diag callback attached to it; else ``None``."""
    return _DRIVERS.get(trainer)


def attach(trainer: pl.Trainer, callback: AttachedCallback) -> Driver:
    """Attach ``callback`` to the trainer's driver (created at the first call for a trainer, kept while the trainer
    lives); its :attr:`Driver.session` is then the session the callback writes to (:meth:`Driver.attach`)."""
    driver = _DRIVERS.get(trainer)
    if driver is None:
        driver = _DRIVERS[trainer] = Driver()
    driver.attach(trainer, callback)
    return driver
