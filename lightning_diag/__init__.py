"""lightning_diag: PyTorch Lightning callbacks that diagnose training runs from the inside.

The package root is lazy (PEP 562): ``import lightning_diag`` loads neither torch nor Lightning, and each public
name is imported from its module on first use, so ``lightning-diag report`` and ``import lightning_diag.report``
stay light. A new callback (or settings class) is added with one entry in :data:`_LAZY` (and one in ``__all__``).

Logging follows the library convention: the ``lightning_diag`` logger gets a :class:`logging.NullHandler` at
import; the visible stream handler is installed only when a callback is first set up and the application has
configured no handler of its own (see :func:`lightning_diag.core.log_handler.ensure_handler`).
"""

from __future__ import annotations

import importlib
import logging as _logging
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_LAZY: dict[str, str] = {
    "Alert": "lightning_diag.core.alerts",
    "AlertLog": "lightning_diag.core.alerts",
    "Severity": "lightning_diag.core.alerts",
    "read_alerts": "lightning_diag.core.alerts",
    "attention_requested": "lightning_diag.instrument.attention_record",
    "record_attention": "lightning_diag.instrument.attention_record",
    "record_hf_attentions": "lightning_diag.instrument.attention_record",
    "AnomalyAlarm": "lightning_diag.callbacks.anomaly_alarm.alarm",
    "NonFiniteError": "lightning_diag.callbacks.anomaly_alarm.alarm",
    "AttentionEntropyMonitor": "lightning_diag.callbacks.attention_entropy.monitor",
    "DataDiagnostics": "lightning_diag.callbacks.data_diagnostics.diagnostics",
    "ErrorAnalysis": "lightning_diag.callbacks.error_analysis.analysis",
    "GradientFlowMonitor": "lightning_diag.callbacks.gradient_flow.monitor",
    "QuantizationProbe": "lightning_diag.callbacks.probes.quantization",
    "RobustnessProbe": "lightning_diag.callbacks.probes.robustness",
    "SharpnessProbe": "lightning_diag.callbacks.probes.sharpness",
    "SystemMonitor": "lightning_diag.callbacks.system_monitor.monitor",
    "SystemProfiler": "lightning_diag.callbacks.system_monitor.monitor",
}

__all__ = [
    "Alert",
    "AlertLog",
    "AnomalyAlarm",
    "AttentionEntropyMonitor",
    "DataDiagnostics",
    "ErrorAnalysis",
    "GradientFlowMonitor",
    "NonFiniteError",
    "QuantizationProbe",
    "RobustnessProbe",
    "Severity",
    "SharpnessProbe",
    "SystemMonitor",
    "SystemProfiler",
    "__version__",
    "attention_requested",
    "read_alerts",
    "record_attention",
    "record_hf_attentions",
]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from lightning_diag.callbacks.anomaly_alarm.alarm import AnomalyAlarm, NonFiniteError
    from lightning_diag.callbacks.attention_entropy.monitor import AttentionEntropyMonitor
    from lightning_diag.callbacks.data_diagnostics.diagnostics import DataDiagnostics
    from lightning_diag.callbacks.error_analysis.analysis import ErrorAnalysis
    from lightning_diag.callbacks.gradient_flow.monitor import GradientFlowMonitor
    from lightning_diag.callbacks.probes.quantization import QuantizationProbe
    from lightning_diag.callbacks.probes.robustness import RobustnessProbe
    from lightning_diag.callbacks.probes.sharpness import SharpnessProbe
    from lightning_diag.callbacks.system_monitor.monitor import SystemMonitor, SystemProfiler
    from lightning_diag.core.alerts import Alert, AlertLog, Severity, read_alerts
    from lightning_diag.instrument.attention_record import attention_requested, record_attention, record_hf_attentions


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_diag' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


_logging.getLogger("lightning_diag").addHandler(_logging.NullHandler())
