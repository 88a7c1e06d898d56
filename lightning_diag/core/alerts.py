"""Alerts: the record every rule produces, the rule ids, and the alert log.

An :class:`Alert` is a frozen record. The :class:`AlertLog` appends each alert as one JSON object per line to
``<log_dir>/diag/alerts.jsonl`` (flushed at once, so a killed run leaves only whole lines), logs it through
the ``lightning_diag`` logger and hands it to TensorBoard as text under ``diag/alerts``.

Example:
    >>> a = Alert(rule=LOSS_SWING, severity=Severity.WARNING, message="loss swings", epoch=3,
    ...           global_step=120, value=0.14, threshold=0.1, source="train_loss")
    >>> a.severity == "warning"
    True
    >>> Alert.from_json(a.to_json()) == a
    True
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from enum import Enum
from pathlib import Path
from typing import Any, Literal

from lightning_diag.core.registry import OWNERS

__all__ = [
    "ALERT_COLUMNS",
    "ALL_RULES",
    "ATTN_ENTROPY_HIGH",
    "ATTN_ENTROPY_LOW",
    "ATTN_SINK",
    "GRAD_COLLAPSE",
    "GRAD_EXPLODE",
    "GRAD_FROZEN",
    "GRAD_LAYER_SPREAD",
    "GRAD_VANISH",
    "LOSS_STAGNANT",
    "LOSS_SWING",
    "NONFINITE_GRAD",
    "NONFINITE_LOSS",
    "NONFINITE_ROLLBACK",
    "VAL_DECLINE",
    "VAL_FLUCTUATION",
    "Alert",
    "AlertLog",
    "NonFiniteAction",
    "Severity",
    "alert_cells",
    "alert_table_markdown",
    "read_alerts",
]

logger = logging.getLogger("lightning_diag")

# Rule ids: part of the public contract (docs/alerts.md, docs/thresholds.md): never renamed; new rules get new ids.
NONFINITE_LOSS = "nonfinite_loss"
NONFINITE_GRAD = "nonfinite_grad"
NONFINITE_ROLLBACK = "nonfinite_rollback"
LOSS_SWING = "loss_swing"
VAL_DECLINE = "val_decline"
VAL_FLUCTUATION = "val_fluctuation"
GRAD_VANISH = "grad_vanish"
GRAD_EXPLODE = "grad_explode"
GRAD_LAYER_SPREAD = "grad_layer_spread"
GRAD_COLLAPSE = "grad_collapse"
GRAD_FROZEN = "grad_frozen"
LOSS_STAGNANT = "loss_stagnant"
ATTN_ENTROPY_LOW = "attn_entropy_low"
ATTN_ENTROPY_HIGH = "attn_entropy_high"
ATTN_SINK = "attn_sink"

#: Every rule id, mapped to the callback that raises it: a live view of the rule registry
#: (:mod:`lightning_diag.core.registry`), so a rule declared there is here too.
ALL_RULES: Mapping[str, str] = OWNERS

#: What :class:`~lightning_diag.AnomalyAlarm` does when it finds a non-finite loss or gradient.
NonFiniteAction = Literal["stop", "raise", "skip", "warn", "rollback"]


class Severity(str, Enum):
    """How serious an alert is. Compares equal to its string value (``Severity.WARNING == "warning"``)."""

    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"

    def __str__(self) -> str:
        return self.value

    @property
    def log_level(self) -> int:
        """The :mod:`logging` level alerts of this severity are logged at."""
        return {"info": logging.INFO, "warning": logging.WARNING, "critical": logging.CRITICAL}[self.value]


@dataclasses.dataclass(frozen=True)
class Alert:
    """One alert raised by a rule.

    Attributes:
        rule: The rule id, one of :data:`ALL_RULES`.
        severity: ``"info"``, ``"warning"`` or ``"critical"``.
        message: A sentence a person can act on.
        epoch: ``trainer.current_epoch`` when the alert was raised.
        global_step: ``trainer.global_step`` when the alert was raised.
        value: The measured value that crossed the threshold, if there is one.
        threshold: The threshold it was compared with, if there is one.
        source: What the alert is about: a layer, head, metric or parameter name.
    """

    rule: str
    severity: Severity
    message: str
    epoch: int
    global_step: int
    value: float | None
    threshold: float | None
    source: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "severity", Severity(self.severity))

    def to_dict(self) -> dict[str, Any]:
        """The alert as a JSON-ready dict with exactly the contract's fields."""
        d = dataclasses.asdict(self)
        d["severity"] = self.severity.value
        for key in ("value", "threshold"):
            v = d[key]
            if v is not None:
                v = float(v)
                # JSON has no NaN/Inf; keep the line parseable by any reader.
                d[key] = v if v == v and abs(v) != float("inf") else str(v)
        return d

    def to_json(self) -> str:
        """One JSON line (no trailing newline)."""
        return json.dumps(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Alert:
        """Inverse of :meth:`to_dict`."""
        vals = {}
        for key in ("value", "threshold"):
            v = d.get(key)
            vals[key] = float(v) if v is not None else None
        return cls(
            rule=str(d["rule"]),
            severity=Severity(d["severity"]),
            message=str(d["message"]),
            epoch=int(d["epoch"]),
            global_step=int(d["global_step"]),
            value=vals["value"],
            threshold=vals["threshold"],
            source=str(d["source"]),
        )

    @classmethod
    def from_json(cls, line: str) -> Alert:
        """Inverse of :meth:`to_json`."""
        return cls.from_dict(json.loads(line))

    def format(self) -> str:
        """A one-line human-readable form, as logged."""
        return (
            f"[{self.severity.value}] {self.rule} ({self.source}) at epoch {self.epoch}, "
            f"step {self.global_step}: {self.message}"
        )


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
        self.written: list[Alert] = []

    def write(self, alerts: Alert | Iterable[Alert]) -> None:
        """Append alerts: one JSON line each, flushed at once; logged; handed to the text sink."""
        batch = [alerts] if isinstance(alerts, Alert) else list(alerts)
        if not self.enabled or not batch:
            return
        if self.path is not None:
            if self._fd is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            # Unbuffered, one write(2) per batch of whole lines: a process killed at any moment (SIGKILL) leaves
            # only complete lines behind, and nothing waits in a Python buffer.
            _write_all(self._fd, "".join(a.to_json() + "\n" for a in batch).encode("utf-8"))
        for a in batch:
            logger.log(a.severity.log_level, a.format())
            self.written.append(a)
            if self._text_sink is not None:
                self._text_sink(a)

    def close(self) -> None:
        """Close the file (it is reopened in append mode if more alerts come)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
