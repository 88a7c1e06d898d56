"""Loading a run for ``lightning-diag report``: its ``diag/`` scalars, alert log and thresholds.

A *run* is a directory holding ``diag/`` tags in event files (streamed record by record, keeping only ``diag/``
tags: :mod:`lightning_diag.report.event_files`), a ``diag/alerts.jsonl`` or a ``diag/thresholds.json``; one run
per diag folder, so the per-run folders of W&B and MLflow runs (``<save_dir>/<name>/<version>/diag``) are
separate runs. Thresholds come from what the run logged: ``diag/thresholds.json``, else the ``diag/thresholds``
text in the event file, else the ``threshold`` of the run's alerts, else the library's defaults from the rule
registry (marked as such). Every file is read through :mod:`lightning_diag.report.safe_read` (whose
``read_json`` and ``read_regular`` are importable from here too). Imports neither torch nor Lightning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
from pathlib import Path
from typing import Any

from lightning_diag.core.alerts import Alert
from lightning_diag.core.files import ALERTS_FILE, THRESHOLDS_FILE
from lightning_diag.core.registry import default_thresholds
from lightning_diag.core.tags import prefix
from lightning_diag.report.event_files import EventData, Series, is_event_file, read_events
from lightning_diag.report.safe_read import NotRegularFileError, loads, read_json, read_regular
from lightning_diag.report.text import clean, display
from lightning_diag.rules.catalog import ALL_RULES

__all__ = [
    "ALERTS_FILE",
    "THRESHOLDS_FILE",
    "NoDiagnosticsError",
    "NotRegularFileError",
    "RunData",
    "Series",
    "find_runs",
    "load_run",
    "read_json",
    "read_regular",
]

# Which callback measures which tags, for runs that logged no thresholds.json.
_TAG_OWNERS = {
    prefix("grad_norm"): "GradientFlowMonitor",
    prefix("loss"): "AnomalyAlarm",
    prefix("lr"): "AnomalyAlarm",
    prefix("attn_entropy"): "AttentionEntropyMonitor",
}


class NoDiagnosticsError(ValueError):
    """Raised when a log directory holds no lightning_diag diagnostics."""


@dataclasses.dataclass
class RunData:
    """What one run logged.

    Attributes:
        path: The run directory (``trainer.log_dir``).
        scalars: ``diag/`` scalar tag -> ``(step, value)`` points in step order.
        alerts: The alerts of ``diag/alerts.jsonl``, in file order.
        thresholds: Rule id (or ``"<rule>.<setting>"``) -> value, as the run logged them.
        callbacks: The lightning_diag callbacks the run had, with their thresholds (empty if unknown).
        threshold_source: Where :attr:`thresholds` came from.
        has_layout: Whether the event files hold a custom-scalars dashboard layout.
        problems: What could not be read or was left out, one line each naming the file and the reason.
    """

    path: Path
    scalars: dict[str, Series] = dataclasses.field(default_factory=dict)
    alerts: list[Alert] = dataclasses.field(default_factory=list)
    thresholds: dict[str, float] = dataclasses.field(default_factory=dict)
    callbacks: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    threshold_source: str = "none"
    has_layout: bool = False
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def has_diagnostics(self) -> bool:
        """Whether anything lightning_diag writes is in this run."""
        return bool(self.scalars or self.alerts or self.callbacks)

    def tags(self, prefix: str) -> list[str]:
        """Scalar tags starting with ``prefix``, sorted."""
        return sorted(t for t in self.scalars if t.startswith(prefix))


# -- finding and loading runs ---------------------------------------------------------------------------


def find_runs(logdir: str | os.PathLike[str]) -> list[Path]:
    """Run directories under ``logdir`` (itself included), sorted by path.

    A directory is a run when it holds event files, or a ``diag/`` folder with ``alerts.jsonl`` or
    ``thresholds.json``. Event files inside a ``diag/`` folder (the library's own writer, used when the trainer
    has no TensorBoard logger) belong to the folder's parent. Symbolic links to folders are followed
    (``logs/latest -> version_3``), each folder is visited once, and a run reached both directly and through a
    link is listed once, under its own path.
    """
    root = Path(logdir)
    runs: dict[str, Path] = {}  # real path -> the path it is listed under
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:  # a link cycle, or a folder reached a second time
            dirnames[:] = []
            continue
        seen.add(real)
        # real folders before links, so a run reached both ways is listed under its own path
        dirnames.sort(key=lambda d: (os.path.islink(os.path.join(dirpath, d)), d))
        here = Path(dirpath)
        has_events = any(is_event_file(f) for f in filenames)
        has_diag_files = here.name == "diag" and (ALERTS_FILE in filenames or THRESHOLDS_FILE in filenames)
        if has_diag_files or (has_events and here.name == "diag" and here != root):
            runs.setdefault(os.path.realpath(here.parent), here.parent)
        elif has_events:
            runs.setdefault(real, here)
    return sorted(set(runs.values()))


def _thresholds_from_text(text: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3:
            continue
        try:
            value = float(cells[2])
        except ValueError:
            continue
        out.setdefault(cells[0], {})[cells[1]] = value
    return out


def load_run(path: str | os.PathLike[str]) -> RunData:
    """Read one run: the event files in ``path`` and ``path/diag``, the alert log and the thresholds."""
    run = RunData(Path(path))
    diag = run.path / "diag"
    events = EventData(run.scalars)
    for directory in (run.path, diag):
        try:
            if directory.is_dir() and any(is_event_file(f.name) for f in directory.iterdir()):
                read_events(directory, events, run.problems)
        except Exception as err:  # an unreadable folder or a damaged file is reported, never a traceback
            run.problems.append(f"{display(directory)}: could not read the event files: {clean(err)}")
    run.has_layout, texts = events.has_layout, events.texts
    if os.path.lexists(diag / ALERTS_FILE):
        run.alerts = _read_alerts(diag / ALERTS_FILE, run.problems)
    if os.path.lexists(diag / THRESHOLDS_FILE):
        path = diag / THRESHOLDS_FILE
        try:
            logged = read_json(path)
            run.callbacks = {str(k): _checked(str(k), d, path, run.problems) for k, d in logged["callbacks"].items()}
            run.threshold_source = f"diag/{THRESHOLDS_FILE}"
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            run.callbacks = {}
            reason = f"no key {err}" if isinstance(err, KeyError) else clean(err)
            run.problems.append(f"{display(path)}: could not be read ({reason}); the defaults are used")
    if not run.callbacks and texts:
        for name, text in texts:
            for owner, values in _thresholds_from_text(text).items():
                run.callbacks[owner] = _checked(owner, values, run.path / name, run.problems)
        if run.callbacks:
            run.threshold_source = "diag/thresholds text in the event file"
    for values in run.callbacks.values():
        run.thresholds.update(values)
    # finite thresholds only: an alert line may carry "nan" or 1e400
    usable = {a.rule: a.threshold for a in run.alerts if a.threshold is not None and math.isfinite(a.threshold)}
    for rule, threshold in usable.items():  # a callback that logged no thresholds still put them in its alerts
        if run.callbacks and rule not in run.thresholds:
            run.thresholds[rule] = threshold
    if not run.callbacks:
        owners = {owner for prefix, owner in _TAG_OWNERS.items() if run.tags(prefix)}
        owners |= {ALL_RULES[a.rule] for a in run.alerts if a.rule in ALL_RULES}
        run.callbacks = {owner: {} for owner in sorted(owners)}
        run.thresholds = {**default_thresholds(), **usable}
        run.threshold_source = "not logged: alert thresholds and the library's current defaults"
    return run


def _read_alerts(path: Path, problems: list[str]) -> list[Alert]:
    """The alerts of an ``alerts.jsonl``; what cannot be read is skipped and said once in ``problems``.

    Bytes that are not UTF-8 are replaced (U+FFFD) and the line is read; a line that is not an alert (bad
    JSON, nesting too deep, a missing field, a number out of range) is skipped and counted. A torn last line
    (a run killed mid-write, or still writing) is skipped silently.
    """
    try:
        data = read_regular(path)
    except OSError as err:
        problems.append(f"{display(path)}: skipped: {clean(err)}")
        return []
    lines = data.split(b"\n")
    torn = lines.pop() if lines else b""  # after the last newline: empty, or a torn line
    alerts: list[Alert] = []
    undecodable, skipped, first = 0, 0, ""
    for number, raw in enumerate(lines, 1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            undecodable += 1
            text = raw.decode("utf-8", "replace")
        if not text.strip():
            continue
        try:
            alerts.append(Alert.from_dict(loads(text)))
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as err:
            skipped += 1
            if not first:
                reason = f"no field {err}" if isinstance(err, KeyError) else clean(err)
                first = f"line {number}: {reason}"
    if torn.strip():
        with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError, OverflowError):
            alerts.append(Alert.from_dict(loads(torn.decode("utf-8", "replace"))))
    if undecodable:
        problems.append(f"{display(path)}: {undecodable} line(s) with bytes that are not UTF-8, read with U+FFFD")
    if skipped:
        problems.append(f"{display(path)}: {skipped} line(s) that are not alerts were skipped (first at {first})")
    return alerts


# Settings that count something (measurements, steps, samples): a whole number of at least 1 (0 allowed for
# warm-ups and maxima), at most _MAX_COUNT.
_COUNT = re.compile(
    r"(patience|window|steps|measurements|size|count|snapshots|num_perm|queries|batches|leaks|"
    r"rollbacks|skips|overflows|every_n)"
)
_MAX_COUNT = 1_000_000


def _checked(owner: str, values: Any, path: Path, problems: list[str]) -> dict[str, float]:
    """One callback's logged thresholds, each a finite number (counts whole and in range); an entry that is
    not is replaced by the library's declared default, with a line in ``problems``."""
    defaults = default_thresholds()
    out: dict[str, float] = {}
    for key, raw in values.items():
        key = str(key)
        why = _invalid(key, raw, defaults.get(key))
        if why is None:
            out[key] = float(raw)
            continue
        fallback = defaults.get(key)
        used = f"the default {fallback:g} is used" if fallback is not None else "left out (no declared default)"
        problems.append(f"{display(path)}: {clean(owner)} {clean(key)} = {clean(repr(raw))[:40]} {why}; {used}")
        if fallback is not None:
            out[key] = fallback
    return out


def _invalid(key: str, raw: Any, fallback: float | None) -> str | None:
    """Why a logged threshold cannot be used, or ``None``."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        return "is not a number"
    try:
        value = float(raw)
    except OverflowError:
        return "is too large"
    if not math.isfinite(value):
        return "is not finite"
    name = key.rsplit(".", 1)[-1]
    if "." in key and fallback is not None and fallback == int(fallback) and _COUNT.search(name):
        low = 0 if ("warmup" in name or name.startswith("max_")) else 1
        if value != int(value) or not low <= value <= _MAX_COUNT:
            return f"is not a whole number in {low} .. {_MAX_COUNT}"
    return None
