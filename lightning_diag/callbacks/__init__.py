"""Thin Lightning adapters over ``stats/`` and ``rules/``.

One subpackage per public callback, named after it, holding every module only that callback uses
(``anomaly_alarm/``, ``gradient_flow/``, ``attention_entropy/``, ``data_diagnostics/``, ``error_analysis/``,
``system_monitor/``; ``probes/`` holds the three validation-end probes and their shared base), and ``common/`` for
the machinery every callback shares (``DiagCallback``, the per-trainer session, the step axis).
"""

from lightning_diag.callbacks.anomaly_alarm import AnomalyAlarm, NonFiniteError
from lightning_diag.callbacks.attention_entropy import AttentionEntropyMonitor
from lightning_diag.callbacks.common.base import DiagCallback
from lightning_diag.callbacks.data_diagnostics import DataDiagnostics
from lightning_diag.callbacks.gradient_flow import GradientFlowMonitor

__all__ = [
    "AnomalyAlarm",
    "AttentionEntropyMonitor",
    "DataDiagnostics",
    "DiagCallback",
    "GradientFlowMonitor",
    "NonFiniteError",
]
