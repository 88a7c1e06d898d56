"""The gradient histograms' cost per call: ``stats.histogram.cpu_histogram`` on the 1.1M-parameter MLP's gradients.

``GradientFlowMonitor`` writes one histogram per parameter every ``histogram_every_n_steps`` (by default every
100 steps at ``log_every_n_steps=10``): on ``cost_table.py``'s ``MLP(600)`` that is 10 tensors, 1.12M float32
values. This times :func:`cpu_histogram` over the 10 gradients (after a few AdamW steps, so they are a trained
model's), warm (the same call repeated) and cold (a 64 MiB buffer written between calls, as the histogram
step finds the caches in a fit), one thread, and ``add_histogram``'s own computation
(``torch.utils.tensorboard.summary.histogram``: the float64 copy and NumPy's sort) for reference. Run it with each
tree's package on ``PYTHONPATH`` to compare two versions::

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/histogram_cost.py            # about 20 s
    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/histogram_cost.py --reps 5   # smoke test
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
from torch.utils.tensorboard.summary import histogram

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cost_table import MLP, mlp_data

from lightning_diag.stats.histogram import cpu_histogram, default_edges


def gradients(steps: int = 5) -> list[torch.Tensor]:
    """The gradients of ``MLP(600)``'s 10 parameters after ``steps`` AdamW steps on ``mlp_data``."""
    model = MLP(600)
    optimizer = model.configure_optimizers()
    for x, y in mlp_data(steps, steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model.net(x).squeeze(-1), y).backward()
        optimizer.step()
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def per_call_ms(work: Callable[[], object], reps: int, cold: bool) -> list[float]:
    """Milliseconds of thread CPU time per call of ``work``, ``reps`` times (the caches flushed before each when
    ``cold``)."""
    flush = torch.zeros(16 << 20)  # 64 MiB: more than the last-level cache
    times = []
    for _ in range(reps):
        if cold:
            flush.add_(1.0)
        start = time.thread_time()
        work()
        times.append((time.thread_time() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=40, help="calls timed per case (default 40)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    grads = gradients()
    edges = np.array(default_edges(), dtype=float)
    print(f"{len(grads)} gradients, {sum(g.numel() for g in grads):,} values; load average {os.getloadavg()[0]:.1f}")
    start = time.thread_time()
    cpu_histogram(grads[0])  # the table, once a process
    print(f"first call (builds the prefix table): {(time.thread_time() - start) * 1e3:.1f} ms")
    cases = {
        "cpu_histogram, 10 gradients": lambda: [cpu_histogram(g) for g in grads],
        "add_histogram's computation (reference)": lambda: [histogram("t", g, edges) for g in grads],
    }
    for name, work in cases.items():
        for cold in (False, True):
            times = per_call_ms(work, args.reps if "cpu" in name else max(args.reps // 8, 2), cold)
            quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else times * 3
            print(
                f"{name:42s} {'cold' if cold else 'warm'}: median {statistics.median(times):6.2f} ms "
                f"(quartiles {quartiles[0]:.2f}-{quartiles[2]:.2f})"
            )


if __name__ == "__main__":
    main()
