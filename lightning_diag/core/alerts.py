"""Alerts: the alert log and (re-exported) the record every rule produces. Standard library only.

An :class:`Alert` is a frozen record (defined in :mod:`lightning_diag.core.record`, the bottom of the package).
The :class:`AlertLog` appends each alert as one JSON object per line to ``<log_dir>/diag/alerts.jsonl``
(flushed at once, so a killed run leaves only whole lines), logs it through the ``lightning_diag`` logger and
hands it to TensorBoard as text under ``diag/alerts``.

The rule ids live with their declarations in ``lightning_diag.rules`` (``LOSS_SWING`` in ``rules/loss_swing.py``);
:data:`lightning_diag.rules.catalog.ALL_RULES` lists them all.

Example:
    >>> a = Alert(rule="loss_swing", severity=Severity.WARNING, message="loss swings", epoch=3,
    ...           global_step=120, value=0.14, threshold=0.1, source="train_loss")
    >>> a.severity == "warning"
    True
    >>> Alert.from_json(a.to_json()) == a
    True
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from lightning_diag.core.files import report_write_failure
from lightning_diag.core.record import Alert, NonFiniteAction, Severity

__all__ = [
    "ALERT_COLUMNS",
    "Alert",
    "AlertLog",
    "NonFiniteAction",
    "Severity",
    "alert_cells",
    "alert_table_markdown",
    "read_alerts",
]

logger = logging.getLogger("lightning_diag")

#: Columns of every alert table (the TensorBoard ``diag/alerts`` text and the report's timeline).
ALERT_COLUMNS: tuple[str, ...] = ("step", "epoch", "severity", "rule", "source", "value", "threshold", "message")


def alert_cells(alert: Alert) -> tuple[str, ...]:
    """One alert as the plain-text cells of :data:`ALERT_COLUMNS` (numbers to 4 significant digits).

    Example:
        >>> alert_cells(Alert("grad_explode", "warning", "too big", 1, 40, 12.3456, 10.0, "fc"))
        ('40', '1', 'warning', 'grad_explode', 'fc', '12.35', '10', 'too big')
    """
    value = "" if alert.value is None else f"{alert.value:.4g}"
    threshold = "" if alert.threshold is None else f"{alert.threshold:.4g}"
    return (str(alert.global_step), str(alert.epoch), alert.severity.value, alert.rule, alert.source, value,
            threshold, alert.message)


def alert_table_markdown(alerts: Iterable[Alert]) -> list[str]:
    """The markdown lines of an alert table (header, rule, one row per alert in the order given)."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(ALERT_COLUMNS) + " |", "|" + "---|" * len(ALERT_COLUMNS)]
    lines += ["| " + " | ".join(cell(c) for c in alert_cells(a)) + " |" for a in alerts]
    return lines


def read_alerts(path: str | os.PathLike[str]) -> list[Alert]:
    """Read an ``alerts.jsonl`` file. A torn last line (a run killed mid-write) is ignored."""
    alerts = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                alerts.append(Alert.from_json(line))
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
    return alerts


class AlertLog:
    """Writes alerts to ``alerts.jsonl``, the ``lightning_diag`` logger and a text sink.

    Args:
        path: The JSONL file to append to, or ``None`` for a log that writes nothing to disk
            (ranks other than global rank zero).
        text_sink: Called with every alert after it is written, for example to put it in TensorBoard.
        enabled: ``False`` makes the log silent (non-zero ranks): nothing is written or logged.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        text_sink: Callable[[Alert], None] | None = None,
        enabled: bool = True,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.enabled = enabled
        self._text_sink = text_sink
        self._fd: int | None = None
        self._failed = False  # the file could not be written: alerts still go to the logger and the sink
        self.written: list[Alert] = []

    def write(self, alerts: Alert | Iterable[Alert]) -> None:
        """Append alerts: one JSON line each, flushed at once; logged; handed to the text sink."""
        batch = [alerts] if isinstance(alerts, Alert) else list(alerts)
        if not self.enabled or not batch:
            return
        if self.path is not None and not self._failed:
            self._append(self.path, "".join(a.to_json() + "\n" for a in batch).encode("utf-8"))
        for a in batch:
            logger.log(a.severity.log_level, a.format())
            self.written.append(a)
            if self._text_sink is not None:
                self._text_sink(a)

    def _append(self, path: Path, data: bytes) -> None:
        """Append whole lines to the file; a failure is reported once (the alerts still reach the logger and the
        text sink) and the file is not written again by this log, so a torn line is only ever the last one."""
        try:
            if self._fd is None:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            # Unbuffered, one write(2) per batch of whole lines: a process killed at any moment (SIGKILL) leaves
            # only complete lines behind, and nothing waits in a Python buffer.
            _write_all(self._fd, data)
        except OSError as err:
            self._failed = True
            self.close()
            report_write_failure(path, err)

    def close(self) -> None:
        """Close the file (it is reopened in append mode if more alerts come)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError as err:  # a network file system reports a failed write at close
                if self.path is not None:
                    report_write_failure(self.path, err)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
