"""Where a measuring step's time goes: CPU time of the training thread inside named functions of the defaults.

One fit of the ``cost_table.py`` MLP (``--width 600``: 1.1M parameters, AdamW, batch 64, one torch thread) with
``default_callbacks()``, ``log_every_n_steps=10`` and 20-batch epochs (issue 43's case). Each function of
:data:`TARGETS` is wrapped, for this process only, by a timer of ``time.thread_time`` (nested functions count in
their callers too), and the script prints for each: calls, CPU µs per call, and µs per training step (its total
over the fit's steps: the share of a step it costs on average). The first call of a function pays its one-time
set-up (the histogram table: about 45 ms once a process) and is included.

    PYTHONPATH=. .venv/bin/python benchmarks/measuring_step.py              # 600 steps, about 30 s
    PYTHONPATH=. .venv/bin/python benchmarks/measuring_step.py --quick      # smoke test (seconds)
    PYTHONPATH=. .venv/bin/python benchmarks/measuring_step.py --ops --steps 100   # aten operators per call

With ``--ops`` the fit runs under a ``TorchDispatchMode`` that counts the aten operators dispatched inside each
function (nested functions count in their callers too; the activation watch's forward pre-hooks are counted as
``ActivationWatch hooks``) and the table gives operators per call instead of times (the mode slows every operator
down: times are not printed then).

The wrappers replace attributes of lightning_diag's modules and classes in this benchmark's process, and are taken
off after the fit; the library itself patches nothing.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cost_table import MLP, mlp_data

from lightning_diag.demo.run import default_callbacks, quiet

#: ``module[:Class] function``: what is timed.
TARGETS = """
lightning_diag.callbacks.gradient_flow.monitor:GradientFlowMonitor on_before_optimizer_step
lightning_diag.callbacks.gradient_flow.monitor:GradientFlowMonitor on_train_batch_end
lightning_diag.callbacks.gradient_flow.monitor:GradientFlowMonitor on_train_batch_start
lightning_diag.callbacks.gradient_flow.monitor:GradientFlowMonitor on_before_backward
lightning_diag.callbacks.gradient_flow.monitor:GradientFlowMonitor on_after_backward
lightning_diag.callbacks.gradient_flow.monitor measure_step
lightning_diag.callbacks.gradient_flow.monitor write_histograms
lightning_diag.callbacks.gradient_flow.monitor update_vector
lightning_diag.callbacks.gradient_flow.monitor update_values_from
lightning_diag.instrument.grad_measure per_tensor_norms
lightning_diag.instrument.activation_watch _zero_share
lightning_diag.callbacks.gradient_flow.monitor stuck_parameters
lightning_diag.callbacks.gradient_flow.monitor:GradientFlowMonitor _judge_activations
lightning_diag.callbacks.gradient_flow.monitor:GradientFlowMonitor _judge_updates
lightning_diag.callbacks.gradient_flow.monitor:GradientFlowMonitor _sample_updates
lightning_diag.callbacks.gradient_flow.monitor:GradientFlowMonitor _zero_arm
lightning_diag.instrument.activation_watch:ActivationWatch readings
lightning_diag.instrument.activation_watch:ActivationWatch take
lightning_diag.stats.updates:ElementSample gather
lightning_diag.output.writer:DiagWriter scalars
lightning_diag.output.writer:DiagWriter _send_pending
lightning_diag.instrument.activation_watch:ActivationWatch attach
lightning_diag.callbacks.common.base:DiagCallback threshold_lines
lightning_diag.callbacks.anomaly_alarm.loss_trend:LossTrend close_period
lightning_diag.callbacks.anomaly_alarm.alarm:AnomalyAlarm on_before_optimizer_step
lightning_diag.callbacks.anomaly_alarm.alarm:AnomalyAlarm on_train_batch_start
lightning_diag.callbacks.anomaly_alarm.alarm:AnomalyAlarm on_train_batch_end
lightning_diag.callbacks.anomaly_alarm.alarm:AnomalyAlarm on_train_epoch_end
lightning_diag.callbacks.attention_entropy.monitor:AttentionEntropyMonitor on_train_batch_start
lightning_diag.callbacks.attention_entropy.monitor:AttentionEntropyMonitor on_train_batch_end
lightning_diag.callbacks.anomaly_alarm.guard_pass:OptimizerPass clean
lightning_diag.callbacks.anomaly_alarm.guard_pass:OptimizerPass clean_measured
lightning_diag.instrument.grad_measure:WeightCopies take
lightning_diag.callbacks.gradient_flow.writes cpu_histogram
lightning_diag.output.writer:DiagWriter histogram_raw
lightning_diag.callbacks.anomaly_alarm.runtime_checks:RuntimeChecks on_train_batch_end
lightning_diag.callbacks.anomaly_alarm.zero_output_check:ZeroOutputCheck measure
lightning_diag.callbacks.anomaly_alarm.output_collapse_check:OutputCollapseCheck measure
lightning_diag.callbacks.anomaly_alarm.runtime_checks end_sampled_batch
lightning_diag.callbacks.anomaly_alarm.zero_output_check:ZeroOutputCheck gather
lightning_diag.callbacks.anomaly_alarm.output_collapse_check:OutputCollapseCheck gather
lightning_diag.rules.loss_outlier:LossOutlierRule judge
lightning_diag.rules.loss_stagnant:LossStagnantRule judge
lightning_diag.rules.loss_swing:LossSwingRule judge
"""

#: Functions of main ``83654a2`` that this tree replaced, timed where a tree still has them (before/after runs):
#: ``update_values`` by ``update_vector`` + ``update_values_from``, ``on_batch_end`` by ``end_sampled_batch``.
FORMER_TARGETS = """
lightning_diag.callbacks.gradient_flow.monitor update_values
lightning_diag.callbacks.anomaly_alarm.sampled_check:SampledCheck on_batch_end
"""

#: A method the class inherits (its wrapper is removed again, not replaced).
_INHERITED = object()


class _OpCounter(TorchDispatchMode):
    """Counts the aten operators dispatched while it is entered, for every label on :attr:`stack`."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.ops: collections.Counter[str] = collections.Counter()
        self.names: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for label in set(self.stack):
            self.ops[label] += 1
            self.names[label][str(func).removeprefix("aten.")] += 1
        return func(*args, **(kwargs or {}))


def _timed(
    fn: Callable[..., Any],
    label: str,
    seconds: dict[str, float],
    calls: collections.Counter[str],
    counter: _OpCounter | None = None,
) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if counter is not None:
            counter.stack.append(label)
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[label] += time.thread_time() - start
            calls[label] += 1
            if counter is not None:
                counter.stack.pop()

    return wrapper


def _hook_factory(
    factory: Callable[..., Any], seconds: dict[str, float], calls: collections.Counter[str], counter: _OpCounter | None
) -> Any:
    """``ActivationWatch``'s hook factories, whose hooks are timed (and counted) under one label."""

    @functools.wraps(factory)
    def make(*args: Any, **kwargs: Any) -> Any:
        return _timed(factory(*args, **kwargs), "ActivationWatch hooks", seconds, calls, counter)

    return make


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600, help="steps of the fit (default 600)")
    parser.add_argument("--width", type=int, default=600, help="MLP width (default 600: 1.1M parameters)")
    parser.add_argument("--quick", action="store_true", help="a small MLP, few steps: a smoke test")
    parser.add_argument("--ops", action="store_true", help="count aten operators per call instead of timing")
    args = parser.parse_args(argv)
    steps, width = (30, 32) if args.quick else (args.steps, args.width)
    seconds: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter[str] = collections.Counter()
    originals: list[tuple[Any, str, Any]] = []
    counter = _OpCounter() if args.ops else None
    from lightning_diag.instrument.activation_watch import ActivationWatch

    for hook in ("_layer_hook", "_activation_hook"):
        originals.append((ActivationWatch, hook, vars(ActivationWatch)[hook]))
        setattr(ActivationWatch, hook, _hook_factory(getattr(ActivationWatch, hook), seconds, calls, counter))
    skipped: dict[bool, list[str]] = {False: [], True: []}
    former = set(FORMER_TARGETS.strip().splitlines())
    for line in TARGETS.strip().splitlines() + sorted(former):
        where, name = line.split()
        module, _, cls = where.partition(":")
        owner: Any = importlib.import_module(module)
        if cls:
            owner = getattr(owner, cls)
        if not hasattr(owner, name):  # a function another tree has (the targets span the trees compared)
            skipped[line in former].append(f"{cls or module}.{name}")
            continue
        label = f"{cls or module.removeprefix('lightning_diag.callbacks.')}.{name}"
        originals.append((owner, name, vars(owner).get(name, _INHERITED)))
        setattr(owner, name, _timed(getattr(owner, name), label, seconds, calls, counter))
    if skipped[True] or skipped[False]:
        former_note = f"; former functions of main 83654a2 (kept for before/after runs): {', '.join(skipped[True])}"
        print(
            f"measuring_step: not in this tree, not timed: {', '.join(skipped[False]) or 'none'}"
            + (former_note if skipped[True] else ""),
            file=sys.stderr,
        )
    try:
        if counter is not None:
            with counter:
                total = _fit(steps, width)
        else:
            total = _fit(steps, width)
    finally:
        for owner, name, original in originals:  # the process's classes and modules as they were
            if original is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
    if counter is not None:
        print(f"{steps} steps; aten operators dispatched inside each function (nested ones included)")
        print()
        print("| function | calls | operators per call | operators per step | most dispatched (per call) |")
        print("|---|---|---|---|---|")
        for label in sorted(calls, key=lambda k: -counter.ops[k]):
            ops, n = counter.ops[label], calls[label]
            top = ", ".join(f"{name} {c / n:.1f}" for name, c in counter.names[label].most_common(5))
            print(f"| `{label}` | {n} | {ops / n:.1f} | {ops / steps:.1f} | {top} |")
        return 0
    print(f"{steps} steps, {total / steps * 1e3:.2f} ms of CPU a step (timers included), load {os.getloadavg()[0]:.1f}")
    print()
    print("| function | calls | µs per call | µs per step |")
    print("|---|---|---|---|")
    for label, sec in sorted(seconds.items(), key=lambda kv: -kv[1]):
        print(f"| `{label}` | {calls[label]} | {sec / calls[label] * 1e6:.0f} | {sec / steps * 1e6:.1f} |")
    return 0


def _fit(steps: int, width: int) -> float:
    """One fit with the defaults; its CPU seconds."""
    with quiet(1), tempfile.TemporaryDirectory(prefix="measuring_") as root:
        trainer = pl.Trainer(
            default_root_dir=root,
            max_steps=steps,
            accelerator="cpu",
            logger=pl.loggers.TensorBoardLogger(root, name="run"),
            callbacks=list(default_callbacks()),
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            limit_val_batches=0,
            log_every_n_steps=10,
        )
        start = time.thread_time()
        trainer.fit(MLP(width), mlp_data(steps, 20))
        return time.thread_time() - start


if __name__ == "__main__":
    sys.exit(main())
