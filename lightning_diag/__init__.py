"""lightning_diag: PyTorch Lightning callbacks that diagnose training runs from the inside."""

import logging as _logging

from lightning_diag.alerts import Alert, AlertLog, Severity, read_alerts
from lightning_diag.attention import attention_requested, record_attention, record_hf_attentions
from lightning_diag.callbacks.anomaly_alarm import AnomalyAlarm, NonFiniteError
from lightning_diag.callbacks.attention_entropy import AttentionEntropyMonitor
from lightning_diag.callbacks.gradient_flow import GradientFlowMonitor
from lightning_diag.callbacks.quantization_probe import QuantizationProbe
from lightning_diag.callbacks.sharpness_probe import SharpnessProbe

__version__ = "0.1.0"

__all__ = [
    "Alert",
    "AlertLog",
    "AnomalyAlarm",
    "AttentionEntropyMonitor",
    "GradientFlowMonitor",
    "NonFiniteError",
    "QuantizationProbe",
    "Severity",
    "SharpnessProbe",
    "__version__",
    "attention_requested",
    "read_alerts",
    "record_attention",
    "record_hf_attentions",
]

_logger = _logging.getLogger("lightning_diag")
if not _logger.handlers:
    _handler = _logging.StreamHandler()
    _handler.setFormatter(_logging.Formatter("lightning_diag %(levelname)s: %(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(_logging.INFO)
    _logger.propagate = False
