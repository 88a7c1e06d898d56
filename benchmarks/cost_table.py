"""What each callback costs, by model size: the table of docs/performance.md ("Cost by model size").

For MLPs of about 1e5, 1e6, 1e7 and 1e8 parameters (AdamW, batch 64, one torch thread) and the demo transformer
(``lightning_diag.demo.models.TinyTransformerClassifier`` with the default ``DemoConfig``), in one process:

Durations are CPU time of the training thread (``time.thread_time``; torch runs on one thread), so that other jobs
on a shared machine do not inflate them.

* **per-callback cost** from the inside: every hook of every lightning_diag callback is timed per step (the
  ``diag/overhead/*`` accounting of ``SystemMonitor``, split by step). A *measuring group* is three steps: the
  one whose batch end logs, the one that measures, and the one after it (whose backward checks that the measured
  gradients were zeroed: ``grad_not_zeroed``); every other step is *quiet*. The callbacks run with
  ``log_every_n_steps=K`` so a short fit holds several of each; the share at the defaults is then amortised over
  the default interval of 50 steps: ``(measuring group + 47 quiet steps) / 50`` over the bare step time. The
  gradient histograms (every 500 steps by default) are timed apart and amortised over 500 steps.
* **host reads per step**: while a callback's hook runs, ``torch.Tensor.item``, ``tolist``, ``cpu``, ``numpy``,
  ``__bool__``, ``__float__`` and ``__int__`` are counted (a host read of a device value: a synchronisation on
  CUDA). Counted for every ``AnomalyAlarm(on_nonfinite=...)`` mode on the smallest MLP.
* **end to end**: bare against ``default_callbacks()`` with the trainer's defaults, interleaved fits, median step
  time ratio (1e5 and 1e6 MLPs and the demo transformer; the larger ones are too slow to time end to end here).

    PYTHONPATH=. .venv/bin/python benchmarks/cost_table.py                 # about 3-5 minutes on an idle 2-core CPU
    PYTHONPATH=. .venv/bin/python benchmarks/cost_table.py --sizes 1e5 1e6 # a subset
    PYTHONPATH=. .venv/bin/python benchmarks/cost_table.py --quick         # smoke test (seconds)

Not counted by the patching: implicit synchronisations inside torch (a boolean-mask index, ``nonzero``); on a GPU
``benchmarks/overhead.py --device cuda`` catches those with ``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_diag import (
    AnomalyAlarm,
    AttentionEntropyMonitor,
    DataDiagnostics,
    GradientFlowMonitor,
    SystemMonitor,
)
from lightning_diag.callbacks.common.base import DiagCallback
from lightning_diag.callbacks.common.driver import driver_of
from lightning_diag.callbacks.system_monitor.hooks import HookTimer
from lightning_diag.demo.run import default_callbacks, quiet

COMMAND = "PYTHONPATH=. .venv/bin/python benchmarks/cost_table.py"
#: Every duration is CPU time of the training thread (torch runs on one thread here): a machine shared with other
#: jobs preempts the process at random points, which inflates wall times of whatever code is running then.
CLOCK = time.thread_time
DEFAULT_INTERVAL = 50
HISTOGRAM_INTERVAL = 10 * DEFAULT_INTERVAL
MODES = ("stop", "raise", "skip", "warn", "rollback")
#: Host reads of a tensor's value.
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")
#: size label -> (hidden width of a 4-hidden-layer MLP, K, steps of the per-callback fit, steps of an e2e fit)
SIZES: dict[str, tuple[int, int, int, int]] = {
    "1e5": (176, 5, 31, 200),
    "1e6": (600, 5, 31, 150),
    "1e7": (1815, 5, 16, 0),
    "1e8": (5760, 4, 9, 0),
}


# -- models ----------------------------------------------------------------------------------------------------
class MLP(pl.LightningModule):
    """64 inputs, 4 hidden layers of ``width`` (ReLU), one output; MSE; AdamW."""

    def __init__(self, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Linear(64, width), nn.ReLU()]
        for _ in range(3):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def mlp_data(steps: int, batches: int = 32) -> DataLoader:
    """Random regression data for :class:`MLP`: ``min(steps, batches)`` batches of 64 (one epoch)."""
    g = torch.Generator().manual_seed(0)
    n = 64 * min(steps, batches)
    return DataLoader(TensorDataset(torch.randn(n, 64, generator=g), torch.randn(n, generator=g)), batch_size=64)


def demo_transformer() -> pl.LightningModule:
    from lightning_diag.demo.models import DemoConfig, build_model

    return build_model(DemoConfig())


def demo_data(steps: int) -> DataLoader:
    from lightning_diag.demo.synthetic import make_dataset

    return DataLoader(make_dataset(32 * min(steps, 16), seed=0), batch_size=32, shuffle=False)


# -- instruments -----------------------------------------------------------------------------------------------
class ReadCounter:
    """Counts host reads of tensor values while ``owner`` is set (by the hook wrappers)."""

    def __init__(self) -> None:
        self.owner: str | None = None
        self.counts: dict[str, int] = {}
        self._saved: dict[str, Any] = {}

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        for name in READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._counting(original))
        try:
            yield
        finally:
            for name, original in self._saved.items():
                setattr(torch.Tensor, name, original)
            self._saved = {}

    def _counting(self, original: Callable[..., Any]) -> Callable[..., Any]:
        counter = self

        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            owner = counter.owner
            if owner is not None:
                counter.owner = None  # a read inside a read (tolist calling item) counts once
                try:
                    counter.counts[owner] = counter.counts.get(owner, 0) + 1
                    return original(tensor, *args, **kwargs)
                finally:
                    counter.owner = owner
            return original(tensor, *args, **kwargs)

        return read

    def take(self) -> dict[str, int]:
        taken, self.counts = self.counts, {}
        return taken


class PerStep(pl.Callback):
    """First on the trainer: at every batch start, files the previous step's hook seconds and host reads."""

    def __init__(self, timer: HookTimer, reads: ReadCounter) -> None:
        self.timer = timer
        self.reads = reads
        self.steps: list[tuple[int, dict[str, float], dict[str, int]]] = []
        self.marks: list[float] = []
        self._step: int | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._close()
        self._step = trainer.global_step
        self.marks.append(CLOCK())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()

    def _close(self) -> None:
        seconds, reads = self.timer.take().seconds, self.reads.take()
        if self._step is not None:
            self.steps.append((self._step, seconds, reads))
        self._step = None


class Owned(pl.Callback):
    """Hook timers (HookTimer, as SystemMonitor's) on every callback's hooks, through the trainer's driver, and the
    read counter's owner around them."""

    def __init__(self, timer: HookTimer, reads: ReadCounter, callbacks: list[DiagCallback]) -> None:
        self.timer = timer
        self.reads = reads
        self.callbacks = callbacks

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        driver = driver_of(trainer)
        assert driver is not None
        timed = self.timer.part_wrap(self.callbacks)
        reads = self.reads

        def wrap(cb: Any, hook: str, part: Callable[..., Any]) -> Callable[..., Any]:
            inner = timed(cb, hook, part)
            return part if inner is part else _owning(reads, type(cb).__name__, inner)

        driver.time_parts(wrap, self.timer.recorder_timed)


def _owning(reads: ReadCounter, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def hook(*args: Any, **kwargs: Any) -> Any:
        outer, reads.owner = reads.owner, name
        try:
            return fn(*args, **kwargs)
        finally:
            reads.owner = outer

    return hook


def _trainer(root: str, callbacks: list[pl.Callback], steps: int, log_every: int) -> pl.Trainer:
    return pl.Trainer(
        default_root_dir=root,
        max_steps=steps,
        max_epochs=-1,
        accelerator="cpu",
        devices=1,
        logger=pl.loggers.TensorBoardLogger(root, name="run"),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        log_every_n_steps=log_every,
    )


def _step_times(marks: list[float], skip: int = 1) -> list[float]:
    return [b - a for a, b in itertools.pairwise(marks)][skip:]


def bare_step(model: Callable[[], pl.LightningModule], data: DataLoader, steps: int, root: str) -> float:
    """Median step time of a fit without callbacks."""
    timer = PerStep(HookTimer(CLOCK), ReadCounter())
    _trainer(root, [timer], steps, DEFAULT_INTERVAL).fit(model(), data)
    return statistics.median(_step_times(timer.marks))


def per_callback(
    model: Callable[[], pl.LightningModule], data: DataLoader, k: int, steps: int, root: str, mode: str = "stop"
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]], float]:
    """One fit with the per-step callbacks measuring every ``k`` steps: by callback, the mean seconds and host
    reads of a quiet step, of a measuring pair (measure + log step) and of the first step; and the median step."""
    callbacks: list[DiagCallback] = [
        GradientFlowMonitor(log_every_n_steps=k, histogram_every_n_steps=0),
        AnomalyAlarm(log_every_n_steps=k, on_nonfinite=mode),  # type: ignore[arg-type]
        AttentionEntropyMonitor(log_every_n_steps=k),
        DataDiagnostics(),
        SystemMonitor(log_every_n_steps=k, time_callbacks=False),
    ]
    timer, reads = HookTimer(CLOCK), ReadCounter()
    per_step = PerStep(timer, reads)
    trainer = _trainer(root, [per_step, *callbacks, Owned(timer, reads, callbacks)], steps, k)
    monitor = callbacks[-1]
    # SystemMonitor closes each step in its own step-boundary wrapper, set up at `setup`: time that too
    monitor._close_batch = timer.timed("SystemMonitor", monitor._close_batch)  # type: ignore[method-assign]
    monitor._close_batch = _owning(reads, "SystemMonitor", monitor._close_batch)  # type: ignore[method-assign]
    with reads.patched():
        trainer.fit(model(), data)
    names = [type(cb).__name__ for cb in callbacks]
    # The measuring group: the step whose batch end logs (k - 1), the step that measures (0) and the one after it,
    # whose backward checks the measured step's gradients were zeroed (1). Every other step is quiet.
    group = [k - 1, 0, 1]
    quiet_steps = [(s, sec, rd) for s, sec, rd in per_step.steps if s > 0 and s % k not in group]
    groups = [
        per_step.steps[i : i + 3]
        for i in range(1, len(per_step.steps) - 2)
        if [entry[0] % k for entry in per_step.steps[i : i + 3]] == group
    ]
    seconds: dict[str, dict[str, float]] = {}
    host: dict[str, dict[str, float]] = {}
    for name in names:
        recorder = HookTimer.RECORDER if name == "AttentionEntropyMonitor" else None

        def cost(sec: dict[str, float], name: str = name, recorder: str | None = recorder) -> float:
            return sec.get(name, 0.0) + (sec.get(recorder, 0.0) if recorder else 0.0)

        seconds[name] = {
            "quiet": statistics.fmean(cost(sec) for _, sec, _ in quiet_steps) if quiet_steps else float("nan"),
            "pair": statistics.fmean(sum(cost(e[1]) for e in g) for g in groups) if groups else float("nan"),
            "first": cost(per_step.steps[0][1]),
        }
        host[name] = {
            "quiet": statistics.fmean(rd.get(name, 0) for _, _, rd in quiet_steps) if quiet_steps else float("nan"),
            "pair": statistics.fmean(sum(e[2].get(name, 0) for e in g) for g in groups) if groups else 0.0,
        }
    return seconds, host, statistics.median(_step_times(per_step.marks))


def histogram_seconds(model: pl.LightningModule, data: DataLoader, root: str) -> float:
    """Seconds to write the gradient histograms of every parameter once (GradientFlowMonitor's histogram step)."""
    from torch.utils.tensorboard import SummaryWriter

    batch = next(iter(data))
    if isinstance(model, MLP):
        x, y = batch
        loss = nn.functional.mse_loss(model.net(x).squeeze(-1), y)
    else:
        loss = model.compute_loss(batch)  # type: ignore[operator]
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    writer = SummaryWriter(os.path.join(root, "hist"))
    start = CLOCK()
    for i, g in enumerate(grads):
        writer.add_histogram(f"g{i}", g, 0)
    elapsed = CLOCK() - start
    writer.close()
    return elapsed


def end_to_end(
    model: Callable[[], pl.LightningModule], data: DataLoader, steps: int, reps: int, root: str
) -> tuple[float, float, float]:
    """Median over interleaved repetitions of (defaults median step / bare median step); and its range."""
    ratios = []
    for rep in range(reps):
        times = {}
        order = ("bare", "defaults") if rep % 2 == 0 else ("defaults", "bare")
        for variant in order:
            marks = PerStep(HookTimer(CLOCK), ReadCounter())
            cbs: list[pl.Callback] = [marks, *(default_callbacks() if variant == "defaults" else [])]
            _trainer(os.path.join(root, f"{variant}{rep}"), cbs, steps, DEFAULT_INTERVAL).fit(model(), data)
            times[variant] = statistics.median(_step_times(marks.marks, skip=10))
        ratios.append(times["defaults"] / times["bare"])
    return statistics.median(ratios), min(ratios), max(ratios)


# -- the table -------------------------------------------------------------------------------------------------
def amortised(sec: dict[str, float]) -> float:
    """Seconds per step at the default interval: one measuring group (3 steps) and 47 quiet steps per 50."""
    quiet_s, measuring = sec["quiet"], sec["pair"]
    if quiet_s != quiet_s:  # nan: no quiet step seen
        return measuring / 3
    return (measuring + (DEFAULT_INTERVAL - 3) * quiet_s) / DEFAULT_INTERVAL


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--reps", type=int, default=3, help="end-to-end repetitions (default 3)")
    parser.add_argument("--quick", action="store_true", help="the 1e5 MLP only, few steps: a smoke test")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.reps = ["1e5"], 1
    with quiet(args.threads), tempfile.TemporaryDirectory(prefix="cost_") as root:
        return _main(args, root)


def _main(args: argparse.Namespace, root: str) -> int:
    t0 = time.perf_counter()
    rows, e2e_rows = [], []
    models: list[tuple[str, Callable[[], pl.LightningModule], Callable[[int], DataLoader], int, int, int]] = []
    for size in args.sizes:
        width, k, steps, e2e_steps = SIZES[size]
        if args.quick:
            steps, e2e_steps = 11, 30

        def make(width: int = width) -> pl.LightningModule:
            return MLP(width)

        models.append((f"MLP {size}", make, mlp_data, k, steps, e2e_steps))
    if not args.quick:
        models.append(("demo transformer", demo_transformer, demo_data, 5, 31, 200))
    for label, make, data_fn, k, steps, e2e_steps in models:
        data = data_fn(max(steps, e2e_steps))
        params = sum(p.numel() for p in make().parameters())
        step = bare_step(make, data, min(steps, 11), os.path.join(root, label, "bare"))
        seconds, host, _ = per_callback(make, data, k, steps, os.path.join(root, label, "cb"))
        hist = histogram_seconds(make(), data, root) / HISTOGRAM_INTERVAL
        for name, sec in seconds.items():
            extra = hist if name == "GradientFlowMonitor" else 0.0
            share = (amortised(sec) + extra) / step
            rows.append(
                f"| {label} | {params:,} | {step * 1e3:.2f} | {name} | {sec['quiet'] * 1e6:.0f} | "
                f"{sec['pair'] * 1e3:.2f} | {sec['first'] * 1e3:.1f} | {share * 100:.2f}% | "
                f"{host[name]['quiet']:.0f} / {host[name]['pair']:.0f} |"
            )
        if e2e_steps:
            ratio, lo, hi = end_to_end(make, data, e2e_steps, args.reps, os.path.join(root, label, "e2e"))
            e2e_rows.append(f"| {label} | {params:,} | {step * 1e3:.2f} | {ratio:.3f}x | {lo:.3f}-{hi:.3f}x |")
        print(f"  {label}: done at {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    # host reads per step of each guarding mode (the smallest MLP)
    mode_rows = []
    width, k, steps, _ = SIZES["1e5"]
    data = mlp_data(steps)
    for mode in MODES:
        mode_steps = 11 if args.quick else steps
        _, host, _ = per_callback(lambda: MLP(width), data, k, mode_steps, os.path.join(root, mode), mode)
        mode_rows.append(f"| `{mode}` | {host['AnomalyAlarm']['quiet']:.0f} | {host['AnomalyAlarm']['pair']:.0f} |")
    print(
        f"cpu, {torch.get_num_threads()} thread(s); torch {torch.__version__}, pytorch_lightning {pl.__version__}; "
        f"load average {os.getloadavg()[0]:.1f}; {time.perf_counter() - t0:.0f} s"
    )
    print()
    print(
        "| model | parameters | bare step ms | callback | quiet step µs | measuring steps ms | first step ms "
        "| share at defaults | host reads quiet / measuring |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    print("| model | parameters | bare step ms | all defaults / bare (median) | range |")
    print("|---|---|---|---|---|")
    print("\n".join(e2e_rows))
    print()
    print("| `AnomalyAlarm(on_nonfinite=...)` | host reads per quiet step | host reads per measuring group |")
    print("|---|---|---|")
    print("\n".join(mode_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
