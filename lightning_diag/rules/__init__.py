"""Stateful detectors in plain Python: judge measurements (:class:`Measures`), get Alerts out. Never imports Lightning.

Lazy (PEP 562): importing ``lightning_diag.core.registry`` (the report does) loads no rule module.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY: dict[str, str] = {
    "Latch": "lightning_diag.rules.base",
    "Rule": "lightning_diag.rules.base",
    "StepContext": "lightning_diag.rules.base",
    "Measure": "lightning_diag.rules.measures",
    "Measures": "lightning_diag.rules.measures",
    "LossStagnantRule": "lightning_diag.rules.loss_stagnant",
    "LossSwingRule": "lightning_diag.rules.loss_swing",
    "ValDeclineRule": "lightning_diag.rules.val_decline",
    "ValFluctuationRule": "lightning_diag.rules.val_fluctuation",
}

__all__ = [
    "Latch",
    "LossStagnantRule",
    "LossSwingRule",
    "Measure",
    "Measures",
    "Rule",
    "StepContext",
    "ValDeclineRule",
    "ValFluctuationRule",
]

if TYPE_CHECKING:  # pragma: no cover
    from lightning_diag.rules.base import Latch, Rule, StepContext
    from lightning_diag.rules.loss_stagnant import LossStagnantRule
    from lightning_diag.rules.loss_swing import LossSwingRule
    from lightning_diag.rules.measures import Measure, Measures
    from lightning_diag.rules.val_decline import ValDeclineRule
    from lightning_diag.rules.val_fluctuation import ValFluctuationRule


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_diag.rules' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
