"""How long ``lightning-diag report`` takes on a tree of plain Lightning runs (issue 46: 1,000 runs in under a minute).

Writes ``--runs`` small runs into a temporary folder, laid out as Lightning's loggers lay them out: half
``TensorBoardLogger`` folders (``tb/version_N/events.out.tfevents...``, written with TensorBoard's own event-file
writer) and half ``CSVLogger`` folders (``csv/version_N/metrics.csv``), each with ``--steps`` training steps
logged at every step (``train_loss_step``), the epoch means (``train_loss_epoch``), one ``val_loss`` per epoch,
``lr-Adam`` and ``epoch``. One run in ten has a NaN loss from mid-run, one in ten a validation loss that worsens
every epoch, the rest are healthy. Then it times ``lightning-diag report ROOT`` (the markdown summary, one line per
run), in a subprocess as a user runs it (Python start and imports included), and prints a markdown table.

Usage::

    python benchmarks/report_tree.py --runs 1000 --steps 140
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS_PER_EPOCH = 20


def series(index: int, steps: int) -> dict[str, list[tuple[int, float]]]:
    """The logged series of run ``index``: ``tag -> [(step, value)]`` (its fault from ``index // 2 % 10``, so that
    TensorBoard and CSV runs get each fault)."""
    fault = {3: "nan", 7: "overfit"}.get(index // 2 % 10, "none")
    train, epoch_means, val, lr, epochs = [], [], [], [], []
    block: list[float] = []
    for step in range(steps):
        epoch = step // STEPS_PER_EPOCH
        noise = 0.05 * math.sin(step * 12.9898 + index * 78.233)
        loss = 2.0 * math.exp(-step / 30) + 0.1 + noise * 0.2
        if fault == "nan" and step >= steps // 2:
            loss = math.nan
        train.append((step, loss))
        lr.append((step, 1e-3))
        epochs.append((step, float(epoch)))
        block.append(loss)
        if (step + 1) % STEPS_PER_EPOCH == 0:
            epoch_means.append((step, sum(block) / len(block)))
            block = []
            worse = 0.6 * epoch if fault == "overfit" else 0.0
            val.append((step, 2.0 * math.exp(-step / 30) + 0.15 + worse))
    return {"train_loss_step": train, "train_loss_epoch": epoch_means, "val_loss": val, "lr-Adam": lr, "epoch": epochs}


def write_tensorboard(folder: Path, logged: dict[str, list[tuple[int, float]]]) -> None:
    """One event file with the series, as a ``TensorBoardLogger`` writes them."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    folder.mkdir(parents=True, exist_ok=True)
    writer = EventFileWriter(str(folder))
    by_step: dict[int, list[Summary.Value]] = {}
    for tag, points in logged.items():
        for step, value in points:
            by_step.setdefault(step, []).append(Summary.Value(tag=tag, simple_value=value))
    for step in sorted(by_step):
        writer.add_event(Event(step=step, wall_time=time.time(), summary=Summary(value=by_step[step])))
    writer.close()


def write_csv(folder: Path, logged: dict[str, list[tuple[int, float]]]) -> None:
    """A ``metrics.csv`` with the series, as a ``CSVLogger`` writes them (one row per step and logging call)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(logged)
    rows = []
    for tag in names:
        for step, value in logged[tag]:
            rows.append((step, tag, value))
    rows.sort(key=lambda r: r[0])
    lines = [",".join(["step", *names])]
    for step, tag, value in rows:
        lines.append(",".join([str(step), *("" if n != tag else repr(value) for n in names)]))
    (folder / "metrics.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")


def make_tree(root: Path, runs: int, steps: int) -> None:
    """``runs`` runs under ``root``: even indexes TensorBoard, odd ones CSV."""
    for i in range(runs):
        logged = series(i, steps)
        if i % 2 == 0:
            write_tensorboard(root / "tb" / f"version_{i}", logged)
        else:
            write_csv(root / "csv" / f"version_{i}", logged)


def time_report(root: Path) -> tuple[float, int, str]:
    """Seconds ``python -m lightning_diag report ROOT`` took, its exit code and its stdout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "lightning_diag", "report", str(root)], capture_output=True, text=True, env=env
    )
    return time.perf_counter() - start, done.returncode, done.stdout


def main(argv: list[str] | None = None) -> int:
    """Generate the tree, time the report, print the table; exit 1 when the report failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000, help="runs to generate (default 1000)")
    parser.add_argument("--steps", type=int, default=140, help="training steps per run (default 140: 7 epochs)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.steps < STEPS_PER_EPOCH:
        parser.error(f"--runs must be >= 1 and --steps >= {STEPS_PER_EPOCH}")
    with tempfile.TemporaryDirectory(prefix="report-tree-") as tmp:
        root = Path(tmp)
        start = time.perf_counter()
        make_tree(root, args.runs, args.steps)
        made = time.perf_counter() - start
        seconds, code, out = time_report(root)
    lines = [line for line in out.splitlines() if line.startswith("| FAIL") or line.startswith("| ok")]
    print("| runs | steps each | generate (s) | report (s) | per run (ms) | summary lines |")
    print("|---|---|---|---|---|---|")
    print(
        f"| {args.runs} | {args.steps} | {made:.1f} | {seconds:.1f} | {1000 * seconds / args.runs:.1f} | {len(lines)} |"
    )
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
