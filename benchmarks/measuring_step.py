"""Where a measuring step's time goes: CPU time of the training thread inside named functions of the defaults.

One fit of the ``cost_table.py`` MLP (``--width 600``: 1.1M parameters, AdamW, batch 64, one torch thread) with
``default_callbacks()``, ``log_every_n_steps=10`` and 20-batch epochs (issue 43's case). Each function of
:data:`TARGETS` is wrapped, for this process only, by a timer of ``time.thread_time`` (nested functions count in
their callers too), and the script prints for each: calls, CPU µs per call, and µs per training step (its total
over the fit's steps: the share of a step it costs on average). The first call of a function pays its one-time
set-up (the histogram table: about 45 ms once a process) and is included.

    PYTHONPATH=. .venv/bin/python benchmarks/measuring_step.py              # 600 steps, about 30 s
    PYTHONPATH=. .venv/bin/python benchmarks/measuring_step.py --quick      # smoke test (seconds)

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
lightning_diag.callbacks.gradient_flow.monitor update_values
lightning_diag.callbacks.gradient_flow.monitor stuck_parameters
lightning_diag.callbacks.gradient_flow.monitor:GradientFlowMonitor _judge_activations
lightning_diag.callbacks.gradient_flow.monitor:GradientFlowMonitor _judge_updates
lightning_diag.callbacks.gradient_flow.monitor:GradientFlowMonitor _sample_updates
lightning_diag.callbacks.gradient_flow.monitor:GradientFlowMonitor _zero_arm
lightning_diag.instrument.activation_watch:ActivationWatch readings
lightning_diag.stats.updates:ElementSample gather
lightning_diag.output.writer:DiagWriter scalars
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
"""

#: A method the class inherits (its wrapper is removed again, not replaced).
_INHERITED = object()


def _timed(fn: Callable[..., Any], label: str, seconds: dict[str, float], calls: collections.Counter[str]) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[label] += time.thread_time() - start
            calls[label] += 1

    return wrapper


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600, help="steps of the fit (default 600)")
    parser.add_argument("--width", type=int, default=600, help="MLP width (default 600: 1.1M parameters)")
    parser.add_argument("--quick", action="store_true", help="a small MLP, few steps: a smoke test")
    args = parser.parse_args(argv)
    steps, width = (30, 32) if args.quick else (args.steps, args.width)
    seconds: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter[str] = collections.Counter()
    originals: list[tuple[Any, str, Any]] = []
    for line in TARGETS.strip().splitlines():
        where, name = line.split()
        module, _, cls = where.partition(":")
        owner: Any = importlib.import_module(module)
        if cls:
            owner = getattr(owner, cls)
        label = f"{cls or module.removeprefix('lightning_diag.callbacks.')}.{name}"
        originals.append((owner, name, vars(owner).get(name, _INHERITED)))
        setattr(owner, name, _timed(getattr(owner, name), label, seconds, calls))
    try:
        total = _fit(steps, width)
    finally:
        for owner, name, original in originals:  # the process's classes and modules as they were
            if original is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
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
