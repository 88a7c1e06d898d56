"""A callback's marginal cost per step, measured in one fit by switching it on and off step by step.

The other benchmarks time a callback's hooks (``cost_table.py``, ``quiet_step.py``, ``SystemMonitor``'s
``diag/overhead/*``) or compare separate fits (their end-to-end ratios). Hook time over-counts what a callback
adds when it moves work rather than creating it (the first operator after the backward pass pays for cold
caches wherever it runs, and a pass over the gradients warms them for the optimizer that reads them next), and
separate fits on a shared machine differ by 5-20% from one repetition to the next, far more than the 2% to be
resolved. Here one fit runs the callbacks on some steps and skips all of their per-batch hooks on the others
(whole steps, so their state stays consistent), two steps of every four (which two drawn per block from a fixed
seed: slow drifts of the machine and work that recurs every few steps fall on both sets alike), and compares the
per-step CPU time of the training thread (``time.thread_time`` from one ``on_train_batch_start`` to the next) of
the two sets of steps:

* **median share**: median of the "on" steps over the median of the "off" steps, minus one (what a quiet step
  costs: the medians ignore the few logging and measuring steps);
* **mean share**: the same with 5%-trimmed means (the logging and measuring steps included, as at the defaults);
* **full mean share**: the same with plain means (every step: the rare histogram steps too; noisier);
* the spread: the median share of each block of 200 steps, its minimum and maximum.

    PYTHONPATH=. .venv/bin/python benchmarks/paired_share.py               # about 4 minutes on a 2-core CPU
    PYTHONPATH=. .venv/bin/python benchmarks/paired_share.py --steps 3000 --models mlp1e6
    PYTHONPATH=. .venv/bin/python benchmarks/paired_share.py --quick       # smoke test (seconds)
    PYTHONPATH=. .venv/bin/python benchmarks/paired_share.py --models mlp1e6 --log-every 10 --epoch-steps 20
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
from floor_callback import FloorCallback
from quiet_step import HOOKS

from lightning_diag import AnomalyAlarm, AttentionEntropyMonitor, GradientFlowMonitor, SystemMonitor
from lightning_diag.callbacks.common.driver import driver_of
from lightning_diag.demo.run import default_callbacks, quiet
from lightning_diag.output.writer import DiagWriter


def _defaults(gradient_flow: dict[str, Any] | None = None, alarm: dict[str, Any] | None = None) -> list[pl.Callback]:
    """The three defaults (as :func:`default_callbacks`), with these arguments of two of them."""
    return [GradientFlowMonitor(**(gradient_flow or {})), AnomalyAlarm(**(alarm or {})), AttentionEntropyMonitor()]


class NoWrites(pl.Callback):
    """Gives the trainer's diagnostics session a writer that writes nothing, at the first batch (after the set-up's
    writes): what the defaults cost without their scalars and histograms reaching TensorBoard. A benchmark's switch
    on the library's own session object; the tags are still built, the values still measured."""

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        driver = driver_of(trainer)
        session = driver.session if driver is not None else None
        if session is not None and session.writer.active:
            session.writer.flush()
            session._writer = DiagWriter(None)


#: The hooks Lightning calls once per batch (those ``quiet_step.py`` times, less the epoch's): skipped together on
#: the "off" steps.
PER_BATCH = tuple(hook for hook in HOOKS if hook != "on_train_epoch_start")
BLOCK = 200
#: Steps left out at the start (allocations, first-step set-up).
SKIP = 20
VARIANTS: dict[str, Callable[[], list[pl.Callback]]] = {
    "AnomalyAlarm": lambda: [AnomalyAlarm()],
    "GradientFlowMonitor": lambda: [GradientFlowMonitor()],
    "AttentionEntropyMonitor": lambda: [AttentionEntropyMonitor()],
    "SystemMonitor": lambda: [SystemMonitor()],
    "all defaults": lambda: list(default_callbacks()),
    # the defaults with AnomalyAlarm before GradientFlowMonitor (the order in which the guard's check runs first on a
    # measuring step: before the driver's shared measurements, it then made its own pass over the gradients)
    "defaults, alarm first": lambda: [AnomalyAlarm(), GradientFlowMonitor(), AttentionEntropyMonitor()],
    # the default detectors' tensor work alone (issue 43's floor): its measuring steps every 10 steps, as the
    # defaults at --log-every 10; "floor guard" is the guard's pass alone, every step; "floor+rules" adds the
    # sampled checks' forward hooks on the same steps (the sampled checks run on the logging interval)
    "floor": lambda: [FloorCallback(every=10)],
    "floor guard": lambda: [FloorCallback(every=0)],
    "floor+rules": lambda: [FloorCallback(every=10, sampled=10)],
    # the ablation of the defaults (issue 43, session 10): each drops one part, so one run tells what each costs
    "all defaults, no histograms": lambda: _defaults(gradient_flow={"histogram_every_n_steps": 0}),
    "all defaults, no sampled checks": lambda: _defaults(
        alarm={"rules": dict.fromkeys(("zero_output", "output_collapse"), False)}
    ),
    "all defaults, no update sampling": lambda: _defaults(gradient_flow={"rules": {"update_none": {"sample_size": 0}}}),
    "all defaults, no weight norms": lambda: _defaults(gradient_flow={"log_weight_norms": False}),
    "all defaults, no writes": lambda: [*default_callbacks(), NoWrites()],
}
MODELS: dict[str, tuple[Callable[[], pl.LightningModule], Callable[[int, int | None], DataLoader]]] = {
    "mlp1e5": (lambda: MLP(176), lambda steps, batches: mlp_data(steps, batches or 32)),
    "mlp1e6": (lambda: MLP(600), lambda steps, batches: mlp_data(steps, batches or 32)),
    "demo_transformer": (demo_transformer, lambda steps, batches: demo_data(steps)),
}


#: The six ways to switch two of four steps on (a block of four steps holds two "on" and two "off" ones).
_ARRANGEMENTS = tuple((a, b) for a in range(4) for b in range(a + 1, 4))


def is_on(step: int) -> bool:
    """Two steps of each block of four are "on", which two drawn for each block from a fixed seed: a linear drift
    of the step time adds the same to both sets, and work that recurs every few steps (Python's garbage collector,
    whose young generation fills at a fixed number of allocations per step) lands on both alike. A fixed pattern
    does not do the second: with "on" at ``step % 4`` in {0, 3}, a fit whose callbacks do nothing measured its
    "on" steps 17 µs (0.7%) slower on the 1e5 MLP (``benchmarks/hook_aftereffect.py --models mlp1e5 --hooks none``),
    its steps ``% 4 == 3`` about 30 µs slower than the others."""
    block = step // 4
    mixed = (block * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF  # a fixed integer hash of the block (Knuth's multiplier)
    mixed ^= mixed >> 15
    return step % 4 in _ARRANGEMENTS[mixed % len(_ARRANGEMENTS)]


class Switched(pl.Callback):
    """Runs ``inner``'s per-batch hooks on the steps :func:`is_on` picks and skips them on the others; every
    other hook (set-up, epochs, validation, checkpoints, teardown) always runs."""

    def __init__(self, inner: list[pl.Callback]) -> None:
        self.inner = inner
        self.on = True

    @property
    def state_key(self) -> str:
        return "Switched[" + ",".join(cb.state_key for cb in self.inner) + "]"


def _forward(hook: str, per_batch: bool) -> Callable[..., None]:
    def forward(self: Switched, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        if hook == "on_train_batch_start":
            self.on = is_on(trainer.global_step)
        if per_batch and not self.on:
            return
        for cb in self.inner:
            fn = getattr(cb, hook)
            if callable(fn):  # as Lightning: a callback switches a hook off on its quiet batches by setting it to None
                fn(trainer, *args, **kwargs)

    forward.__name__ = hook
    return forward


for _hook in dir(pl.Callback):
    if _hook.startswith("on_") or _hook in ("setup", "teardown"):
        setattr(Switched, _hook, _forward(_hook, _hook in PER_BATCH))


class StepClock(pl.Callback):
    """CPU time of the training thread at each batch start (the first callback: it sees the whole step)."""

    def __init__(self) -> None:
        self.marks: list[tuple[int, float]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.marks.append((trainer.global_step, time.thread_time()))

    def steps(self) -> list[tuple[int, float]]:
        """(step, seconds) for each step followed by another."""
        return [(s, b - a) for (s, a), (_, b) in zip(self.marks, self.marks[1:], strict=False)]


def _trimmed_mean(values: list[float], cut: float = 0.05) -> float:
    values = sorted(values)
    k = int(len(values) * cut)
    return statistics.fmean(values[k : len(values) - k] if len(values) > 2 * k else values)


def share(steps: list[tuple[int, float]]) -> dict[str, float]:
    """The median and trimmed-mean shares of the "on" steps over the "off" ones, and the block medians' range."""
    on = [t for s, t in steps if is_on(s)]
    off = [t for s, t in steps if not is_on(s)]
    blocks = []
    for start in range(0, len(steps) - BLOCK + 1, BLOCK):
        part = steps[start : start + BLOCK]
        blocks.append(
            statistics.median(t for s, t in part if is_on(s)) / statistics.median(t for s, t in part if not is_on(s))
            - 1
        )
    return {
        "off ms": statistics.median(off) * 1e3,
        "median": statistics.median(on) / statistics.median(off) - 1,
        "mean": _trimmed_mean(on) / _trimmed_mean(off) - 1,
        "full": statistics.fmean(on) / statistics.fmean(off) - 1,
        "low": min(blocks, default=float("nan")),
        "high": max(blocks, default=float("nan")),
    }


def fit(
    model: str, variant: str, steps: int, root: str, log_every: int = 50, epoch_steps: int | None = None
) -> list[tuple[int, float]]:
    """One fit of ``model`` with ``variant`` switched on and off: (step, CPU seconds) of each step; the trainer
    logs every ``log_every`` steps, and an MLP's epoch is ``epoch_steps`` batches (default 32)."""
    build, data = MODELS[model]
    clock = StepClock()
    trainer = pl.Trainer(
        default_root_dir=root,
        max_steps=steps,
        accelerator="cpu",
        logger=pl.loggers.TensorBoardLogger(root, name="run"),
        callbacks=[clock, Switched(VARIANTS[variant]())],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        log_every_n_steps=log_every,
    )
    trainer.fit(build(), data(steps, epoch_steps))
    return clock.steps()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=1200, help="steps per fit (default 1200)")
    parser.add_argument("--log-every", type=int, default=50, help="Trainer log_every_n_steps (default 50)")
    parser.add_argument("--epoch-steps", type=int, default=None, help="batches per epoch of the MLPs (default 32)")
    parser.add_argument("--quick", action="store_true", help="few steps of the small MLP: a smoke test")
    args = parser.parse_args(argv)
    models, steps = (["mlp1e5"], 2 * BLOCK + 40) if args.quick else (args.models, args.steps)
    t0 = time.perf_counter()
    rows = []
    with quiet(1), tempfile.TemporaryDirectory(prefix="paired_") as root:
        for model in models:
            for variant in args.variants:
                timed = fit(
                    model, variant, steps, os.path.join(root, f"{model}-{variant}"), args.log_every, args.epoch_steps
                )
                r = share([(step, seconds) for step, seconds in timed if step >= SKIP])
                rows.append(
                    f"| {model} | {variant} | {r['off ms']:.2f} | {r['median']:+.2%} | {r['mean']:+.2%} | "
                    f"{r['full']:+.2%} | {r['low']:+.2%} to {r['high']:+.2%} |"
                )
    print(
        f"cpu, 1 thread; torch {torch.__version__}, pytorch_lightning {pl.__version__}; {steps} steps per fit; "
        f"log_every_n_steps {args.log_every}; epochs of {args.epoch_steps or 32} batches (MLPs); "
        f"load average {os.getloadavg()[0]:.1f}; {time.perf_counter() - t0:.0f} s"
    )
    print()
    print("| model | switched | off step ms (median) | median share | mean share | full mean share | block medians |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
