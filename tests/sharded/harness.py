"""Sharded-training harness: a tiny model parallelised in ``configure_model`` (FSDP2, TP, both, HSDP), a
multi-process gloo ``Trainer.fit`` through ``ModelParallelStrategy`` on CPU in a subprocess, and the same model
single-process for comparison.

Use from a test::

    result = run_sharded(tmp_path, mode="fsdp2")          # 2 processes; 4 for "fsdp2_tp" and "hsdp"
    reference = run_single(tmp_path / "single")           # same seed, same global batch, one process
    result["scalars"]["diag/grad_norm/total"]             # {step: value}, as logged on global rank zero

Run as a script (what :func:`run_sharded` launches; Lightning's launcher re-runs it once per rank)::

    python tests/sharded/harness.py CONFIG.json

``CONFIG.json`` holds ``root``, ``mode``, ``max_steps``, ``nan_rank``/``nan_step`` (a NaN in that rank's
``blocks.1.fc2`` output at that global step), ``callbacks`` (keyword arguments per callback class name) and
``seed``. Each rank writes ``<root>/rank<r>.json``: the global step it ended at, its alerts per callback, the
scalars it logged (global rank zero only logs), whether its parameters are finite, and which parameters are
DTensors and which have an empty local shard here.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn

from tests import launch

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from lightning_diag import AnomalyAlarm, GradientFlowMonitor  # noqa: E402
from lightning_diag.output.writer import set_logger_series  # noqa: E402

#: Width, blocks, batch per data-parallel rank, batches in the data set (at that batch size).
D, BLOCKS, BATCH, BATCHES = 64, 2, 8, 16
#: Processes each mode runs on, and its (data_parallel_size, tensor_parallel_size).
MODES: dict[str, tuple[int, int, int]] = {
    "fsdp2": (2, 2, 1),
    "tp": (2, 1, 2),
    "fsdp2_tp": (4, 2, 2),
    "hsdp": (4, 4, 1),
}
SCRIPT = Path(__file__)


class Block(nn.Module):
    """Pre-norm MLP block: ``x + fc2(gelu(fc1(norm(x))))``; fc1 column-wise, fc2 row-wise under TP."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Gate(nn.Module):
    """One learned scalar (shape ``[1]``): FSDP2 shards dim 0 over the data-parallel ranks, so rank 1's local
    shard is empty."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class ShardedModel(pl.LightningModule):
    """Regression ``y = <x, w>`` through ``BLOCKS`` blocks, a gate and a head, parallelised per ``mode``.

    Args:
        mode: ``"single"`` (nothing), ``"fsdp2"``, ``"tp"``, ``"fsdp2_tp"`` or ``"hsdp"``.
        seed: Seed of the weights and the data (the same on every rank and in the single-process run).
        batch: Batch size per data-parallel rank (the single-process run uses the global batch).
        nan_rank: Global rank whose ``blocks.1.fc2`` output turns NaN at ``nan_step`` (``None``: never).
        nan_step: Global step of the NaN.
    """

    def __init__(
        self,
        mode: str = "single",
        seed: int = 0,
        batch: int = BATCH,
        nan_rank: int | None = None,
        nan_step: int = -1,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.mode, self.seed, self.batch, self.nan_rank, self.nan_step = mode, seed, batch, nan_rank, nan_step
        self.inp = nn.Linear(8, D)
        self.blocks = nn.ModuleList([Block(D) for _ in range(BLOCKS)])
        self.gate = Gate()
        self.head = nn.Linear(D, 1)
        self.blocks[1].fc2.register_forward_hook(self._maybe_nan)

    def _maybe_nan(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        if self.global_rank == self.nan_rank and self.global_step == self.nan_step and self.training:
            return output * math.nan
        return None

    def configure_model(self) -> None:
        if self.mode == "single":
            return
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = self.device_mesh
        if self.mode in ("tp", "fsdp2_tp"):
            tp = mesh["tensor_parallel"]
            for block in self.blocks:
                parallelize_module(block, tp, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        if self.mode in ("fsdp2", "fsdp2_tp"):
            dp = mesh["data_parallel"]
            for block in self.blocks:
                fully_shard(block, mesh=dp)
            fully_shard(self, mesh=dp)
        if self.mode == "hsdp":
            # 4 data-parallel ranks as 2 replicas x 2 shards: fully_shard on a 2-D mesh is HSDP.
            hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            for block in self.blocks:
                fully_shard(block, mesh=hsdp)
            fully_shard(self, mesh=hsdp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.gate(h)).squeeze(-1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(self.seed + 1)
        x = torch.randn(BATCH * BATCHES, 8, generator=g)  # one data set whatever the batch size
        y = x @ torch.randn(8, generator=g)
        data = torch.utils.data.TensorDataset(x, y)
        if self.mode == "single":
            return torch.utils.data.DataLoader(data, batch_size=self.batch)
        # No shuffling: rank r of R data-parallel ranks gets samples r, r+R, ..., so one step's batches over the
        # ranks are exactly the single-process run's global batch (Lightning's own sampler shuffles).
        dp = self.device_mesh["data_parallel"]
        sampler = torch.utils.data.DistributedSampler(
            data, num_replicas=dp.size(), rank=dp.get_local_rank(), shuffle=False
        )
        return torch.utils.data.DataLoader(data, batch_size=self.batch, sampler=sampler)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class _Logger(pl.loggers.Logger):
    """A logger that keeps every scalar in memory (only global rank zero's calls arrive: rank_zero_only)."""

    def __init__(self) -> None:
        super().__init__()
        self.scalars: dict[str, dict[int, float]] = {}

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for key, value in metrics.items():
            self.scalars.setdefault(key, {})[int(step or 0)] = float(value)


def make_callbacks(config: dict[str, Any]) -> list[pl.Callback]:
    """The callbacks of a run: GradientFlowMonitor and AnomalyAlarm (each with its ``config["callbacks"]``
    keyword arguments)."""
    kwargs = config.get("callbacks", {})
    monitor = GradientFlowMonitor(log_every_n_steps=1, **kwargs.get("GradientFlowMonitor", {}))
    alarm = AnomalyAlarm(**kwargs.get("AnomalyAlarm", {}))
    return [monitor, alarm]


def fit(config: dict[str, Any]) -> dict[str, Any]:
    """One ``Trainer.fit`` of :class:`ShardedModel` per ``config`` (in this process; one rank of a sharded run
    or the single-process reference). Returns this rank's results (also written to ``<root>/rank<r>.json``)."""
    from pytorch_lightning.strategies import ModelParallelStrategy

    torch.set_num_threads(1)
    mode = config.get("mode", "single")
    root = config["root"]
    callbacks = make_callbacks(config)
    logger = _Logger()
    set_logger_series("all", logger)  # every series, per layer and per head: the comparison needs them
    common: dict[str, Any] = dict(
        max_steps=config.get("max_steps", 6),
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=logger,
        callbacks=callbacks,
        accelerator="cpu",
        num_sanity_val_steps=0,
    )
    if mode == "single":
        dp = MODES[config["reference_of"]][1] if "reference_of" in config else 1
        model = ShardedModel("single", config.get("seed", 0), BATCH * dp)
        trainer = pl.Trainer(devices=1, **common)
    else:
        n, dp, tp = MODES[mode]
        strategy = ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp, process_group_backend="gloo")
        model = ShardedModel(mode, config.get("seed", 0), BATCH, config.get("nan_rank"), config.get("nan_step", -1))
        trainer = pl.Trainer(devices=n, strategy=strategy, use_distributed_sampler=False, **common)
    trainer.fit(model)
    out = {
        "rank": trainer.global_rank,
        "step": trainer.global_step,
        "finite": all(bool(torch.isfinite(_local(p)).all()) for p in model.parameters()),
        "empty_shards": [n for n, p in model.named_parameters() if _local(p).numel() == 0],
        "sharded": [n for n, p in model.named_parameters() if hasattr(p, "to_local")],
        "alerts": {type(cb).__name__: [a.to_dict() for a in cb.alerts] for cb in callbacks},  # type: ignore[attr-defined]
        "scalars": {k: {str(s): v for s, v in steps.items()} for k, steps in logger.scalars.items()},
    }
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, f"rank{trainer.global_rank}.json"), "w") as fh:
        json.dump(out, fh)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def run_sharded(root: Path, mode: str = "fsdp2", timeout: float = 300, **config: Any) -> dict[str, Any]:
    """Launch a sharded ``Trainer.fit`` (``MODES[mode]`` processes, gloo, CPU) in a subprocess.

    Returns ``{"ranks": [each rank's results], "scalars": rank zero's scalars as {tag: {step: value}},
    "alerts": rank zero's alerts}``.

    Raises:
        RuntimeError: If the run fails (with the end of its stderr).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / "config.json"
    path.write_text(json.dumps({"root": str(root), "mode": mode, **config}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH")]))}
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = launch.run(
        [sys.executable, str(SCRIPT), str(path)], timeout=timeout, env=env, cwd=root
    )
    if proc.returncode != 0:
        raise RuntimeError(f"sharded run {mode} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(MODES[mode][0])]
    return {"ranks": ranks, "scalars": _steps(ranks[0]["scalars"]), "alerts": ranks[0]["alerts"]}


def run_single(root: Path, reference_of: str = "fsdp2", **config: Any) -> dict[str, Any]:
    """The single-process reference of ``reference_of``'s run: same seed, same global batch (in this process).

    Returns ``{"scalars": {tag: {step: value}}, "alerts": ..., "step": ...}``.
    """
    out = fit({"root": str(root), "mode": "single", "reference_of": reference_of, **config})
    return {"scalars": _steps(out["scalars"]), "alerts": out["alerts"], "step": out["step"]}


def _steps(scalars: dict[str, dict[str, float]]) -> dict[str, dict[int, float]]:
    return {k: {int(s): v for s, v in steps.items()} for k, steps in scalars.items()}


if __name__ == "__main__":
    if os.environ.get("HARNESS_DUMP_AFTER"):  # debugging a hang: every rank prints its stacks, then exits
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["HARNESS_DUMP_AFTER"]), exit=True)
    fit(json.loads(Path(sys.argv[1]).read_text()))
