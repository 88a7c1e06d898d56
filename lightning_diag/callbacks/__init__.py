"""Thin Lightning adapters over ``stats/`` and ``rules/``."""

from lightning_diag.callbacks.anomaly_alarm import AnomalyAlarm, NonFiniteError
from lightning_diag.callbacks.base import DiagCallback

__all__ = ["AnomalyAlarm", "DiagCallback", "NonFiniteError"]
