"""``lightning-diag report``: a run's diagnosis from its TensorBoard event files and alert log.

Every run under the log directory is reported, one after another, with:

* the layered checklist of seed 000 §7.1 (data, model, training, deployment), each check ``pass``, ``fail``
  or ``not measured`` with the measured value beside its threshold. A check fails when one of its rules raised
  a warning or critical alert, in the run or when replayed over the logged series
  (:mod:`lightning_diag.report.checks`, which also says how a new callback adds a row);
* the alert timeline;
* optionally PNG plots (:mod:`lightning_diag.report.plots`, needs matplotlib).

The package is split into :mod:`~lightning_diag.report.load` (finding and reading runs),
:mod:`~lightning_diag.report.checks` (the checklist) and :mod:`~lightning_diag.report.render` (md, JSON, HTML).
It imports neither torch nor Lightning.

Example:
    >>> check = Check("nonfinite", "Training", "No NaN/Inf in loss or gradients", ("nonfinite_loss",))
    >>> check.status
    'not measured'
"""

from __future__ import annotations

import os
from pathlib import Path

from lightning_diag.report.checks import Check, RunReport, Status, diagnose
from lightning_diag.report.load import ALERTS_FILE, THRESHOLDS_FILE, NoDiagnosticsError, RunData, find_runs, load_run
from lightning_diag.report.render import FORMATS, Format, render

__all__ = [
    "ALERTS_FILE",
    "FORMATS",
    "THRESHOLDS_FILE",
    "Check",
    "Format",
    "NoDiagnosticsError",
    "RunData",
    "RunReport",
    "Status",
    "build_report",
    "diagnose",
    "find_runs",
    "load_run",
    "render",
]


def _slug(run: Path, root: Path) -> str:
    try:
        rel = run.resolve().relative_to(root.resolve())
    except ValueError:
        rel = Path(run.name)
    return "__".join(rel.parts) or "run"


def build_report(logdir: str | os.PathLike[str], plot_dir: str | os.PathLike[str] | None = None) -> list[RunReport]:
    """Load and diagnose every run under ``logdir``; with ``plot_dir``, draw each run's PNG plots there.

    Raises:
        FileNotFoundError: If ``logdir`` is not a directory.
        NoDiagnosticsError: If no run under it holds lightning_diag diagnostics.
    """
    root = Path(logdir)
    if not root.is_dir():
        raise FileNotFoundError(f"{logdir} is not a directory")
    runs = [load_run(p) for p in find_runs(root)]
    with_diag = [r for r in runs if r.has_diagnostics]
    if not with_diag:
        raise NoDiagnosticsError(
            f"no lightning_diag diagnostics under {logdir}: no diag/ tags in event files and no "
            "diag/alerts.jsonl or diag/thresholds.json. Attach GradientFlowMonitor or AnomalyAlarm to the Trainer "
            "and point the report at its log directory."
        )
    reports = [diagnose(r) for r in with_diag]
    if plot_dir is not None:
        try:
            from lightning_diag.report import plots  # plots reads report.load only: no import cycle
        except ImportError:  # pragma: no cover - depends on the environment
            for rep in reports:
                rep.plot_note = "plots skipped: matplotlib is not installed (pip install 'lightning-diag[plots]')"
            return reports
        for rep in reports:
            rep.plots = plots.draw_run(rep.run, Path(plot_dir) / _slug(rep.run.path, root))
    return reports
