"""Does ``SystemMonitor``'s self-reported ``diag/overhead/*`` agree with the marginal cost ``paired_share`` measures?

For each model, two fits of the same length, run one after the other in one process, repeated ``--reps`` times:

* **paired**: the callbacks (the defaults plus ``SystemMonitor``, timing their hooks as in a normal run)
  switched on and off step by step as in ``paired_share.py`` (CPU time of the training thread); the marginal
  cost is the mean "on" step over the mean
  "off" step minus one, every step counted, logging steps included (an "on" step holds a logging step at the
  same rate as a normal run). As a share of the step time with the callbacks: ``p / (1 + p)``.
* **reported**: a normal fit with the same callbacks; the sum over callbacks of ``diag/overhead/<Callback>``,
  averaged over the logging intervals after the first (the first holds one-time set-up).

    PYTHONPATH=. .venv/bin/python benchmarks/overhead_agreement.py            # 3 models, about 10 minutes
    PYTHONPATH=. .venv/bin/python benchmarks/overhead_agreement.py --quick    # smoke test (seconds)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cost_table import MLP, demo_data, demo_transformer, mlp_data
from paired_share import SKIP, StepClock, Switched, is_on

from lightning_diag import SystemMonitor
from lightning_diag.callbacks.common.base import DiagCallback
from lightning_diag.demo.run import default_callbacks, quiet

MODELS: dict[str, tuple[Callable[[], pl.LightningModule], Callable[[int], DataLoader]]] = {
    "mlp_small": (lambda: MLP(64), mlp_data),
    "mlp1e5": (lambda: MLP(176), mlp_data),
    "mlp1e6": (lambda: MLP(600), mlp_data),
    "demo_transformer": (demo_transformer, demo_data),
}
LOG_EVERY = 50


def callbacks() -> list[pl.Callback]:
    """The defaults and SystemMonitor (which times them and itself)."""
    return [*default_callbacks(), SystemMonitor()]


class Reported(pl.Callback):
    """Collects every ``diag/overhead/*`` value SystemMonitor logs, per logging step."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def attach(self, monitor: SystemMonitor) -> None:
        writer_scalars = monitor.writer.scalars

        def scalars(values: dict[str, float], step: int, *args: Any, **kwargs: Any) -> Any:
            row = {k.rsplit("/", 1)[-1]: float(v) for k, v in values.items() if k.startswith("diag/overhead/")}
            if row:
                self.rows.append(row)
            return writer_scalars(values, step, *args, **kwargs)

        monitor.writer.scalars = scalars  # type: ignore[method-assign]


def _trainer(root: str, steps: int, cbs: list[pl.Callback]) -> pl.Trainer:
    return pl.Trainer(
        default_root_dir=root,
        max_steps=steps,
        accelerator="cpu",
        logger=pl.loggers.CSVLogger(root, name="run"),
        callbacks=cbs,
        log_every_n_steps=LOG_EVERY,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
    )


def paired(model: str, steps: int, root: str) -> float:
    """Marginal cost of the callbacks as a share of the step time with them (all steps counted)."""
    build, data = MODELS[model]
    clock = StepClock()
    cbs = callbacks()
    monitor = next(cb for cb in cbs if isinstance(cb, SystemMonitor))
    original = monitor.setup

    def setup(trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # inside Switched the monitor does not see the callbacks on the trainer: time them (and itself) as in a
        # normal run, so that the timing's own cost is part of the marginal cost measured
        original(trainer, pl_module, stage)
        if monitor._driver is not None:  # the driver calls every callback's hooks through the monitor's timer
            monitor._driver.time_parts(monitor._hooks.part_wrap(cbs), monitor._hooks.recorder_timed)
        monitor._intervals = {cb.every_n_steps(trainer) for cb in cbs if isinstance(cb, DiagCallback)}

    monitor.setup = setup  # type: ignore[method-assign]
    trainer = _trainer(root, steps, [clock, Switched(cbs)])
    trainer.fit(build(), data(steps))
    timed = [(s, t) for s, t in clock.steps() if s >= SKIP]
    on = statistics.fmean(t for s, t in timed if is_on(s))
    off = statistics.fmean(t for s, t in timed if not is_on(s))
    p = on / off - 1
    return p / (1 + p)


def reported(model: str, steps: int, root: str) -> tuple[float, dict[str, float]]:
    """The sum of ``diag/overhead/*`` (and each callback's), averaged over the intervals after the first."""
    build, data = MODELS[model]
    cbs = callbacks()
    sink = Reported()
    trainer = _trainer(root, steps, [*cbs, sink])
    monitor = next(cb for cb in cbs if isinstance(cb, SystemMonitor))
    # the writer exists once the fit has set the callback up: attach at the first batch
    original = monitor.on_train_start

    def on_train_start(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        original(trainer, pl_module)
        sink.attach(monitor)

    monitor.on_train_start = on_train_start  # type: ignore[method-assign]
    trainer.fit(build(), data(steps))
    rows = sink.rows[1:]
    names = sorted({k for row in rows for k in row})
    each = {n: statistics.fmean(row.get(n, 0.0) for row in rows) for n in names}
    return sum(each.values()), each


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--steps", type=int, default=600, help="steps per fit (default 600)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of the pair of fits (default 3)")
    parser.add_argument("--quick", action="store_true", help="few steps of the small MLP: a smoke test")
    args = parser.parse_args(argv)
    models, steps, reps = (["mlp_small"], 160, 1) if args.quick else (args.models, args.steps, args.reps)
    t0 = time.perf_counter()
    lines = []
    with quiet(1), tempfile.TemporaryDirectory(prefix="agree_") as root:
        for model in models:
            pairs, reps_seen, each_all = [], [], []
            for r in range(reps):
                pairs.append(paired(model, steps, os.path.join(root, f"{model}-p{r}")))
                total, each = reported(model, steps, os.path.join(root, f"{model}-r{r}"))
                reps_seen.append(total)
                each_all.append(each)
            diff = [a - b for a, b in zip(reps_seen, pairs, strict=True)]
            per_cb = ", ".join(
                f"{n} {statistics.median(e.get(n, 0.0) for e in each_all):.2%}" for n in sorted(each_all[0])
            )
            lines.append(
                f"| {model} | {statistics.median(pairs):.2%} ({min(pairs):.2%} to {max(pairs):.2%}) | "
                f"{statistics.median(reps_seen):.2%} ({min(reps_seen):.2%} to {max(reps_seen):.2%}) | "
                f"{statistics.median(diff):+.2%} | {per_cb} |"
            )
    print(
        f"cpu, 1 thread; torch {torch.__version__}, pytorch_lightning {pl.__version__}; {steps} steps per fit, "
        f"{reps} reps, log every {LOG_EVERY}; load average {os.getloadavg()[0]:.1f}; {time.perf_counter() - t0:.0f} s"
    )
    print()
    print(
        "| model | paired share (median, range) | reported share (median, range) | reported - paired | "
        "reported per callback (median) |"
    )
    print("|---|---|---|---|---|")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
