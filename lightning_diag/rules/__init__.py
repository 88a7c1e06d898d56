"""Stateful detectors in plain Python: feed values in, get Alerts out. Never imports Lightning."""

from lightning_diag.rules.anomaly import LossStagnantRule, LossSwingRule, ValDeclineRule, ValFluctuationRule
from lightning_diag.rules.base import Latch, Rule, StepContext

__all__ = ["Latch", "LossStagnantRule", "LossSwingRule", "Rule", "StepContext", "ValDeclineRule", "ValFluctuationRule"]
