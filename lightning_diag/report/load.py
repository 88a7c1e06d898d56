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
from lightning_diag.report.csv_metrics import METRICS_CSV, read_metrics_csv
from lightning_diag.report.event_files import (
    EventFile,
    Series,
    TagFilter,
    is_event_file,
    merge_files,
    read_event_files,
    split_fits,
)
from lightning_diag.report.safe_read import loads, read_json, read_regular
from lightning_diag.report.tag_map import is_candidate
from lightning_diag.report.text import clean, display
from lightning_diag.rules.catalog import ALL_RULES

__all__ = [
    "ALERTS_FILE",
    "THRESHOLDS_FILE",
    "NoDiagnosticsError",
    "RunData",
    "Series",
    "find_runs",
    "load_fits",
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
        user: The user's own scalars the report kept (losses, learning rates, epoch: a plain Lightning run's
            series), from the event files and a ``CSVLogger``'s ``metrics.csv``.
        fit: ``"fit 2 of 3"`` when several fits were logged into the folder (each is its own run), else ``""``.
        kind: ``"diag"`` for a run with lightning_diag diagnostics, ``"plain"`` for one judged on its own logged
            losses (:mod:`lightning_diag.report.plain`).
        mapping: For a plain run, the tag that filled each role (``train_loss``, ``val_loss``, ...).
    """

    path: Path
    scalars: dict[str, Series] = dataclasses.field(default_factory=dict)
    alerts: list[Alert] = dataclasses.field(default_factory=list)
    thresholds: dict[str, float] = dataclasses.field(default_factory=dict)
    callbacks: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    threshold_source: str = "none"
    has_layout: bool = False
    problems: list[str] = dataclasses.field(default_factory=list)
    user: dict[str, Series] = dataclasses.field(default_factory=dict)
    fit: str = ""
    kind: str = "diag"
    mapping: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        """The run's path as shown, with its fit when the folder holds several."""
        return f"{display(self.path)} ({self.fit})" if self.fit else display(self.path)

    @property
    def has_diagnostics(self) -> bool:
        """Whether anything lightning_diag writes is in this run."""
        return bool(self.scalars or self.alerts or self.callbacks)

    def tags(self, prefix: str) -> list[str]:
        """Scalar tags starting with ``prefix``, sorted."""
        return sorted(t for t in self.scalars if t.startswith(prefix))

    def diag_json(self, name: str) -> Any:
        """The JSON file ``diag/<name>`` of the run, read with :func:`read_json`.

        Raises:
            OSError: If it is not a regular file or cannot be read.
            ValueError: If it is not valid UTF-8 or JSON.
        """
        return read_json(self.path / "diag" / name)


# -- finding and loading runs ---------------------------------------------------------------------------


def find_runs(logdir: str | os.PathLike[str]) -> list[Path]:
    """Run directories under ``logdir`` (itself included), sorted by path.

    A directory is a run when it holds event files or a ``CSVLogger``'s ``metrics.csv``, or a ``diag/`` folder
    with ``alerts.jsonl`` or ``thresholds.json``. Event files inside a ``diag/`` folder (the library's own writer,
    used when the trainer has no TensorBoard logger) belong to the folder's parent. Symbolic links to folders are
    followed (``logs/latest -> version_3``), each folder is visited once, and a run reached both directly and
    through a link is listed once, under its own path.
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
        has_events = any(is_event_file(f) for f in filenames) or (here.name != "diag" and METRICS_CSV in filenames)
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


def load_run(path: str | os.PathLike[str], keep: TagFilter = is_candidate) -> RunData:
    """Read one run: the event files in ``path`` and ``path/diag``, the alert log and the thresholds.

    When several fits were logged into the folder this is the last of them (:func:`load_fits` gives each), with
    a problem line saying so.
    """
    fits = load_fits(path, keep)
    last = fits[-1]
    if len(fits) > 1:
        last.problems.append(f"{display(last.path)}: only the last of {len(fits)} fits is read here (load_fits)")
    return last


def load_fits(path: str | os.PathLike[str], keep: TagFilter = is_candidate) -> list[RunData]:
    """Read one run folder, one :class:`RunData` per fit logged into it (the first fit first).

    Two fits logged into one folder (``logger=False`` and one ``default_root_dir``, or one TensorBoard version
    folder) are told apart by their event files: a file whose series start again at or before the step they
    started at in the fit before is a new fit (:func:`~lightning_diag.report.event_files.split_fits`). The alert
    log is shared out in file order by the count of the alert table each fit wrote; ``thresholds.json`` and
    ``run.json`` are the last fit's (an earlier fit's thresholds come from its own event files' text).

    Args:
        path: The run folder.
        keep: Which of the user's own tags to keep in :attr:`RunData.user` (by default the losses, learning
            rates and epoch a plain run is judged on).
    """
    root = Path(path)
    diag = root / "diag"
    problems: list[str] = []
    files: list[EventFile] = []
    for directory in (root, diag):
        try:
            if directory.is_dir() and any(is_event_file(f.name) for f in directory.iterdir()):
                files += read_event_files(directory, problems, keep)
        except Exception as err:  # an unreadable folder or a damaged file is reported, never a traceback
            problems.append(f"{display(directory)}: could not read the event files: {clean(err)}")
    files.sort(key=lambda f: f.order)  # the order written, across the two folders
    groups = split_fits(files)
    csv_series: dict[str, Series] = {}
    if os.path.lexists(root / METRICS_CSV):
        csv_series = read_metrics_csv(root / METRICS_CSV, keep, problems)
    alerts = _read_alerts(diag / ALERTS_FILE, problems) if os.path.lexists(diag / ALERTS_FILE) else []
    logged = None
    if os.path.lexists(diag / THRESHOLDS_FILE):
        logged = _read_thresholds_json(diag / THRESHOLDS_FILE, problems)
    merged = [merge_files(group, problems) for group in groups]
    shares = _share_alerts(alerts, [m.alert_count for m in merged], root, problems)
    runs: list[RunData] = []
    for i, (group, events, own) in enumerate(zip(groups, merged, shares, strict=True)):
        run = RunData(root, scalars=events.scalars, alerts=own, problems=list(problems), user=events.user)
        run.has_layout = events.has_layout
        last = i == len(groups) - 1
        if last:  # the CSVLogger file is rewritten by each fit: the last one's
            for name, series in csv_series.items():
                target = run.scalars if name.startswith("diag/") else run.user
                if name not in target:
                    target[name] = series
        if len(groups) > 1:
            run.fit = f"fit {i + 1} of {len(groups)}"
            names = ", ".join(f.path.name for f in group)
            run.problems.append(
                f"{display(root)}: {len(groups)} fits were logged into this folder (their steps start again); "
                f"reported as {len(groups)} runs, this is {run.fit} ({names}). Give each fit its own "
                "default_root_dir or a logger"
            )
        _settle_thresholds(run, logged if last or not events.texts else None, events.texts)
        runs.append(run)
    return runs


def _read_thresholds_json(path: Path, problems: list[str]) -> dict[str, dict[str, float]] | None:
    """``thresholds.json``'s callbacks with their checked thresholds, or ``None`` with a problem line when it
    cannot be read."""
    try:
        logged = read_json(path)
        return {str(k): _checked(str(k), d, path, problems) for k, d in logged["callbacks"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        reason = f"no key {err}" if isinstance(err, KeyError) else clean(err)
        problems.append(f"{display(path)}: could not be read ({reason}); the defaults are used")
        return None


def _share_alerts(alerts: list[Alert], counts: list[int | None], root: Path, problems: list[str]) -> list[list[Alert]]:
    """The alerts of each fit: the alert log in file order, cut by the count of the alert table each fit wrote.

    With one fit, all of them. When the counts do not add up to the log (a log cut short, a table not written),
    they cannot be told apart: all go to the last fit, said in ``problems``.
    """
    if len(counts) == 1:
        return [alerts]
    wanted = [c or 0 for c in counts]
    if sum(wanted) != len(alerts):
        if alerts:
            problems.append(
                f"{display(root / 'diag' / ALERTS_FILE)}: {len(alerts)} alert(s) for {len(counts)} fits whose alert "
                f"tables count {sum(wanted)}: they cannot be told apart and are shown with the last fit"
            )
        return [[] for _ in counts[:-1]] + [alerts]
    out, at = [], 0
    for n in wanted:
        out.append(alerts[at : at + n])
        at += n
    return out


def _settle_thresholds(run: RunData, logged: dict[str, dict[str, float]] | None, texts: list[tuple[str, str]]) -> None:
    """The run's callbacks and thresholds: ``thresholds.json`` (``logged``), else the ``diag/thresholds`` text of
    its event files, else its alerts' thresholds over the library's defaults."""
    if logged is not None:
        run.callbacks = {k: dict(v) for k, v in logged.items()}
        run.threshold_source = f"diag/{THRESHOLDS_FILE}"
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
