"""What ``zero_output`` (AnomalyAlarm, issue 35) costs: its sampled step and its quiet step, on the demo transformer
and on real architectures of the corpus (one torch thread, CPU time of the training thread).

    PYTHONPATH=. .venv/bin/python benchmarks/zero_output_cost.py            # the rows of docs/performance.md
    PYTHONPATH=. .venv/bin/python benchmarks/zero_output_cost.py --reps 5   # quicker

A *sampled step* (every ``log_every_n_steps``): the watch's forward hooks installed on every module, a training
forward and backward with them (each call computes ``output.any()`` on the device), the hooks removed, the flags
combined per module and read in one transfer. Its cost is the difference with the same forward and backward bare
(medians over ``--reps``). A *quiet step*: :meth:`ZeroOutputCheck.on_batch_start` deciding not to watch (one integer
comparison) and :func:`end_sampled_batch` finding nothing installed (``take`` returns ``None``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from lightning_diag import AnomalyAlarm
from lightning_diag.callbacks.anomaly_alarm.sampled_check import end_sampled_batch
from lightning_diag.demo.corpus import build_corpus
from lightning_diag.demo.faults import build_fault
from lightning_diag.demo.run import quiet
from lightning_diag.instrument.output_watch import ZeroOutputWatch

COMMAND = "PYTHONPATH=. .venv/bin/python benchmarks/zero_output_cost.py"


def _cpu(fn: Callable[[], Any], reps: int) -> float:
    """Median CPU time of ``fn`` in ms (one warm-up call first)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return 1e3 * statistics.median(times)


def _models() -> list[tuple[str, Any, Callable[[Any], torch.Tensor], Any]]:
    out: list[tuple[str, Any, Callable[[Any], torch.Tensor], Any]] = []
    model, data, _ = build_fault("none")
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    out.append(("demo transformer", model, model.compute_loss, batch))
    for name in ("bert", "gpt2", "cnn"):
        module, cdata, _ = build_corpus(name)
        cdata.setup("fit")
        out.append((f"corpus `{name}`", module, module.compute_loss, next(iter(cdata.train_dataloader()))))
    return out


def measure(reps: int) -> list[dict[str, Any]]:
    """One row per model: modules watched, calls seen, bare step, sampled-step overhead, quiet-step cost."""
    rows = []
    for label, model, loss_fn, batch in _models():
        model.train()

        def bare(model: Any = model, loss_fn: Any = loss_fn, batch: Any = batch) -> None:
            loss_fn(batch).backward()
            model.zero_grad(set_to_none=True)

        watch = ZeroOutputWatch(model)

        def watched(model: Any = model, loss_fn: Any = loss_fn, batch: Any = batch, watch: Any = watch) -> None:
            watch.start()
            loss_fn(batch).backward()
            watch.stop()
            counts = watch.counts()
            if counts is not None:
                counts.tolist()
            model.zero_grad(set_to_none=True)

        base = _cpu(bare, reps)
        with_watch = _cpu(watched, reps)
        watch.start()
        loss_fn(batch)
        calls = len(watch._calls)
        watch.stop()
        watch.counts()

        check = AnomalyAlarm().runtime.zero_outputs  # the alarm's own, with the rule id its preset hands in

        class _Trainer:  # what the quiet path reads: a step the interval does not divide
            global_step = 7
            log_every_n_steps = 50
            world_size = 1

        trainer: Any = _Trainer()
        t0 = time.thread_time()
        n = 20000
        for _ in range(n):
            check.on_batch_start(trainer, model)
            end_sampled_batch((check,), trainer, model)
        quiet_us = 1e6 * (time.thread_time() - t0) / n
        rows.append(
            {
                "model": label,
                "modules": len(watch.order),
                "calls": calls,
                "step_ms": base,
                "sampled_ms": with_watch - base,
                "quiet_us": quiet_us,
            }
        )
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | modules watched | module calls per forward | bare forward + backward | sampled step: added "
        "| share at every 5 / 50 steps | quiet step |"
    )
    out = [head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        share5 = r["sampled_ms"] / 5 / r["step_ms"]
        share50 = r["sampled_ms"] / 50 / r["step_ms"]
        out.append(
            f"| {r['model']} | {r['modules']} | {r['calls']} | {r['step_ms']:.1f} ms | {r['sampled_ms']:.2f} ms "
            f"({r['sampled_ms'] / r['step_ms']:.0%}) | {share5:.1%} / {share50:.2%} | {r['quiet_us']:.2f} µs |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=15, help="timed repetitions per measurement (median)")
    args = parser.parse_args(argv)
    with quiet(1):
        print(render(measure(args.reps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
