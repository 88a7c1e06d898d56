"""Overhead of the callbacks on a real ``Trainer.fit``: step time against a bare run, peak memory, memory growth.

Variants, run interleaved (A B A B ...) for several repetitions, each a fresh ``Trainer.fit`` of the same model:
bare; each callback of ``default_callbacks()`` alone; all defaults together; every-step gradient norms; the
opt-in activation-gradient hooks; Lightning's ``grad_norm`` logged every step; ``detect_anomaly=True``. Reported:
the median step time as a ratio to bare (median over repetitions of the per-repetition ratio, with the range),
the median step in ms, peak memory above the process baseline, and memory after ``--memory-steps`` steps
against after 100 (all defaults, small MLP).

    python benchmarks/overhead.py                  # full CPU run (about 8 minutes on a 2-core CPU)
    python benchmarks/overhead.py --quick          # smoke test (seconds)
    python benchmarks/overhead.py --device cuda    # CUDA-event timing and the host-sync check (needs a GPU)

Step time is the interval between consecutive ``on_train_batch_start`` calls (forward, backward, optimizer step,
every callback hook and the data loader), measured with ``time.perf_counter`` on the CPU and with CUDA events on
the GPU (no synchronisation inside the timed steps). With ``--device cuda`` every hook of the default callbacks
runs under ``torch.cuda.set_sync_debug_mode("warn")`` on steps that log nothing, and the host synchronisations
they cause are counted (target: 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import grad_norm
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_diag.callbacks.common.batch_hooks import TRAIN_BATCH_HOOKS
from lightning_diag.callbacks.gradient_flow.monitor import GradientFlowMonitor
from lightning_diag.demo.run import default_callbacks, quiet

COMMAND = "PYTHONPATH=. .venv/bin/python benchmarks/overhead.py"
_HOOKS = TRAIN_BATCH_HOOKS


# -- models ----------------------------------------------------------------------------------------------------
class BenchTransformer(pl.LightningModule):
    """4-layer ``nn.TransformerEncoder`` (d_model 256, 4 heads, feed-forward 1024) classifying random tokens."""

    def __init__(self, log_grad_norm: bool = False, d_model: int = 256, layers: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.log_grad_norm = log_grad_norm
        self.embed = nn.Embedding(1000, d_model)
        layer = nn.TransformerEncoderLayer(d_model, 4, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 10)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, labels = batch
        loss = nn.functional.cross_entropy(self.head(self.encoder(self.embed(tokens))[:, 0]), labels)
        self.log("train_loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.log_grad_norm:  # the Lightning docs' recipe, every step
            self.log_dict(grad_norm(self, norm_type=2))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class BenchMLP(BenchTransformer):
    """A small MLP (3 hidden layers of 256) regressing random targets."""

    def __init__(self, log_grad_norm: bool = False) -> None:
        pl.LightningModule.__init__(self)
        torch.manual_seed(0)
        self.log_grad_norm = log_grad_norm
        self.net = nn.Sequential(
            nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU()
        )
        self.out = nn.Linear(256, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.out(self.net(x)).squeeze(-1), y)
        self.log("train_loss", loss)
        return loss


#: Models of ``cost_table.py`` (issue 37 §4): the 1.1M-parameter MLP (4 hidden layers of 600, fast steps) and
#: the demo transformer (``TinyTransformerClassifier``), by name.
COST_TABLE_MODELS = ("mlp1e6", "demo_transformer")


def _cost_table() -> Any:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import cost_table

    return cost_table


def _data(model: str, steps: int, quick: bool, epoch_steps: int | None = None) -> DataLoader:
    if model == "mlp1e6":
        return _cost_table().mlp_data(steps, epoch_steps or 32)
    if model == "demo_transformer":
        return _cost_table().demo_data(steps)
    g = torch.Generator().manual_seed(0)
    if model == "transformer":
        batch, seq = (4, 16) if quick else (16, 128)
        n = batch * min(steps, 64)
        ds = TensorDataset(torch.randint(0, 1000, (n, seq), generator=g), torch.randint(0, 10, (n,), generator=g))
    else:
        batch, n = 64, 64 * min(steps, 64)
        ds = TensorDataset(torch.randn(n, 64, generator=g), torch.randn(n, generator=g))
    return DataLoader(ds, batch_size=batch, shuffle=True, generator=g)


def _model(model: str, quick: bool, log_grad_norm: bool) -> pl.LightningModule:
    if model == "mlp1e6":
        return _cost_table().MLP(64 if quick else 600)
    if model == "demo_transformer":
        return _cost_table().demo_transformer()
    if model == "transformer":
        return BenchTransformer(log_grad_norm, d_model=32 if quick else 256, layers=2 if quick else 4)
    return BenchMLP(log_grad_norm)


# -- variants --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Variant:
    """One configuration: its callbacks, Trainer arguments and whether the model logs ``grad_norm``."""

    name: str
    callbacks: Callable[[], Sequence[pl.Callback]]
    trainer: dict[str, Any] = dataclasses.field(default_factory=dict)
    log_grad_norm: bool = False


def single_callback_factories() -> dict[str, Callable[[], list[pl.Callback]]]:
    """``{class name: factory}`` for every callback of ``default_callbacks()``, each with its defaults."""
    return {type(cb).__name__: _factory(type(cb)) for cb in default_callbacks()}


def _factory(cls: type[pl.Callback]) -> Callable[[], list[pl.Callback]]:
    return lambda: [cls()]


def variants() -> list[Variant]:
    """Every configuration the benchmark compares, bare first."""
    out = [Variant("bare", list)]
    out += [Variant(f"{name} alone", factory) for name, factory in single_callback_factories().items()]
    out += [
        Variant("all defaults", default_callbacks),
        Variant(
            "every-step grad norms",
            lambda: [GradientFlowMonitor(log_every_n_steps=1, histogram_every_n_steps=0, log_weight_norms=False)],
        ),
        Variant("activation-gradient hooks", lambda: [GradientFlowMonitor(activation_grads=True)]),
        Variant("Lightning grad_norm every step", list, log_grad_norm=True),
        Variant("detect_anomaly=True", list, trainer={"detect_anomaly": True}),
    ]
    return out


# -- measuring -------------------------------------------------------------------------------------------------
def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):  # not Linux: peak RSS of the process instead
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class StepTimer(pl.Callback):
    """Marks the start of every training batch (perf_counter, or a CUDA event) and samples memory."""

    def __init__(self, device: str, sample_memory_at: tuple[int, ...] = (), clock: str = "wall") -> None:
        self.device = device
        self.clock = time.thread_time if clock == "thread" else time.perf_counter
        self.marks: list[Any] = []
        self.sample_memory_at = sample_memory_at
        self.memory: dict[int, int] = {}
        self.objects: dict[int, int] = {}
        self.peak_rss = 0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.device == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(self.clock())
            self.peak_rss = max(self.peak_rss, _rss_bytes())
        step = trainer.global_step
        if step in self.sample_memory_at and step not in self.memory:
            gc.collect()
            self.objects[step] = len(gc.get_objects())
            self.memory[step] = torch.cuda.memory_allocated() if self.device == "cuda" else _rss_bytes()

    def step_times(self, warmup: int) -> list[float]:
        """Seconds per step after ``warmup`` steps."""
        if self.device == "cuda":
            torch.cuda.synchronize()
            times = [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:], strict=False)]
        else:
            times = [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return times[warmup:]


class SyncProbe:
    """Counts host synchronisations inside the callbacks' hooks on steps where nothing is logged (CUDA only)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.counts: dict[str, int] = {}
        self.quiet_steps: set[int] = set()

    def quiet(self, step: int) -> bool:
        """Neither this step nor the next is a logging or measuring step."""
        return step % self.every not in (0, self.every - 1)

    def wrap(self, callbacks: list[pl.Callback]) -> None:
        for cb in callbacks:
            for hook in _HOOKS:
                if getattr(type(cb), hook) is getattr(pl.Callback, hook):
                    continue
                setattr(cb, hook, self._wrapped(f"{type(cb).__name__}.{hook}", getattr(cb, hook)))

    def _wrapped(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def hook(trainer: pl.Trainer, *args: Any, **kwargs: Any) -> Any:
            if not self.quiet(trainer.global_step):
                return fn(trainer, *args, **kwargs)
            self.quiet_steps.add(trainer.global_step)
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    return fn(trainer, *args, **kwargs)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    syncs = sum("synchroniz" in str(w.message) for w in seen)
                    self.counts[label] = self.counts.get(label, 0) + syncs

        return hook


@dataclasses.dataclass
class Run:
    times: list[float]
    peak: int


def fit(
    variant: Variant,
    model: str,
    args: argparse.Namespace,
    root: str,
    steps: int,
    sample_memory_at: tuple[int, ...] = (),
    probe: SyncProbe | None = None,
    warmup: int = 0,
) -> tuple[Run, StepTimer]:
    """One ``Trainer.fit`` of ``steps`` steps; returns the timed steps and the peak memory above the start."""
    callbacks = list(variant.callbacks())
    if probe is not None:
        probe.wrap(callbacks)
    timer = StepTimer(args.device, sample_memory_at, getattr(args, "clock", "wall"))
    trainer = pl.Trainer(
        default_root_dir=root,
        max_steps=steps,
        max_epochs=-1,
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=1,
        logger=pl.loggers.TensorBoardLogger(root, name=variant.name.replace(" ", "_")),
        callbacks=[*callbacks, timer],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        log_every_n_steps=_log_every(model, args),
        **variant.trainer,
    )
    net = _model(model, args.quick, variant.log_grad_norm)
    data = _data(model, steps, args.quick, getattr(args, "epoch_steps", None))
    gc.collect()
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    trainer.fit(net, data)
    peak = (torch.cuda.max_memory_allocated() if args.device == "cuda" else timer.peak_rss) - base
    return Run(timer.step_times(warmup), max(peak, 0)), timer


def _log_every(model: str, args: argparse.Namespace) -> int:
    # A CPU transformer fit is only a few steps long: log 10x more often than Lightning's default so that the
    # timed steps include logging steps (a conservative setting; the mean ratio shows their amortised cost).
    if model == "transformer" and args.device == "cpu":
        return args.cpu_transformer_log_every
    return args.log_every


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def benchmark(model: str, args: argparse.Namespace, root: str) -> list[str]:
    """Interleaved repetitions of every variant on one model; the markdown table rows."""
    vs = [v for v in variants() if args.variants is None or v.name in args.variants or v.name == "bare"]
    steps = args.steps if model == "transformer" else args.mlp_steps
    reps = args.reps
    runs: dict[str, list[Run]] = {v.name: [] for v in vs}
    for rep in range(reps):
        order = vs if rep % 2 == 0 else [vs[0], *reversed(vs[1:])]  # A B C .. / A .. C B: drift hits all alike
        for v in order:
            run, _ = fit(v, model, args, os.path.join(root, model, str(rep)), steps, warmup=_warmup(model, args))
            runs[v.name].append(run)
            print(f"  {model} rep {rep} {v.name}: {statistics.median(run.times) * 1e3:.2f} ms", file=sys.stderr)
    bare = [statistics.median(r.times) for r in runs["bare"]]
    bare_mean = [statistics.fmean(r.times) for r in runs["bare"]]
    rows = []
    for v in vs:
        ratios = [statistics.median(r.times) / b for r, b in zip(runs[v.name], bare, strict=True)]
        mean_ratios = [statistics.fmean(r.times) / b for r, b in zip(runs[v.name], bare_mean, strict=True)]
        pooled = statistics.median([t for r in runs[v.name] for t in r.times])
        peak = statistics.median([r.peak for r in runs[v.name]])
        rows.append(
            f"| {model} | {v.name} | {statistics.median(ratios):.3f}x | {min(ratios):.3f}-{max(ratios):.3f}x "
            f"| {statistics.median(mean_ratios):.3f}x | {pooled * 1e3:.2f} | {_fmt_bytes(peak)} |"
        )
    return rows


def _warmup(model: str, args: argparse.Namespace) -> int:
    return args.warmup if model == "transformer" else args.mlp_warmup


def memory_growth(args: argparse.Namespace, root: str) -> str:
    """All defaults on the MLP for ``--memory-steps`` steps: memory and live Python objects at 100 vs the end."""
    early = min(100, args.memory_steps // 2)
    last = args.memory_steps - 1
    variant = Variant("all defaults (memory)", default_callbacks)
    _, timer = fit(variant, "mlp", args, os.path.join(root, "memory"), args.memory_steps, (early, last))
    kind = "CUDA memory_allocated" if args.device == "cuda" else "process RSS"
    return (
        f"| mlp, all defaults | {kind} | step {early}: {_fmt_bytes(timer.memory[early])} | step {last}: "
        f"{_fmt_bytes(timer.memory[last])} | {_fmt_bytes(timer.memory[last] - timer.memory[early])} | "
        f"live Python objects {timer.objects[early]} -> {timer.objects[last]} "
        f"({timer.objects[last] - timer.objects[early]:+d}) |"
    )


def _warn_mode_defaults() -> list[pl.Callback]:
    from lightning_diag.callbacks.anomaly_alarm.alarm import AnomalyAlarm

    return [AnomalyAlarm(on_nonfinite="warn") if isinstance(cb, AnomalyAlarm) else cb for cb in default_callbacks()]


def sync_check(args: argparse.Namespace, root: str) -> list[str]:
    """Host synchronisations caused by the default callbacks' hooks on steps that log nothing (CUDA only).

    Twice: the defaults, whose ``AnomalyAlarm(on_nonfinite="stop")`` reads one flag per optimizer step by design
    (it must decide on the host whether to apply the update), and the defaults with ``on_nonfinite="warn"``.
    """
    probes = {}
    for label, factory in (("defaults", default_callbacks), ("defaults, on_nonfinite=warn", _warn_mode_defaults)):
        probe = SyncProbe(_log_every("transformer", args))
        fit(
            Variant(f"sync check {label}", factory),
            "transformer",
            args,
            os.path.join(root, label),
            args.steps,
            probe=probe,
        )
        probes[label] = probe
    hooks = sorted({h for p in probes.values() for h in p.counts})
    rows = [f"| {h} | " + " | ".join(str(p.counts.get(h, 0)) for p in probes.values()) + " |" for h in hooks]
    rows.append("| **total** | " + " | ".join(str(sum(p.counts.values())) for p in probes.values()) + " |")
    rows.append("| steps checked | " + " | ".join(str(len(p.quiet_steps)) for p in probes.values()) + " |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--quick", action="store_true", help="tiny models and few steps: a smoke test")
    parser.add_argument("--reps", type=int, default=None, help="interleaved repetitions (default 3; quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="steps per transformer fit (cpu 8, cuda 300)")
    parser.add_argument("--mlp-steps", type=int, default=None, help="steps per MLP fit (default 150)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed first transformer steps (default 2)")
    parser.add_argument("--mlp-warmup", type=int, default=None, help="untimed first MLP steps (default 20)")
    parser.add_argument("--log-every", type=int, default=50, help="Trainer log_every_n_steps (default 50)")
    parser.add_argument(
        "--cpu-transformer-log-every", type=int, default=5, help="log_every_n_steps of CPU transformer fits"
    )
    parser.add_argument("--memory-steps", type=int, default=None, help="steps of the memory run (default 1000)")
    parser.add_argument(
        "--models",
        nargs="+",
        choices=["transformer", "mlp", *COST_TABLE_MODELS],
        default=["transformer", "mlp"],
        help="mlp1e6 and demo_transformer: cost_table.py's 1.1M-parameter MLP and the demo transformer "
        "(--mlp-steps, --mlp-warmup apply to them)",
    )
    parser.add_argument(
        "--variants", nargs="+", default=None, help="only these variants (by name, e.g. 'all defaults'; bare always)"
    )
    parser.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default="wall",
        help="CPU step time: wall (perf_counter) or the training thread's CPU time (steadier on a shared machine)",
    )
    parser.add_argument(
        "--epoch-steps", type=int, default=None, help="batches per epoch of the mlp1e6 fits (default 32)"
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the memory-growth run")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (default 1: steadier on a shared CPU)"
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(
            "--device cuda needs a CUDA GPU, but torch.cuda.is_available() is False on this machine: nothing was "
            "measured (run it where a GPU is visible; docs/performance.md describes what it measures)"
        )
    if args.device == "cuda" and args.clock == "thread":
        parser.error("--clock thread is for CPU runs; CUDA steps are timed with CUDA events")
    known = {v.name for v in variants()}
    unknown = sorted(set(args.variants or ()) - known)
    if unknown:
        parser.error(f"unknown --variants {unknown}; choose from {sorted(known)}")
    quick = args.quick
    gpu = args.device == "cuda"
    args.reps = args.reps or (1 if quick else 3)
    args.steps = args.steps or (6 if quick else (300 if gpu else 8))
    args.mlp_steps = args.mlp_steps or (8 if quick else 150)
    args.warmup = args.warmup if args.warmup is not None else 2
    args.mlp_warmup = args.mlp_warmup if args.mlp_warmup is not None else (2 if quick else 20)
    args.memory_steps = args.memory_steps or (20 if quick else 1000)
    if quick:
        args.log_every, args.cpu_transformer_log_every = 3, 3
    for name, value in (
        ("--reps", args.reps),
        ("--steps", args.steps),
        ("--mlp-steps", args.mlp_steps),
        ("--log-every", args.log_every),
        ("--cpu-transformer-log-every", args.cpu_transformer_log_every),
        ("--threads", args.threads),
        ("--epoch-steps", args.epoch_steps or 1),
    ):
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    if args.steps <= args.warmup + 1 or args.mlp_steps <= args.mlp_warmup + 1:
        parser.error("--steps must exceed --warmup + 1 and --mlp-steps must exceed --mlp-warmup + 1")
    if args.memory_steps < 4:
        parser.error(f"--memory-steps must be >= 4, got {args.memory_steps}")
    with quiet(args.threads):
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    gpu = args.device == "cuda"
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="overhead_") as root:
        rows = []
        for model in args.models:
            rows += benchmark(model, args, root)
        memory = "| (skipped: --no-memory) | | | | | |" if args.no_memory else memory_growth(args, root)
        syncs = sync_check(args, os.path.join(root, "sync")) if gpu else []
    device = torch.cuda.get_device_name() if gpu else f"cpu, {torch.get_num_threads()} threads"
    print(
        f"device: {device}; torch {torch.__version__}, pytorch_lightning {pl.__version__}; reps {args.reps}, "
        f"transformer {args.steps} steps (first {args.warmup} untimed), mlp {args.mlp_steps} steps (first "
        f"{args.mlp_warmup} untimed) per fit; log_every_n_steps {args.log_every}"
        + (f" ({args.cpu_transformer_log_every} for the CPU transformer)" if not gpu else "")
        + f"; step clock {args.clock}; load average {os.getloadavg()[0]:.1f}"
        + f"; {time.perf_counter() - t0:.0f} s"
    )
    print()
    print(
        "| model | variant | step time / bare (median) | range over reps | mean step time / bare "
        "| median step ms | peak memory |"
    )
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    print("| run | measure | early | late | growth | objects |")
    print("|---|---|---|---|---|---|")
    print(memory)
    if gpu:
        print()
        print(f"Host synchronisations inside callback hooks on steps that log nothing (log every {args.log_every}):")
        print()
        print('| hook | defaults | defaults with `AnomalyAlarm(on_nonfinite="warn")` |')
        print("|---|---|---|")
        print("\n".join(syncs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
