"""Synthetic runs for the report's hostile-input tests: event files written with TensorBoard's own writer, an
alert log and a thresholds file, with no training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from lightning_diag.core.alerts import Alert, Severity

ROOT = Path(__file__).resolve().parents[2]
LOSS = "diag/loss/train_step"


def write_events(
    directory: Path, scalars: dict[str, Sequence[float]], suffix: str = "", every: int = 10, start: int = 0
) -> Path:
    """One event file in ``directory`` with each tag's values at steps ``start``, ``start + every``, ...; returns
    its path."""
    directory.mkdir(parents=True, exist_ok=True)
    writer = EventFileWriter(str(directory), filename_suffix=suffix)
    steps = max(len(v) for v in scalars.values())
    for i in range(steps):
        values = [Summary.Value(tag=t, simple_value=v[i]) for t, v in scalars.items() if i < len(v)]
        writer.add_event(Event(step=start + every * i, summary=Summary(value=values)))
    writer.close()
    return Path(writer._file_name)


def alert(message: str = "loss swings", source: str = "train_loss", rule: str = "loss_swing", step: int = 20) -> Alert:
    return Alert(rule, Severity.WARNING, message, 1, step, 0.2, 0.1, source)


def make_run(path: Path, alerts: Iterable[Alert] = (), thresholds: dict | None = None, points: int = 8) -> Path:
    """A run folder: a loss series of ``points`` points in an event file, an alert log, a thresholds file."""
    write_events(path, {LOSS: [1.0 / (i + 1) for i in range(points)]})
    diag = path / "diag"
    diag.mkdir(parents=True, exist_ok=True)
    (diag / "alerts.jsonl").write_text("".join(a.to_json() + "\n" for a in alerts), encoding="utf-8")
    if thresholds is not None:
        (diag / "thresholds.json").write_text(json.dumps({"callbacks": thresholds}), encoding="utf-8")
    return path


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[bytes]:
    """``python -m lightning_diag ARGS`` in a subprocess (this checkout's package), output as bytes."""
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "lightning_diag", *args], capture_output=True, env=full, timeout=timeout
    )
