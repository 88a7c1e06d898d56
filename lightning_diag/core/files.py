"""The names of the files a run's ``diag/`` folder holds, shared by the callbacks that write them and the report
that reads them (stdlib only)."""

from __future__ import annotations

__all__ = ["ALERTS_FILE", "THRESHOLDS_FILE"]

#: The alert log, one JSON object per line (:class:`~lightning_diag.core.alerts.AlertLog`).
ALERTS_FILE = "alerts.jsonl"
#: The thresholds in effect for the fit, by callback and merged (written once per fit on rank zero).
THRESHOLDS_FILE = "thresholds.json"
