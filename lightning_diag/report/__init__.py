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

import importlib
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from lightning_diag.report.checks import RunReport, diagnose
from lightning_diag.report.load import (
    ALERTS_FILE,
    THRESHOLDS_FILE,
    NoDiagnosticsError,
    RunData,
    find_runs,
    load_fits,
    load_run,
)
from lightning_diag.report.plain import diagnose_plain, map_plain_run
from lightning_diag.report.render import FORMATS, Format, render, render_stream
from lightning_diag.report.tag_map import is_candidate
from lightning_diag.rules.rows import Check, Status

__all__ = [
    "ALERTS_FILE",
    "FAIL_ON",
    "FORMATS",
    "THRESHOLDS_FILE",
    "Check",
    "FailOn",
    "Format",
    "NoDiagnosticsError",
    "RunData",
    "RunReport",
    "Status",
    "build_report",
    "diagnose",
    "find_runs",
    "gate",
    "iter_reports",
    "load_fits",
    "load_run",
    "render",
    "render_stream",
]

#: ``lightning-diag report --fail-on`` levels.
FailOn = Literal["never", "warning", "critical"]
FAIL_ON: tuple[str, ...] = ("never", "warning", "critical")


def _slug(run: Path, root: Path) -> str:
    try:
        rel = run.resolve().relative_to(root.resolve())
    except ValueError:
        rel = Path(run.name)
    return "__".join(rel.parts) or "run"


def build_report(
    logdir: str | os.PathLike[str],
    plot_dir: str | os.PathLike[str] | None = None,
    mapping: Mapping[str, str] | None = None,
) -> list[RunReport]:
    """Load and diagnose every run under ``logdir``; with ``plot_dir``, draw each run's PNG plots there.

    Every run's series stay in memory; :func:`iter_reports` reports one run at a time instead. ``mapping``
    overrides the tags of plain runs (as :func:`iter_reports`).

    Raises:
        FileNotFoundError: If ``logdir`` is not a directory.
        NoDiagnosticsError: If no run under it holds lightning_diag diagnostics.
    """
    return list(iter_reports(logdir, plot_dir=plot_dir, keep_series=True, mapping=mapping))


def iter_reports(
    logdir: str | os.PathLike[str],
    plot_dir: str | os.PathLike[str] | None = None,
    keep_series: bool = False,
    progress: Callable[[int, int, Path], None] | None = None,
    mapping: Mapping[str, str] | None = None,
) -> Iterator[RunReport]:
    """Load, diagnose (and plot) the runs under ``logdir`` one at a time, in path order.

    A folder into which several fits were logged gives one report per fit. A run without lightning_diag
    diagnostics whose own logged losses are found (TensorBoard or ``CSVLogger``) is a *plain* run, judged on them
    (:mod:`lightning_diag.report.plain`); one with neither is left out.

    Memory is bounded by the largest run: a run is read only when the previous one has been handed on, and
    unless ``keep_series`` its scalar series are dropped from the report once it is diagnosed and plotted (the
    checklist, alerts and thresholds stay).

    Args:
        logdir: A run's folder or a folder of runs.
        plot_dir: Draw each run's PNG plots into ``plot_dir/<run path relative to logdir>``.
        keep_series: Keep :attr:`RunData.scalars` in the reports.
        progress: Called with ``(index, total, run path)`` before each run is read (``index`` from 0).
        mapping: ``{role: tag}`` overriding the automatic choice of a plain run's loss tags (roles:
            :data:`lightning_diag.report.tag_map.ROLES`; ``lightning-diag report --map ROLE=TAG``).

    Raises:
        FileNotFoundError: If ``logdir`` is not a directory.
        NoDiagnosticsError: If no run under it holds lightning_diag diagnostics or a logged loss (raised when
            the last run has been read without any).
    """
    root = Path(logdir)
    if not root.is_dir():
        raise FileNotFoundError(f"{logdir} is not a directory")
    paths = find_runs(root)
    plots: Any = None
    plot_note = ""
    if plot_dir is not None:
        try:
            plots = importlib.import_module("lightning_diag.report.plots")  # reads report.load only: no cycle
        except ImportError:  # pragma: no cover - depends on the environment
            plot_note = "plots skipped: matplotlib is not installed (pip install 'lightning-diag[plots]')"
    overrides = dict(mapping or {})
    wanted = set(overrides.values())

    def keep(name: str) -> bool:
        return is_candidate(name) or name in wanted

    found = 0
    for i, path in enumerate(paths):
        if progress is not None:
            progress(i, len(paths), path)
        fits = load_fits(path, keep)
        for number, run in enumerate(fits, 1):
            if run.has_diagnostics:
                rep = diagnose(run)
            elif map_plain_run(run, overrides):
                rep = diagnose_plain(run)
            else:
                continue
            found += 1
            rep.plot_note = plot_note
            if plots is not None and plot_dir is not None:
                slug = _slug(rep.run.path, root) + (f"__fit{number}" if run.fit else "")
                rep.plots = plots.draw_run(rep.run, Path(plot_dir) / slug)
            if not keep_series:
                rep.run.scalars, rep.run.user = {}, {}
            yield rep
    if not found:
        raise NoDiagnosticsError(
            f"no lightning_diag diagnostics and no logged loss under {logdir}: no diag/ tags or loss scalars in "
            "event files or metrics.csv, no diag/alerts.jsonl or diag/thresholds.json. Log a loss with "
            "self.log('train_loss', ...) (or name yours with --map train_loss=TAG), or attach AnomalyAlarm."
        )


def gate(report: RunReport, fail_on: FailOn) -> list[str]:
    """Why ``report`` fails the CI gate ``fail_on``: its alerts and FAIL rows at that level or above.

    ``"warning"`` counts warning and critical alerts and every FAIL row; ``"critical"`` only critical alerts and
    FAIL rows failed by a critical alert; ``"never"`` nothing.

    Example:
        >>> from lightning_diag.report.load import RunData
        >>> rep = RunReport(RunData(Path("run")), [Check("x", "Training", "t", ("loss_swing",), status="fail",
        ...                 severity="warning")])
        >>> gate(rep, "warning"), gate(rep, "critical")
        (['FAIL row x (warning)'], [])
    """
    if fail_on not in FAIL_ON:
        raise ValueError(f"`fail_on` can be {', '.join(FAIL_ON)}, got {fail_on!r}")
    if fail_on == "never":
        return []
    levels = ("warning", "critical") if fail_on == "warning" else ("critical",)
    reasons = [
        f"{a.severity.value} alert {a.rule} at step {a.global_step} ({a.source})"
        for a in report.timeline
        if a.severity.value in levels
    ]
    reasons += [
        f"FAIL row {c.id} ({c.severity or 'warning'})"
        for c in report.checks
        if c.status == "fail" and (c.severity or "warning") in levels
    ]
    return reasons
