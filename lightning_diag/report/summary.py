"""One summary line per run for ``lightning-diag report`` on a tree of runs, the worst run first.

A run's line says its verdict (``FAIL (critical)``, ``FAIL``, ``ok``, or ``not judged`` when nothing was measured),
its counts, what it was judged on (lightning_diag diagnostics, or a plain run's own losses) and its first finding.
Runs sort by: a critical failure, then the number of failing rows, then the number of warning and critical
alerts, then the path. Imports neither torch nor Lightning.

Example:
    >>> from pathlib import Path
    >>> from lightning_diag.report.load import RunData
    >>> from lightning_diag.report.checks import RunReport
    >>> from lightning_diag.rules.rows import Check
    >>> bad = RunReport(RunData(Path("b")), [Check("x", "Training", "t", (), status="fail", severity="warning")])
    >>> good = RunReport(RunData(Path("a")), [Check("y", "Training", "t", (), status="pass")])
    >>> [(line.run, line.verdict) for line in sorted([summarize(good), summarize(bad)], key=SummaryLine.key)]
    [('b', 'FAIL'), ('a', 'ok')]
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lightning_diag.report.checks import RunReport

__all__ = ["SummaryLine", "summarize"]


@dataclasses.dataclass(frozen=True)
class SummaryLine:
    """One run's line.

    Attributes:
        run: The run as shown (its path, and its fit when the folder holds several).
        kind: ``"diag"`` or ``"plain"``.
        verdict: ``"FAIL (critical)"``, ``"FAIL"``, ``"ok"`` or ``"not judged"``.
        fail, passed, not_measured: The checklist's counts.
        alerts: Warning and critical alerts (logged, or found by the replay for a plain run).
        finding: The first failing row and its measured value (``""`` when none).
    """

    run: str
    kind: str
    verdict: str
    fail: int
    passed: int
    not_measured: int
    alerts: int
    finding: str

    def key(self) -> tuple[int, int, int, str]:
        """Sort key: the worst run first."""
        return (-int(self.verdict == "FAIL (critical)"), -self.fail, -self.alerts, self.run)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)


def summarize(rep: RunReport) -> SummaryLine:
    """The summary line of one report."""
    counts = rep.counts
    failing = [c for c in rep.checks if c.status == "fail"]
    if any(c.severity == "critical" for c in failing):
        verdict = "FAIL (critical)"
    elif failing:
        verdict = "FAIL"
    elif counts["pass"]:
        verdict = "ok"
    else:
        verdict = "not judged"
    first = min(failing, key=lambda c: (c.first_alert_step is None, c.first_alert_step or 0), default=None)
    finding = f"{first.id}: {first.measured or ''}".rstrip(": ") if first is not None else ""
    alerts = sum(1 for a in rep.run.alerts if a.severity != "info")
    return SummaryLine(
        rep.run.name, rep.run.kind, verdict, counts["fail"], counts["pass"], counts["not measured"], alerts, finding
    )
