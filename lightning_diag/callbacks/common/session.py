"""The diagnostics session of a trainer's run folder: the folder, the writer and the alert log.

Every lightning_diag callback attached to one trainer shares one :class:`DiagSession`, held by the trainer's
driver (:mod:`lightning_diag.callbacks.common.driver`, which opens it when the first callback attaches in ``setup``
and closes it when the last detaches in ``teardown``): rank zero writes ``<run_log_dir>/diag`` (``alerts.jsonl``,
``thresholds.json``, ``run.json``) and every logger's series through one
:class:`~lightning_diag.output.writer.DiagWriter`.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Iterable
from typing import Any, Protocol

import pytorch_lightning as pl

from lightning_diag.callbacks.common.provenance import write_run_record
from lightning_diag.callbacks.common.step_axis import StepAxis
from lightning_diag.core.alerts import Alert, AlertLog
from lightning_diag.core.files import ALERTS_FILE, THRESHOLDS_FILE, write_json
from lightning_diag.core.tags import ALERTS_TAG, THRESHOLDS_TAG, sanitize_tag
from lightning_diag.output.dashboard import alerts_markdown, dashboard_layout, thresholds_markdown
from lightning_diag.output.writer import DiagWriter, per_version_logger_types

__all__ = ["DiagSession", "ThresholdSource", "run_log_dir"]

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


class DiagSession:
    """The writer and alert log shared by every lightning_diag callback attached to one trainer.

    Args:
        log_dir: The run's folder (:func:`run_log_dir`); files go to ``<log_dir>/diag``.
        trainer: The trainer; used lazily to find its loggers and TensorBoard writer.
        is_global_zero: Only global rank zero writes anything.
        step_axis: The trainer's step axis (its driver's), which the writer writes on during a fit; a new one when
            not given.
    """

    def __init__(
        self, log_dir: str, trainer: pl.Trainer, is_global_zero: bool, step_axis: StepAxis | None = None
    ) -> None:
        self.log_dir = log_dir
        self.diag_dir = os.path.join(log_dir, "diag")
        self.is_global_zero = is_global_zero
        self._trainer_ref = weakref.ref(trainer)
        self._writer: DiagWriter | None = None
        self._alerts: list[Alert] = []
        self._fit_started = False
        self._sinks: list[Any] = []
        self.step_axis = step_axis if step_axis is not None else StepAxis()
        self._run_recorded = False
        #: The callbacks writing to this session (counted by the driver: the last one's detach closes it).
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

    def flush(self) -> None:
        """Write out what the writer holds (if it was opened): a callback's detach, so that a run whose other
        callbacks never detach loses none of its last events."""
        if self._writer is not None:
            self._writer.flush()

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
