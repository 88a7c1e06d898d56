"""The per-trainer diagnostics session: the run's folder, the writer, the alert log and the step axis.

Every lightning_diag callback attached to one trainer shares one :class:`DiagSession` (acquired in ``setup``,
released in ``teardown``): rank zero writes ``<run_log_dir>/diag`` (``alerts.jsonl``, ``thresholds.json``,
``run.json``) and every logger's series through one :class:`~lightning_diag.output.writer.DiagWriter`.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Hashable, Iterable
from typing import Any, Protocol

import pytorch_lightning as pl

from lightning_diag.callbacks.common.provenance import write_run_record
from lightning_diag.callbacks.common.step_axis import StepAxis
from lightning_diag.core.alerts import Alert, AlertLog
from lightning_diag.core.files import ALERTS_FILE, THRESHOLDS_FILE, write_json
from lightning_diag.core.tags import ALERTS_TAG, THRESHOLDS_TAG, sanitize_tag
from lightning_diag.output.dashboard import alerts_markdown, dashboard_layout, thresholds_markdown
from lightning_diag.output.writer import DiagWriter, per_version_logger_types

__all__ = [
    "DiagSession",
    "StepCache",
    "acquire_session",
    "gradient_squares_key",
    "release_session",
    "run_log_dir",
    "step_cache",
]

log = logging.getLogger("lightning_diag")


class ThresholdSource(Protocol):
    """What :meth:`DiagSession.start_fit` reads of a callback: the thresholds it judges by."""

    def thresholds(self) -> dict[str, float]: ...


def run_log_dir(trainer: pl.Trainer) -> str:
    """The folder of this run's diagnostics, ``<it>/diag``: one per run, whatever the loggers.

    ``trainer.log_dir`` when the first logger's folder is per run (TensorBoard's and CSV's ``version_N``) or
    there is no logger (``default_root_dir``). Otherwise (W&B, MLflow, a custom logger, whose ``trainer.log_dir``
    is their shared save directory) ``<save_dir or default_root_dir>/<name>/<version>``, the folder Lightning's
    ``ModelCheckpoint`` uses for the run's checkpoints: W&B's project and run id, MLflow's experiment id and run
    id. Decided on global rank zero and broadcast: call it on every rank.
    """
    base = trainer.log_dir or trainer.default_root_dir
    loggers = trainer.loggers
    if not loggers or isinstance(loggers[0], per_version_logger_types()):
        return base
    parts: list[str] | None = None
    if trainer.is_global_zero:
        name, version = loggers[0].name, loggers[0].version
        if version is not None and not isinstance(version, str):
            version = f"version_{version}"
        parts = [sanitize_tag(str(p)) for p in (name, version) if p not in (None, "")]
    parts = trainer.strategy.broadcast(parts)
    return os.path.join(base, *parts) if parts else base


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


def step_cache(trainer: pl.Trainer) -> StepCache:
    """The trainer's :class:`StepCache` (one per trainer, shared by every lightning_diag callback on it)."""
    cache = _STEP_CACHES.get(trainer)
    if cache is None:
        cache = _STEP_CACHES[trainer] = StepCache()
    return cache


class DiagSession:
    """The writer, alert log and step axis shared by every lightning_diag callback attached to one trainer.

    Args:
        log_dir: The run's folder (:func:`run_log_dir`); files go to ``<log_dir>/diag``.
        trainer: The trainer; used lazily to find its loggers and TensorBoard writer.
        is_global_zero: Only global rank zero writes anything.
    """

    def __init__(self, log_dir: str, trainer: pl.Trainer, is_global_zero: bool) -> None:
        self.log_dir = log_dir
        self.diag_dir = os.path.join(log_dir, "diag")
        self.is_global_zero = is_global_zero
        self._trainer_ref = weakref.ref(trainer)
        self._writer: DiagWriter | None = None
        self._alerts: list[Alert] = []
        self._fit_started = False
        self._sinks: list[Any] = []
        # Per trainer, not per session: a second `trainer.fit` on the same trainer continues Lightning's count.
        self.step_axis = _STEP_AXES.setdefault(trainer, StepAxis())
        self._run_recorded = False
        self.users = 0
        self.alert_log = AlertLog(
            os.path.join(self.diag_dir, ALERTS_FILE) if is_global_zero else None,
            text_sink=self._alert_text,
            enabled=is_global_zero,
        )

    @property
    def writer(self) -> DiagWriter:
        """The writer (every logger for scalars, TensorBoard for the rest), created on first use; a no-op off rank
        zero."""
        if self._writer is None:
            trainer = self._trainer_ref()
            if trainer is None or not self.is_global_zero:
                self._writer = DiagWriter(None)
            else:
                self._writer = DiagWriter.for_trainer(trainer, self.log_dir)
                self._writer.step_axis = self._user_step
                self._writer.alert_count = lambda: len(self._alerts)
        return self._writer

    def _user_step(self, global_step: int) -> int:
        # During a fit, everything goes on the user's axis (StepAxis); outside one (validate) as given.
        return self.step_axis.user_step(global_step) if self._fit_started else global_step

    def _alert_text(self, alert: Alert) -> None:
        # The whole table, newest first, at every alert: the latest text entry always holds every alert.
        self._alerts.append(alert)
        self.writer.text(ALERTS_TAG, alerts_markdown(self._alerts), alert.global_step)
        self.writer.flush()
        if self._sinks:
            from lightning_diag.output.logger_sinks import call_sinks

            call_sinks(self._sinks, "alert", alert, list(self._alerts))

    def start_fit(self, trainer: pl.Trainer, callbacks: Iterable[ThresholdSource]) -> None:
        """Once per fit, on rank zero: record the thresholds in effect and write the dashboard layout.

        The thresholds of ``callbacks`` (every :class:`~lightning_diag.callbacks.common.base.DiagCallback` on the
        trainer) go to ``<log_dir>/diag/thresholds.json`` and to TensorBoard text under ``diag/thresholds``; the
        custom-scalars layout covers their rules.
        """
        if self._fit_started:
            return
        self._fit_started = True
        if not self.is_global_zero:
            return
        log.info("diagnostics of this run: %s", self.diag_dir)
        by_callback: dict[str, dict[str, float]] = {}
        for cb in callbacks:
            by_callback.setdefault(type(cb).__name__, {}).update(cb.thresholds())
        merged = {k: v for values in by_callback.values() for k, v in values.items()}
        write_json(
            os.path.join(self.diag_dir, THRESHOLDS_FILE),
            {"callbacks": by_callback, "thresholds": merged},
            sort_keys=True,
        )
        self.writer.text(THRESHOLDS_TAG, thresholds_markdown(by_callback), trainer.global_step)
        self.writer.custom_scalars(dashboard_layout([k for k in merged if "." not in k]))
        self.writer.flush()
        from lightning_diag.output.logger_sinks import call_sinks, sinks_for

        self._sinks = sinks_for(trainer.loggers, self.diag_dir, lambda: self.step_axis.step)
        call_sinks(self._sinks, "start")

    def record_run(self, trainer: pl.Trainer) -> None:
        """Once per fit, on rank zero, when training starts (the loaders are set up): ``<log_dir>/diag/run.json``,
        the run's provenance (:mod:`lightning_diag.callbacks.common.provenance`)."""
        if self._run_recorded or not self.is_global_zero:
            return
        self._run_recorded = True
        problem = write_run_record(trainer, self.diag_dir)
        if problem is not None:
            log.warning("lightning_diag: %s", problem)

    def close(self) -> None:
        """Hand the fit's alerts to the loggers' sinks (W&B, MLflow), close the alert log and the writer (if the
        library opened it)."""
        self.alert_log.close()
        if self._sinks:
            from lightning_diag.output.logger_sinks import call_sinks

            if self._writer is not None:
                self._writer.flush()  # the report the sinks upload reads the event files
            call_sinks(self._sinks, "finish", list(self._alerts))
            self._sinks = []
        if self._writer is not None:
            self._writer.close()
            self._writer = None


_SESSIONS: weakref.WeakKeyDictionary[pl.Trainer, DiagSession] = weakref.WeakKeyDictionary()
_STEP_AXES: weakref.WeakKeyDictionary[pl.Trainer, StepAxis] = weakref.WeakKeyDictionary()
_STEP_CACHES: weakref.WeakKeyDictionary[pl.Trainer, StepCache] = weakref.WeakKeyDictionary()


def acquire_session(trainer: pl.Trainer) -> DiagSession:
    """The trainer's session for its current run folder (a new one when there is none or the folder changed),
    with one more user. ``run_log_dir`` broadcasts from rank zero: every rank calls this from ``setup``."""
    log_dir = run_log_dir(trainer)
    session = _SESSIONS.get(trainer)
    if session is None or session.log_dir != log_dir:
        session = DiagSession(log_dir, trainer, trainer.is_global_zero)
        _SESSIONS[trainer] = session
    session.users += 1
    return session


def release_session(trainer: pl.Trainer, session: DiagSession) -> None:
    """One user fewer; the last one closes the session."""
    session.users -= 1
    if session.users <= 0:
        session.close()
        if _SESSIONS.get(trainer) is session:
            del _SESSIONS[trainer]
