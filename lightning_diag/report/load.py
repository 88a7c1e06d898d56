"""Loading a run for ``lightning-diag report``: its ``diag/`` scalars, alert log and thresholds.

A *run* is a directory holding ``diag/`` tags in event files (streamed with TensorBoard's own
:class:`~tensorboard.backend.event_processing.event_file_loader.EventFileLoader`, keeping only ``diag/`` tags), a
``diag/alerts.jsonl`` or a ``diag/thresholds.json``; one run per diag folder, so the per-run folders of W&B and
MLflow runs (``<save_dir>/<name>/<version>/diag``) are separate runs. Thresholds come from what the run logged:
``diag/thresholds.json``, else the ``diag/thresholds`` text in the event file, else the ``threshold`` of the
run's alerts, else the library's defaults from the rule registry (marked as such). Imports neither torch nor Lightning.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from lightning_diag.core.alerts import Alert, read_alerts
from lightning_diag.core.files import ALERTS_FILE, THRESHOLDS_FILE
from lightning_diag.core.registry import default_thresholds
from lightning_diag.core.tags import prefix
from lightning_diag.rules.catalog import ALL_RULES

__all__ = ["ALERTS_FILE", "THRESHOLDS_FILE", "NoDiagnosticsError", "RunData", "Series", "find_runs", "load_run"]

_EVENT_PREFIX = "events.out.tfevents"
_LAYOUT_TAG = "custom_scalars__config__"
# Which callback measures which tags, for runs that logged no thresholds.json.
_TAG_OWNERS = {
    prefix("grad_norm"): "GradientFlowMonitor",
    prefix("loss"): "AnomalyAlarm",
    prefix("lr"): "AnomalyAlarm",
    prefix("attn_entropy"): "AttentionEntropyMonitor",
}


class NoDiagnosticsError(ValueError):
    """Raised when a log directory holds no lightning_diag diagnostics."""


Series = list[tuple[int, float]]


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
        problems: Files that could not be read, with the reason.
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
    has no TensorBoard logger) belong to the folder's parent.
    """
    root = Path(logdir)
    runs: set[Path] = set()
    for dirpath, _dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        has_events = any(f.startswith(_EVENT_PREFIX) for f in filenames)
        has_diag_files = here.name == "diag" and (ALERTS_FILE in filenames or THRESHOLDS_FILE in filenames)
        if has_diag_files or (has_events and here.name == "diag" and here != root):
            runs.add(here.parent)
        elif has_events:
            runs.add(here)
    return sorted(runs)


def _read_events(directory: Path, run: RunData) -> list[tuple[str, str]]:
    """Add the ``diag/`` scalars of the event files in ``directory`` to ``run``; return its text entries.

    Reads each file as a stream of events and keeps only ``diag/`` tags (and the dashboard layout's marker), so
    a run's memory is that of its diagnostics, whatever else (the user's metrics, images, histograms) its event
    files hold.
    """
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    points: dict[str, Series] = {}
    texts: list[tuple[str, str]] = []
    for path in sorted(p for p in directory.iterdir() if p.name.startswith(_EVENT_PREFIX) and p.is_file()):
        for event in EventFileLoader(str(path)).Load():
            if not event.HasField("summary"):
                continue
            step = int(event.step)
            for value in event.summary.value:
                name = value.tag
                if name == _LAYOUT_TAG:
                    run.has_layout = True
                    continue
                if not name.startswith("diag/"):
                    continue
                kind = value.WhichOneof("value")
                if kind == "simple_value":
                    points.setdefault(name, []).append((step, float(value.simple_value)))
                elif kind == "tensor":
                    if value.tensor.string_val:
                        if name.startswith("diag/thresholds"):
                            texts += [(name, raw.decode("utf-8", "replace")) for raw in value.tensor.string_val]
                        continue
                    array = tensor_util.make_ndarray(value.tensor)
                    if array.size == 1:
                        points.setdefault(name, []).append((step, float(array.reshape(-1)[0])))
    for name, series in points.items():
        run.scalars[name] = sorted(run.scalars.get(name, []) + series, key=lambda p: p[0])
    return texts


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
    texts: list[tuple[str, str]] = []
    for directory in (run.path, diag):
        if directory.is_dir() and any(f.name.startswith(_EVENT_PREFIX) for f in directory.iterdir()):
            try:
                texts += _read_events(directory, run)
            except Exception as err:  # a damaged file is reported, never a traceback
                run.problems.append(f"could not read the event files in {directory}: {err}")
    if (diag / ALERTS_FILE).is_file():
        run.alerts = read_alerts(diag / ALERTS_FILE)
    if (diag / THRESHOLDS_FILE).is_file():
        try:
            logged = json.loads((diag / THRESHOLDS_FILE).read_text(encoding="utf-8"))
            run.callbacks = {str(k): {str(r): float(v) for r, v in d.items()} for k, d in logged["callbacks"].items()}
            run.threshold_source = f"diag/{THRESHOLDS_FILE}"
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            run.problems.append(f"could not read diag/{THRESHOLDS_FILE}: {err}")
    if not run.callbacks and texts:
        for _name, text in texts:
            run.callbacks.update(_thresholds_from_text(text))
        if run.callbacks:
            run.threshold_source = "diag/thresholds text in the event file"
    for values in run.callbacks.values():
        run.thresholds.update(values)
    for alert in run.alerts:  # a callback that logged no thresholds still put them in its alerts
        if alert.threshold is not None and run.callbacks and alert.rule not in run.thresholds:
            run.thresholds[alert.rule] = alert.threshold
    if not run.callbacks:
        owners = {owner for prefix, owner in _TAG_OWNERS.items() if run.tags(prefix)}
        owners |= {ALL_RULES[a.rule] for a in run.alerts if a.rule in ALL_RULES}
        run.callbacks = {owner: {} for owner in sorted(owners)}
        from_alerts = {a.rule: a.threshold for a in run.alerts if a.threshold is not None}
        run.thresholds = {**default_thresholds(), **from_alerts}
        run.threshold_source = "not logged: alert thresholds and the library's current defaults"
    return run
