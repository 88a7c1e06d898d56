"""What a callback hook costs beyond its own CPU time: the part of the marginal cost no hook timer sees.

``SystemMonitor``'s ``diag/overhead/*`` counts the CPU time inside the callbacks' hooks; ``paired_share.py``
measures the marginal cost, the step with the callbacks minus the step without. The two differ by what a hook
costs the training's own code *after* it returns (its code and data evicted from the caches, Python's lookup
caches refilled). This measures it with minimal hooks whose only work is known, switched on and off step by step
in one fit (``paired_share.py``'s ``Switched`` pattern: on, off, off, on), each hook timing its own body with the
training thread's CPU clock:

* ``none``: no hook at all: the "on" and "off" steps differ by nothing, so the marginal cost must read 0 within
  the noise (the method's own check);
* ``empty``: ``on_train_batch_start`` does nothing but time itself;
* ``store``: ``on_train_batch_start`` keeps a reference to the batch (one attribute store);
* ``loop``: ``on_train_batch_start`` runs a 400-iteration Python loop (about 15 µs);
* ``check``: ``on_before_optimizer_step`` runs the non-finite guard's fused check over the gradients and reads it.

For each, per step (median over the steps that log nothing): the hook's own CPU time, the marginal cost (the "on"
steps' mean CPU time minus the "off" steps'), and the difference, the after-effect.

    PYTHONPATH=. .venv/bin/python benchmarks/hook_aftereffect.py            # 2 models x 3 hooks, about 2 minutes
    PYTHONPATH=. .venv/bin/python benchmarks/hook_aftereffect.py --quick    # smoke test (seconds)
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cost_table import MLP, mlp_data
from paired_share import StepClock, Switched, is_on

from lightning_diag.demo.run import quiet
from lightning_diag.stats.norms import nonfinite_flag

INTERVAL = 50


class _Timed(pl.Callback):
    """Accumulates its hook's own CPU time per global step."""

    def __init__(self) -> None:
        self.spent: dict[int, float] = {}

    def _add(self, step: int, seconds: float) -> None:
        self.spent[step] = self.spent.get(step, 0.0) + seconds


class NoHook(_Timed):
    """Implements no hook: the switched steps differ from the others by nothing (an A/A test of the method)."""


class Empty(_Timed):
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        start = time.thread_time()
        self._add(trainer.global_step, time.thread_time() - start)


class Store(_Timed):
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        start = time.thread_time()
        self.batch = batch
        self._add(trainer.global_step, time.thread_time() - start)


class Loop(_Timed):
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        start = time.thread_time()
        total = 0
        for i in range(400):
            total += i
        self.total = total
        self._add(trainer.global_step, time.thread_time() - start)


class Check(_Timed):
    def __init__(self) -> None:
        super().__init__()
        self.found = torch.zeros(1)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        start = time.thread_time()
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self.bad = nonfinite_flag(grads, self.found).item() != 0
        self._add(trainer.global_step, time.thread_time() - start)


HOOKS: dict[str, Callable[[], _Timed]] = {"none": NoHook, "empty": Empty, "store": Store, "loop": Loop, "check": Check}
MODELS = {"mlp1e5": 176, "mlp1e6": 600}


def measure(width: int, hook: str, steps: int, root: str) -> tuple[float, float, float]:
    """(the hook's own CPU µs, the marginal CPU µs, its standard error) per quiet step, in one fit with the hook
    switched."""
    clock, cb = StepClock(), HOOKS[hook]()
    pl.Trainer(
        default_root_dir=root,
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        callbacks=[clock, Switched([cb])],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        log_every_n_steps=INTERVAL,
    ).fit(MLP(width), mlp_data(steps))
    timed = [(s, t) for s, t in clock.steps() if s >= 20 and s % INTERVAL not in (INTERVAL - 1, 0, 1)]
    on = [t for s, t in timed if is_on(s)]
    off = [t for s, t in timed if not is_on(s)]
    own = statistics.median(cb.spent.get(s, 0.0) for s, _ in timed if is_on(s))
    spread = statistics.pstdev(on + off) / (len(timed) / 4) ** 0.5  # standard error of a difference of means
    return own * 1e6, (statistics.fmean(on) - statistics.fmean(off)) * 1e6, spread * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--hooks", nargs="+", choices=list(HOOKS), default=list(HOOKS))
    parser.add_argument("--steps", type=int, default=1600, help="steps per fit (default 1600)")
    parser.add_argument("--quick", action="store_true", help="few steps of the small MLP: a smoke test")
    args = parser.parse_args(argv)
    models = {"mlp_small": 64} if args.quick else {m: MODELS[m] for m in args.models}
    steps = 120 if args.quick else args.steps
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rows = []
    with quiet(1), tempfile.TemporaryDirectory(prefix="aftereffect_") as root:
        for model, width in models.items():
            for hook in args.hooks:
                own, marginal, err = measure(width, hook, steps, os.path.join(root, f"{model}-{hook}"))
                rows.append(f"| {model} | {hook} | {own:.1f} | {marginal:.1f} ± {err:.1f} | {marginal - own:+.1f} |")
    print(
        f"cpu, 1 thread; torch {torch.__version__}, pytorch_lightning {pl.__version__}; {steps} steps per fit; "
        f"load average {os.getloadavg()[0]:.1f}; {time.perf_counter() - t0:.0f} s"
    )
    print()
    print(
        "| model | hook | its own CPU µs (median quiet step) | marginal CPU µs (mean on - off, ± standard error) "
        "| after-effect µs |"
    )
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
