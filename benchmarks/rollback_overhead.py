"""Armed cost of ``AnomalyAlarm(on_nonfinite="rollback")`` against ``"stop"``: step time, snapshot time and memory.

Three measurements on the models of ``benchmarks/overhead.py``:

1. interleaved ``Trainer.fit`` runs (stop, rollback, stop, rollback, ...) of the MLP: the mean step time of
   rollback over stop (the mean, not the median: the snapshot steps are rare by design and the mean amortises
   them), per repetition, with the median and range;
2. in the same runs, the time spent inside the alarm's own hooks per step (every hook timed with
   ``perf_counter``, snapshots included), and, in isolation, the per-step work rollback adds (the batch
   reference and torch RNG copy, the loss ring): measures that the noise of a shared machine swamps less;
3. one snapshot of each model (transformer and MLP, with their AdamW state) timed directly, and its size: the
   amortised cost at the default interval is ``1 + snapshot time / (rollback.every_n_steps x step time)``.

    PYTHONPATH=. .venv/bin/python benchmarks/rollback_overhead.py            # CPU (about 2 minutes)
    PYTHONPATH=. .venv/bin/python benchmarks/rollback_overhead.py --quick    # smoke test
    PYTHONPATH=. .venv/bin/python benchmarks/rollback_overhead.py --device cuda
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from lightning_diag import AnomalyAlarm
from lightning_diag.demo.run import quiet
from lightning_diag.instrument.snapshots import SnapshotStore
from lightning_diag.rules.rollback import DEFAULT_ROLLBACK_EVERY_N_STEPS


def _overhead() -> Any:
    spec = importlib.util.spec_from_file_location("bench_overhead", Path(__file__).with_name("overhead.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def snapshot_cost(ov: Any, model: str, args: argparse.Namespace, step_ms: float) -> str:
    """Time one snapshot (model + AdamW state + scheduler) to the CPU; the amortised ratio at the default."""
    net = ov._model(model, args.quick, False).to(args.device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    for p in net.parameters():  # moments exist, as after the first step
        p.grad = torch.randn_like(p)
    opt.step()
    times = []
    store = SnapshotStore(keep=3, device="cpu")
    for _ in range(args.snapshot_reps):
        _sync(args.device)
        t0 = time.perf_counter()
        store.take(0, net, [opt], [], None)
        _sync(args.device)  # the copies are non-blocking on CUDA: count them complete
        times.append(time.perf_counter() - t0)
    snap = statistics.median(times) * 1e3
    amortised = 1 + snap / (DEFAULT_ROLLBACK_EVERY_N_STEPS * step_ms)
    return f"| {model} | {store.get(0).nbytes / 2**20:.1f} MiB | {snap:.2f} ms | {step_ms:.2f} ms | {amortised:.4f}x |"


_TIMED_HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",
    "on_train_start",
)


class HookClock:
    """Total seconds spent inside the timed hooks of the alarms it wrapped."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def alarm(self, **kwargs: Any) -> list[AnomalyAlarm]:
        alarm = AnomalyAlarm(**kwargs)
        for name in _TIMED_HOOKS:
            setattr(alarm, name, self._timed(getattr(alarm, name)))
        return [alarm]

    def _timed(self, fn: Any) -> Any:
        def hook(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return hook


def per_step_work_us(device: str, iterations: int = 20000) -> float:
    """Microseconds of the per-step bookkeeping of rollback and localisation, outside any Trainer."""
    recovery = AnomalyAlarm(on_nonfinite="rollback").recovery  # the alarm's, with its rollback detector
    batch, loss = object(), torch.tensor(1.0, device=device)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(iterations):
            recovery.on_batch_start(batch, i)
            recovery.store.observe_loss(loss)
            recovery.on_step_checked()
        _sync(device)
        times.append((time.perf_counter() - t0) / iterations * 1e6)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--quick", action="store_true", help="tiny models and few steps: a smoke test")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions of the MLP fits")
    parser.add_argument("--mlp-steps", type=int, default=400, help="steps per MLP fit")
    parser.add_argument("--snapshot-reps", type=int, default=5, help="timed snapshots per model")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU")
    if args.quick:
        args.reps, args.mlp_steps, args.snapshot_reps = 1, 60, 2
    ov = _overhead()
    ns = argparse.Namespace(
        device=args.device, quick=args.quick, log_every=50, cpu_transformer_log_every=5, threads=args.threads
    )
    clocks = {"stop": HookClock(), "rollback": HookClock()}
    variants = [
        ov.Variant("stop", lambda: clocks["stop"].alarm()),
        ov.Variant("rollback", lambda: clocks["rollback"].alarm(on_nonfinite="rollback")),
    ]
    t0 = time.perf_counter()
    with quiet(args.threads), tempfile.TemporaryDirectory(prefix="rollback_") as root:
        means: dict[str, list[float]] = {v.name: [] for v in variants}
        hook_ms: dict[str, list[float]] = {v.name: [] for v in variants}
        for rep in range(args.reps):
            for v in variants if rep % 2 == 0 else variants[::-1]:
                clocks[v.name].seconds = 0.0
                run, _ = ov.fit(v, "mlp", ns, os.path.join(root, str(rep)), args.mlp_steps, warmup=10)
                means[v.name].append(statistics.fmean(run.times))
                hook_ms[v.name].append(clocks[v.name].seconds / args.mlp_steps * 1e3)
        ratios = [r / s for r, s in zip(means["rollback"], means["stop"], strict=True)]
        extra = [r - s for r, s in zip(hook_ms["rollback"], hook_ms["stop"], strict=True)]
        hook_ratio = 1 + statistics.median(extra) / (statistics.median(means["stop"]) * 1e3)
        mlp_ms = statistics.median(means["stop"]) * 1e3
        rows = [snapshot_cost(ov, "mlp", args, mlp_ms)]
        if not args.quick:
            tf_run, _ = ov.fit(variants[0], "transformer", ns, os.path.join(root, "tf"), 8, warmup=2)
            rows.append(snapshot_cost(ov, "transformer", args, statistics.median(tf_run.times) * 1e3))
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu, {args.threads} thread(s)"
    print(
        f"device: {device}; torch {torch.__version__}; rollback.every_n_steps={DEFAULT_ROLLBACK_EVERY_N_STEPS}; "
        f"{time.perf_counter() - t0:.0f} s"
    )
    print()
    print("| fit | mean step time rollback / stop (median) | range over reps | reps x steps |")
    print("|---|---|---|---|")
    print(
        f"| mlp | {statistics.median(ratios):.3f}x | {min(ratios):.3f}-{max(ratios):.3f}x "
        f"| {args.reps} x {args.mlp_steps} |"
    )
    print()
    work = per_step_work_us(args.device, 2000 if args.quick else 20000)
    print(
        "| fit | alarm hooks per step, stop | rollback | extra per step | 1 + extra / step time "
        "| per-step work alone | 1 + work / step time |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| mlp | {statistics.median(hook_ms['stop']):.3f} ms | {statistics.median(hook_ms['rollback']):.3f} ms "
        f"| {statistics.median(extra):.3f} ms | {hook_ratio:.4f}x | {work:.1f} us "
        f"| {1 + work / (mlp_ms * 1e3):.4f}x |"
    )
    print()
    print("| model | snapshot size (weights + AdamW moments) | snapshot time | step time | amortised at default |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
