"""Alerts where the user looks: what the W&B and MLflow loggers get beyond scalars.

A :class:`LoggerSink` is built for each logger of the trainer that has a richer place for alerts than a scalar
series (:func:`sinks_for`); the per-trainer session (:class:`~lightning_diag.callbacks.common.session.DiagSession`)
calls it on global rank zero:

* ``WandbLogger``: the run's diag folder goes into the run config (``lightning_diag/diag_dir``); every alert of
  the fit goes into a ``wandb.Table`` under ``diag/alerts_table`` (logged at fit end and at every critical
  alert); every critical alert is also sent through ``wandb.Run.alert`` (an e-mail or Slack notice in W&B's
  settings; a no-op offline).
* ``MLFlowLogger``: the diag folder becomes the run tag ``lightning_diag.diag_dir``; ``diag/alerts.jsonl``,
  ``diag/thresholds.json`` and the run's report (``diag/report.md``, the markdown of
  :mod:`lightning_diag.report`) are uploaded as run artifacts under ``diag/``, at fit end and at every critical
  alert.

Loggers are recognised by class name (``WandbLogger``/``MLFlowLogger`` of ``pytorch_lightning.loggers`` or
``lightning.pytorch.loggers``, and their subclasses), so neither ``wandb`` nor ``mlflow`` is imported unless the
user's logger already did. A sink that fails is reported once and dropped: a logger outage never ends a run.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from lightning_diag.core.alerts import Alert, Severity
from lightning_diag.core.files import write_text

__all__ = [
    "ALERTS_TABLE_KEY",
    "DIAG_DIR_CONFIG_KEY",
    "DIAG_DIR_TAG",
    "LoggerSink",
    "MLflowSink",
    "WandbSink",
    "is_logger",
    "sinks_for",
]

log = logging.getLogger("lightning_diag")

#: W&B config key holding the run's diag folder.
DIAG_DIR_CONFIG_KEY = "lightning_diag/diag_dir"
#: MLflow run tag holding the run's diag folder.
DIAG_DIR_TAG = "lightning_diag.diag_dir"
#: W&B key of the alerts table.
ALERTS_TABLE_KEY = "diag/alerts_table"
#: MLflow artifact folder of the run's diagnostics.
ARTIFACT_PATH = "diag"
REPORT_FILE = "report.md"
#: Columns of the W&B alerts table: the alert's fields.
TABLE_COLUMNS = ("global_step", "epoch", "severity", "rule", "source", "value", "threshold", "message")


_LOGGER_MODULES = ("pytorch_lightning.loggers", "lightning.pytorch.loggers")


def is_logger(logger: object, class_name: str) -> bool:
    """Whether ``logger`` is (a subclass of) Lightning's logger class ``class_name``, without importing it.

    Example:
        >>> class WandbLogger: ...
        >>> WandbLogger.__module__ = "pytorch_lightning.loggers.wandb"
        >>> is_logger(WandbLogger(), "WandbLogger"), is_logger(object(), "WandbLogger")
        (True, False)
    """
    classes = type(logger).__mro__
    return any(cls.__name__ == class_name and cls.__module__.startswith(_LOGGER_MODULES) for cls in classes)


class LoggerSink:
    """What a logger gets besides scalars; every method is a no-op here.

    Args:
        logger: The Lightning logger.
        diag_dir: The run's diag folder (``alerts.jsonl``, ``thresholds.json``).
        step: Returns the step on the user's axis (the writer's), for what is logged against a step.
    """

    def __init__(self, logger: Any, diag_dir: str, step: Callable[[], int]) -> None:
        self.logger = logger
        self.diag_dir = diag_dir
        self.step = step

    def start(self) -> None:
        """At fit start: record where the run's diagnostics are."""

    def alert(self, alert: Alert, alerts: Sequence[Alert]) -> None:
        """After ``alert`` was written to ``alerts.jsonl``; ``alerts`` are all of the fit so far."""

    def finish(self, alerts: Sequence[Alert]) -> None:
        """At fit end (also when ``fit`` raised), after the writer was flushed."""


class WandbSink(LoggerSink):
    """``WandbLogger``: the diag folder in the config, an alerts table, critical alerts through ``Run.alert``."""

    def start(self) -> None:
        """Put the diag folder into the run config."""
        self.logger.experiment.config.update({DIAG_DIR_CONFIG_KEY: self.diag_dir}, allow_val_change=True)

    def alert(self, alert: Alert, alerts: Sequence[Alert]) -> None:
        """Send a critical alert through ``wandb.Run.alert`` and log the table again."""
        if alert.severity != Severity.CRITICAL:
            return
        self.logger.experiment.alert(
            title=f"lightning_diag: {alert.rule} ({alert.source})", text=alert.format(), level="ERROR"
        )
        self._table(alerts)

    def finish(self, alerts: Sequence[Alert]) -> None:
        """Log the alerts table of the fit."""
        if alerts:
            self._table(alerts)

    def _table(self, alerts: Sequence[Alert]) -> None:
        rows = [[_cell(a.to_dict()[c]) for c in TABLE_COLUMNS] for a in alerts]
        self.logger.log_table(key=ALERTS_TABLE_KEY, columns=list(TABLE_COLUMNS), data=rows, step=self.step())


def _cell(value: Any) -> Any:
    return value if value is None or isinstance(value, (int, float, str)) else str(value)


class MLflowSink(LoggerSink):
    """``MLFlowLogger``: the diag folder as a run tag; the alert log, thresholds and report as run artifacts."""

    def start(self) -> None:
        """Tag the run with its diag folder."""
        self.logger.experiment.set_tag(self.logger.run_id, DIAG_DIR_TAG, self.diag_dir)

    def alert(self, alert: Alert, alerts: Sequence[Alert]) -> None:
        """Upload the diagnostics at a critical alert (the run may not reach its end)."""
        if alert.severity == Severity.CRITICAL:
            self._upload()

    def finish(self, alerts: Sequence[Alert]) -> None:
        """Upload the diagnostics at fit end."""
        self._upload()

    def _upload(self) -> None:
        report = _write_report(self.diag_dir)
        files = [os.path.join(self.diag_dir, f) for f in ("alerts.jsonl", "thresholds.json")]
        for path in [*files, *([report] if report else [])]:
            if os.path.isfile(path):
                self.logger.experiment.log_artifact(self.logger.run_id, path, artifact_path=ARTIFACT_PATH)


def _write_report(diag_dir: str) -> str | None:
    """Write the run's markdown report to ``<diag_dir>/report.md``; its path, or ``None`` without diagnostics or
    when it could not be written (reported once by :func:`~lightning_diag.core.files.write_text`)."""
    from lightning_diag.report import NoDiagnosticsError, build_report, render

    if not os.path.isdir(diag_dir):  # nothing was written (a read-only run folder): nothing to report
        return None
    run_dir = os.path.dirname(os.path.abspath(diag_dir))
    try:
        reports = build_report(run_dir)
    except NoDiagnosticsError:
        return None
    path = os.path.join(diag_dir, REPORT_FILE)
    return path if write_text(path, render(reports, "md") + "\n") else None


_SINKS: tuple[tuple[str, type[LoggerSink]], ...] = (("WandbLogger", WandbSink), ("MLFlowLogger", MLflowSink))


def sinks_for(loggers: Iterable[Any], diag_dir: str, step: Callable[[], int]) -> list[LoggerSink]:
    """A sink for each W&B or MLflow logger among ``loggers`` (the trainer's), in order."""
    out: list[LoggerSink] = []
    for lg in loggers:
        for name, sink in _SINKS:
            if is_logger(lg, name):
                out.append(sink(lg, diag_dir, step))
    return out


def call_sinks(sinks: list[LoggerSink], method: str, *args: Any) -> None:
    """Call ``method`` on every sink; one that raises is reported once and removed from ``sinks``."""
    for sink in list(sinks):
        try:
            getattr(sink, method)(*args)
        except Exception as err:  # a logger outage must not end the user's run
            sinks.remove(sink)
            log.warning(
                "%s of %s failed (%s: %s): lightning_diag stops sending alerts to it for this run",
                method,
                type(sink.logger).__name__,
                type(err).__name__,
                err,
            )
