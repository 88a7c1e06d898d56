"""A callback's cost on the steps that log nothing, hook by hook, on the 1.1M-parameter MLP of issue 23.

For each callback (default: ``AnomalyAlarm`` and ``GradientFlowMonitor`` with their defaults) one fit of the
``cost_table.py`` MLP (64 inputs, 4 hidden layers of 600, 1,121,401 parameters, AdamW, batch 64, one torch thread)
is run several times, and on its *quiet* steps (neither they nor their neighbours log: ``step % 50`` not in
{49, 0, 1}) it reports:

* the CPU time of the training thread (``time.thread_time``, so that other jobs on a shared machine do not
  inflate it) inside each hook of the callback, the median over the quiet steps, then the median over the
  repetitions, **net of the timing**: the same median for a callback whose hooks do nothing (:class:`NoOp`, timed
  the same way in fits of its own) is taken off each hook (on this 2-core VM a window of two clock reads around an
  empty hook reads 2-5 µs, more than some hooks' own work);
* **beyond the pass**, two ways: per quiet step, the CPU time of all its hooks minus that of the non-finite guard's
  pass (timed the same way, in fits of their own) and minus the empty hooks' timing floor, the median over the
  quiet steps, then over the repetitions. The pass is either the **fused kernels** alone (``finite_probe``; for
  large CPU gradients also their sums decided on the host, ``guard_pass._sums_prove_finite``), or the **pass as
  ``GradScaler`` makes its own** before every update (``OptimizerPass.clean``: the gradients listed from the
  parameters, the fused kernels, one read of the flag on the host). The second is the floor of an exact
  check before every update (issue 37 §4: a quiet step at most 30 µs beyond it); the first also counts the
  listing and the read as beyond. Both are also net of the nested window's own cost (its two clock reads, about
  1.2 µs warm on this VM, and its bookkeeping): an empty hook that calls an empty pass (:class:`NoOpPass`), timed
  the same way, leaves that much beyond its pass;
* the **aten operators** the callback's hooks dispatch per quiet step (counted with a ``TorchDispatchMode``): a
  count that does not depend on the machine's load, each operator being a few microseconds of dispatch on the CPU
  and one kernel launch on a GPU;
* end to end, interleaved fits: the median step of the callback alone, and of ``default_callbacks()``, over the
  median step of a bare fit in the same repetition (wall time), the median over repetitions and its range.

    PYTHONPATH=. .venv/bin/python benchmarks/quiet_step.py                # about 3 minutes on a 2-core CPU
    PYTHONPATH=. .venv/bin/python benchmarks/quiet_step.py --reps 5 --steps 300
    PYTHONPATH=. .venv/bin/python benchmarks/quiet_step.py --quick        # smoke test (seconds)
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cost_table import MLP, mlp_data

from lightning_diag import AnomalyAlarm, AttentionEntropyMonitor, DataDiagnostics, GradientFlowMonitor, SystemMonitor
from lightning_diag.callbacks.anomaly_alarm import nonfinite_guard
from lightning_diag.callbacks.common.batch_hooks import TRAIN_BATCH_HOOKS
from lightning_diag.demo.run import default_callbacks, quiet

COMMAND = "PYTHONPATH=. .venv/bin/python benchmarks/quiet_step.py"
INTERVAL = 50
HOOKS = ("on_train_epoch_start", *TRAIN_BATCH_HOOKS)


class NoOp(pl.Callback):
    """Implements every hook of :data:`HOOKS` and does nothing: the timing's own floor, hook by hook."""

    def on_train_epoch_start(self, *args: Any) -> None:
        pass

    def on_train_batch_start(self, *args: Any) -> None:
        pass

    def on_before_backward(self, *args: Any) -> None:
        pass

    def on_after_backward(self, *args: Any) -> None:
        pass

    def on_before_optimizer_step(self, *args: Any) -> None:
        pass

    def on_before_zero_grad(self, *args: Any) -> None:
        pass

    def on_train_batch_end(self, *args: Any) -> None:
        pass


class EmptyPass:
    """What :class:`NoOpPass` calls where the guard runs its pass: nothing, timed as the pass is."""

    @staticmethod
    def run() -> None:
        pass


class NoOpPass(NoOp):
    """:class:`NoOp` whose ``on_before_optimizer_step`` calls :meth:`EmptyPass.run`: timed as the guard's pass, what is
    left of that hook beyond it is the nested timing's own cost (its clock reads and bookkeeping), taken off."""

    def on_before_optimizer_step(self, *args: Any) -> None:
        EmptyPass.run()


CALLBACKS: dict[str, Callable[[], pl.Callback]] = {
    "AnomalyAlarm": AnomalyAlarm,
    "GradientFlowMonitor": GradientFlowMonitor,
    "AttentionEntropyMonitor": AttentionEntropyMonitor,
    "DataDiagnostics": DataDiagnostics,
    "SystemMonitor": SystemMonitor,
    "NoOp": NoOp,
    "NoOpPass": NoOpPass,
}
#: Per-batch work a callback does outside its hooks, timed like them (none since issue 43: SystemMonitor closes each
#: batch, and picks the next batch to time, inside its own ``on_train_batch_end``, which is timed as a hook).
EXTRA: dict[str, tuple[str, ...]] = {}


class _Ops(TorchDispatchMode):
    """Counts the aten operators dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def _is_quiet(step: int) -> bool:
    return step > 5 and step % INTERVAL not in (INTERVAL - 1, 0, 1)


class _Marks(pl.Callback):
    def __init__(self) -> None:
        self.marks: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.marks.append(time.perf_counter())

    def median_step(self, skip: int) -> float:
        return statistics.median(b - a for a, b in zip(self.marks[skip:], self.marks[skip + 1 :], strict=False))


def _trainer(root: str, callbacks: list[pl.Callback], steps: int) -> pl.Trainer:
    return pl.Trainer(
        default_root_dir=root,
        max_steps=steps,
        accelerator="cpu",
        logger=pl.loggers.TensorBoardLogger(root, name="run"),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        log_every_n_steps=INTERVAL,
    )


def inside(
    name: str,
    width: int,
    steps: int,
    root: str,
    count_ops: bool,
    floor: dict[str, float] | None = None,
    pass_of: str = "kernels",
    nested: float = 0.0,
) -> tuple[dict[str, float], float, float]:
    """One fit: by hook, the median CPU seconds over the quiet steps; the median over the quiet steps of their
    hooks' CPU seconds beyond the pass (``pass_of``: ``"kernels"``, the fused kernels alone, or ``"pass"``, the
    gradients listed, the kernels and the flag read), less ``floor`` (the empty hooks' median, by hook) for each
    hook timed in that step and ``nested`` (the inner window's own cost) for a step whose pass was timed; and the
    aten operators per quiet step."""
    cb = CALLBACKS[name]()
    seconds: dict[str, list[float]] = collections.defaultdict(list)
    per_step: dict[int, float] = collections.defaultdict(float)
    timed_floor: dict[int, float] = collections.defaultdict(float)  # the timing's own floor in each step
    passes: dict[int, float] = collections.defaultdict(float)
    ops = [0]
    current = [-1]  # the quiet step whose hook is running, else -1

    def wrap(hook: str) -> None:
        original = getattr(cb, hook)

        def timed(trainer: pl.Trainer, *args: Any, **kwargs: Any) -> Any:
            step = trainer.global_step
            if not _is_quiet(step):
                return original(trainer, *args, **kwargs)
            mode = _Ops() if count_ops else None
            current[0] = step
            start = time.thread_time()
            try:
                if mode is None:
                    return original(trainer, *args, **kwargs)
                with mode:
                    return original(trainer, *args, **kwargs)
            finally:
                spent = time.thread_time() - start
                current[0] = -1
                seconds[hook].append(spent)
                per_step[step] += spent
                timed_floor[step] += (floor or {}).get(hook, 0.0)
                if mode is not None:
                    ops[0] += mode.count

        setattr(cb, hook, timed)

    # What is timed as the pass: the fused kernels alone (`finite_probe`, where the guard and its pass call it, and
    # the sums of large CPU gradients decided on the host, `_sums_prove_finite`, where the pass has it), or the pass
    # as GradScaler makes its own (`OptimizerPass.clean`: list the gradients, the kernels, one read of the flag).
    guard_pass = sys.modules.get("lightning_diag.callbacks.anomaly_alarm.guard_pass")
    kernels_in = [m for m in (nonfinite_guard, guard_pass) if m is not None]
    host_sums = [(guard_pass, "_sums_prove_finite")] if hasattr(guard_pass, "_sums_prove_finite") else []
    targets: list[tuple[Any, str]] = {
        "kernels": [(m, "finite_probe") for m in kernels_in] + host_sums,
        "pass": [(getattr(nonfinite_guard, "OptimizerPass", None), "clean")],
        "empty": [(EmptyPass, "run")],
    }[pass_of]
    originals = [(owner, attr, getattr(owner, attr)) for owner, attr in targets]

    def timed(probe: Callable[..., Any]) -> Callable[..., Any]:
        def timed_probe(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return probe(*args, **kwargs)
            finally:
                if current[0] >= 0:
                    passes[current[0]] += time.thread_time() - start

        return timed_probe

    for hook in HOOKS:
        if getattr(type(cb), hook) is not getattr(pl.Callback, hook):  # a hook the callback implements
            wrap(hook)
    for method in EXTRA.get(name, ()):
        wrap(method)
    for owner, attr, probe in originals:
        setattr(owner, attr, timed(probe))
    try:
        _trainer(root, [cb], steps).fit(MLP(width), mlp_data(steps))
    finally:
        for owner, attr, probe in originals:
            setattr(owner, attr, probe)
    medians = {hook: statistics.median(v) for hook, v in seconds.items() if v}
    left = [t - passes[s] - timed_floor[s] - (nested if s in passes else 0.0) for s, t in per_step.items()]
    beyond = statistics.median(left) if left else 0.0
    return medians, beyond, ops[0] / max(len(per_step), 1)


def end_to_end(width: int, steps: int, reps: int, root: str, names: list[str]) -> dict[str, list[float]]:
    """Per repetition, each variant's median step over the bare fit's (interleaved; the order flips each time)."""
    variants: dict[str, Callable[[], list[pl.Callback]]] = {"bare": list}
    variants.update({f"{n} alone": (lambda n=n: [CALLBACKS[n]()]) for n in names})
    variants["all defaults"] = lambda: list(default_callbacks())
    ratios: dict[str, list[float]] = collections.defaultdict(list)
    for rep in range(reps):
        order = list(variants) if rep % 2 == 0 else list(reversed(variants))
        medians = {}
        for variant in order:
            marks = _Marks()
            _trainer(os.path.join(root, f"{variant}{rep}"), [marks, *variants[variant]()], steps).fit(
                MLP(width), mlp_data(steps)
            )
            medians[variant] = marks.median_step(skip=10)
        for variant, median in medians.items():
            ratios[variant].append(median / medians["bare"])
        ratios["bare ms"].append(medians["bare"] * 1e3)
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--callbacks", nargs="+", choices=list(CALLBACKS), default=["AnomalyAlarm", "GradientFlowMonitor"]
    )
    parser.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    parser.add_argument("--steps", type=int, default=200, help="steps per fit (default 200)")
    parser.add_argument("--quick", action="store_true", help="a small MLP, few steps: a smoke test")
    args = parser.parse_args(argv)
    width, steps, reps = (64, 60, 1) if args.quick else (600, args.steps, args.reps)
    t0 = time.perf_counter()
    lines = []
    with quiet(1), tempfile.TemporaryDirectory(prefix="quiet_") as root:
        # The timing's floor: the same windows around hooks that do nothing, hook by hook (median over reps).
        empty = [inside("NoOp", width, steps, os.path.join(root, f"noop{i}"), False)[0] for i in range(reps)]
        floor = {h: statistics.median(m[h] for m in empty) for h in HOOKS if all(h in m for m in empty)}
        floor_line = ", ".join(f"{h} {s * 1e6:.1f}" for h, s in floor.items())
        # The nested timing's floor: an empty hook calling an empty pass, timed the same way; what is left beyond
        # the pass is the inner window's clock reads and bookkeeping (taken off the "beyond" columns).
        nested = statistics.median(
            inside("NoOpPass", width, steps, os.path.join(root, f"nested{i}"), False, floor, "empty")[1]
            for i in range(reps)
        )
        for name in args.callbacks:
            # The operator count runs in a fit of its own: the dispatch mode would inflate the timed hooks.
            ops = inside(name, width, min(steps, 60), os.path.join(root, f"{name}-ops"), True)[2]
            runs = [
                inside(name, width, steps, os.path.join(root, f"{name}{i}"), False, floor, "kernels", nested)
                for i in range(reps)
            ]
            # (a tree older than the guard's one-call pass has no `OptimizerPass`: that column is then n/a)
            whole = [
                inside(name, width, steps, os.path.join(root, f"{name}p{i}"), False, floor, "pass", nested)[1]
                for i in range(reps if hasattr(nonfinite_guard, "OptimizerPass") else 0)
            ]
            order = [*HOOKS, *EXTRA.get(name, ())]
            hooks = sorted({h for medians, _, _ in runs for h in medians}, key=order.index)
            # net of the timing: the empty hook's median taken off (not below zero)
            per_hook = {
                h: max(statistics.median(m.get(h, 0.0) for m, _, _ in runs) - floor.get(h, 0.0), 0.0) for h in hooks
            }
            total = sum(per_hook.values())
            beyond = max(statistics.median(b for _, b, _ in runs), 0.0)
            past = f"{max(statistics.median(whole), 0.0) * 1e6:.0f}" if whole else "n/a"
            detail = ", ".join(f"{h} {s * 1e6:.0f}" for h, s in per_hook.items())
            lines.append(f"| {name} | {total * 1e6:.0f} | {beyond * 1e6:.0f} | {past} | {ops:.0f} | {detail} |")
        ratios = end_to_end(width, steps, reps, os.path.join(root, "e2e"), args.callbacks)
    bare_ms = statistics.median(ratios.pop("bare ms"))
    print(
        f"cpu, 1 thread; torch {torch.__version__}, pytorch_lightning {pl.__version__}; {steps} steps per fit, "
        f"{reps} reps; load average {os.getloadavg()[0]:.1f}; {time.perf_counter() - t0:.0f} s"
    )
    print(f"timing floor (an empty hook, µs, taken off below): {floor_line}")
    print(f"nested timing floor (an empty pass timed inside an empty hook, µs, taken off beyond): {nested * 1e6:.1f}")
    print()
    print(
        "| callback | quiet step CPU µs (sum of hook medians, net of the timing) "
        "| beyond the fused kernels µs (median step, net of the timing) "
        "| beyond the pass µs (gradients listed, kernels, flag read) "
        "| aten ops per quiet step | by hook (µs) |"
    )
    print("|---|---|---|---|---|---|")
    print("\n".join(lines))
    print()
    print(f"| variant | median step / bare (median over reps) | range | bare median step {bare_ms:.2f} ms |")
    print("|---|---|---|---|")
    for variant, values in ratios.items():
        if variant != "bare":
            print(f"| {variant} | {statistics.median(values):.3f}x | {min(values):.3f}-{max(values):.3f}x | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
