"""Cost of the sharded gradient measurement against DDP's, and of the non-finite guard's finite check.

Part 1 (default): one measured step of ``GradientFlowMonitor`` (:func:`lightning_diag.instrument.grad_measure.
measure_step`: per-layer norms, RMS, ``||g||/||W||``, blocks, the cross-rank collective and the one host copy)
at 2 and 4 gloo CPU processes, on the same MLP (4 blocks of ``Linear(d, 4d) -> GELU -> Linear(4d, d)`` with
LayerNorm, d = 256: 2.1M parameters):

* ``ddp``: plain replicated parameters (DDP's all-reduced gradients): local norms plus the loss all-reduce;
* ``fsdp2``: the same model under ``fully_shard`` (DTensor shards): local sums of squares, weighted, and ONE
  all-reduce of the per-layer vector;
* ``gather``: what not to do, for scale: ``full_tensor()`` of every gradient shard, then local norms.

Part 2 (``--finite-check``): the guard's per-step check on a 1.1M-parameter MLP's gradients on one CPU thread:
the exact max-abs pass (before) against the fused L2 fast pass (after), and both under ``Trainer.fit`` with
``AnomalyAlarm()`` alone against a bare fit.

    python benchmarks/sharded_norm.py                 # part 1 at 2 and 4 processes (about a minute)
    python benchmarks/sharded_norm.py --procs 2       # one process count
    python benchmarks/sharded_norm.py --finite-check  # part 2
    python benchmarks/sharded_norm.py --quick         # smoke test of both parts (seconds)
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_diag.instrument.grad_measure import ParamIndex, measure_step
from lightning_diag.stats.norms import all_finite, fast_finite, max_abs


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(blocks)])
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1)


def _time(fn: Any, reps: int) -> float:
    """Median wall time of ``fn`` in ms, every rank starting together (a barrier before each call)."""
    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    # every rank reports its median; the slowest rank's is the step's cost
    t = torch.tensor(statistics.median(times) * 1e3)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _sum(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t)
    return t


def _gathered_norms(grads: list[Any]) -> list[float]:
    return torch.stack([g.full_tensor().norm() for g in grads]).tolist()


def _worker(rank: int, world: int, store: str, d: int, blocks: int, reps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    x = torch.randn(32, d, generator=torch.Generator().manual_seed(rank))
    results = {}
    for mode in ("ddp", "fsdp2"):
        torch.manual_seed(0)
        net = Net(d, blocks)
        if mode == "fsdp2":
            mesh = init_device_mesh("cpu", (world,))
            for block in net.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(net, mesh=mesh)
            model: nn.Module = net
        else:
            model = nn.parallel.DistributedDataParallel(net)
        loss = model(x).pow(2).mean()
        loss.backward()
        named = list(net.named_parameters())
        modules = dict(net.named_modules())
        index = ParamIndex([n for n, _ in named], [p for _, p in named], False, modules, world_size=world)
        step = functools.partial(measure_step, index, list(range(len(named))), loss.detach(), _sum)
        results[mode] = _time(step, reps)
        if mode == "fsdp2":
            gather = functools.partial(_gathered_norms, [p.grad for _, p in named])
            results["gather"] = _time(gather, reps)
    if rank == 0:
        n = sum(p.numel() for p in Net(d, blocks).parameters())
        with open(out, "a") as fh:
            fh.write(
                f"| {world} | {n / 1e6:.1f}M | {results['ddp']:.2f} | {results['fsdp2']:.2f} |"
                f" {results['fsdp2'] / results['ddp']:.2f}x | {results['gather']:.2f} |\n"
            )
    dist.destroy_process_group()


def sharded_cost(procs: list[int], d: int, blocks: int, reps: int) -> str:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.md")
        for world in procs:
            store = os.path.join(tmp, f"store{world}")
            mp.spawn(_worker, args=(world, store, d, blocks, reps, out), nprocs=world, join=True)
        with open(out) as fh:
            rows = fh.read()
    head = (
        "| processes | parameters | DDP (ms) | FSDP2 sharded (ms) | ratio | full_tensor() gather (ms) |\n"
        "|---|---|---|---|---|---|\n"
    )
    return head + rows


# -- part 2: the finite check ----------------------------------------------------------------------------------
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 64))


def finite_check(reps: int, fit_steps: int) -> str:
    import pytorch_lightning as pl

    import lightning_diag.callbacks.anomaly_alarm.nonfinite_guard as guard
    from lightning_diag import AnomalyAlarm

    torch.set_num_threads(1)
    net = _mlp()
    net(torch.randn(64, 512)).pow(2).mean().backward()
    grads = [p.grad for p in net.parameters()]
    n = sum(g.numel() for g in grads)  # type: ignore[union-attr]

    def per_call(fn: Any) -> float:
        fn(grads)
        start = time.perf_counter()
        for _ in range(reps):
            bool(fn(grads))
        return (time.perf_counter() - start) / reps * 1e3

    before, after = per_call(all_finite), per_call(fast_finite)

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            x = torch.randn(64 * fit_steps, 512, generator=torch.Generator().manual_seed(0))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=64)

    def fit(callbacks: list[Any], root: str) -> float:
        trainer = pl.Trainer(
            max_steps=fit_steps,
            accelerator="cpu",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks,
            default_root_dir=root,
        )
        start = time.perf_counter()
        trainer.fit(Model())
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"bare": [], "fast": [], "max-abs": []}
    original = guard.norm_sum
    with tempfile.TemporaryDirectory() as root:
        for _ in range(3):  # interleaved repetitions
            times["bare"].append(fit([], root))
            times["fast"].append(fit([AnomalyAlarm()], root))
            guard.norm_sum = max_abs  # the check as it was: the exact max-abs pass every step
            try:
                times["max-abs"].append(fit([AnomalyAlarm()], root))
            finally:
                guard.norm_sum = original
    bare, fast, slow = (statistics.median(times[k]) for k in ("bare", "fast", "max-abs"))
    return (
        f"finite check of {n / 1e6:.2f}M float32 gradients (1 CPU thread): max-abs (before) {before:.2f} ms,"
        f" fused L2 fast pass (after) {after:.2f} ms ({before / after:.1f}x)\n"
        f"Trainer.fit, {fit_steps} steps: bare {bare:.2f} s, AnomalyAlarm() with the fast pass {fast:.2f} s"
        f" ({fast / bare:.2f}x), with the max-abs pass {slow:.2f} s ({slow / bare:.2f}x)\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--finite-check", action="store_true", help="part 2: the non-finite guard's check")
    parser.add_argument("--quick", action="store_true", help="small model, few repetitions (smoke test)")
    args = parser.parse_args()
    if args.finite_check or args.quick:
        print(finite_check(reps=5 if args.quick else 200, fit_steps=5 if args.quick else 100))
    if not args.finite_check:
        d, blocks, reps = (32, 1, 3) if args.quick else (256, 4, 30)
        print(sharded_cost([2] if args.quick else args.procs, d, blocks, reps))


if __name__ == "__main__":
    main()
