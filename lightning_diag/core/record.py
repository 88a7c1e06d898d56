"""The record every rule produces: :class:`Alert` and :class:`Severity` (standard library only).

This is the bottom of the package: the rules (``lightning_diag.rules``) build their alerts with it, and
:mod:`lightning_diag.core.alerts` (the alert log and the public rule ids, which reads the rules' declarations)
re-exports it, so ``from lightning_diag.core.alerts import Alert`` keeps working.

Example:
    >>> a = Alert(rule="some_rule", severity=Severity.WARNING, message="loss swings", epoch=3,
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
from enum import Enum
from typing import Any, Literal

__all__ = ["Alert", "NonFiniteAction", "Severity"]

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
