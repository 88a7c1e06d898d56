"""Thin Lightning adapters over ``stats/`` and ``rules/``."""

from lightning_diag.callbacks.anomaly_alarm import AnomalyAlarm, NonFiniteError
from lightning_diag.callbacks.attention_entropy import AttentionEntropyMonitor
from lightning_diag.callbacks.base import DiagCallback
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
