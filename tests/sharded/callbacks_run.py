"""Every non-gradient callback under ``ModelParallelStrategy`` (FSDP2, TP, FSDP2+TP; gloo, CPU), in one fit.

A tiny causal-attention regressor (``AttnModel``: an attention layer of 4 heads whose q/k/v/o projections are
column-/row-wise parallel under TP, then the harness's MLP block) trains with ``AnomalyAlarm(on_nonfinite=
"rollback")``, ``AttentionEntropyMonitor``, ``SharpnessProbe``, ``QuantizationProbe``, ``SystemMonitor`` and
``DataDiagnostics`` attached, validating every epoch. A test-only ``Recorder`` callback copies each rank's local
shards (parameters and optimizer state) at the snapshot step and compares them bitwise after the rollback, and
keeps every diag callback's state at the start of training (after a resume: as loaded from the checkpoint).

Run as ``python tests/sharded/callbacks_run.py CONFIG.json`` (what :func:`run` launches; Lightning re-runs it
once per rank). ``CONFIG.json``: ``root``, ``mode`` (``"single"``, ``"fsdp2"``, ``"tp"``, ``"fsdp2_tp"``),
``max_steps``, ``nan_rank``/``nan_step`` (a NaN in that rank's ``attn.o`` output at that global step),
``ckpt_every`` (a checkpoint every this many steps, 0: none), ``ckpt_path`` (resume from it), ``reference_of``
(single: use that mode's global batch), ``act_grads`` (also ``GradientFlowMonitor(activation_grads=True)``).
Each rank writes ``<root>/rank<r>.json`` and ``<root>/states<r>.pt``.
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

from lightning_diag import (  # noqa: E402
    AnomalyAlarm,
    AttentionEntropyMonitor,
    DataDiagnostics,
    GradientFlowMonitor,
    QuantizationProbe,
    SharpnessProbe,
    SystemMonitor,
)
from lightning_diag.callbacks.common.base import DiagCallback  # noqa: E402
from lightning_diag.output.writer import set_logger_series  # noqa: E402
from tests.sharded.harness import MODES, Block, _Logger  # noqa: E402

D, HEADS, LENGTH, FEATURES = 64, 4, 8, 8
#: Per-data-parallel-rank batch and batches per epoch (train), validation batches.
BATCH, TRAIN_BATCHES, VAL_BATCHES = 8, 4, 2
SNAPSHOT_EVERY = 2
SCRIPT = Path(__file__)


class Attention(nn.Module):
    """Causal self-attention through ``scaled_dot_product_attention``; the head count seen is the local one
    (``q.shape[-1] // head_dim``), so under TP each rank runs its own heads."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.head_dim = d // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(b, n, -1, self.head_dim).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(out.transpose(1, 2).reshape(b, n, -1))


class AttnModel(pl.LightningModule):
    """Per-token regression through attention + MLP block, parallelised in ``configure_model`` per ``mode``."""

    def __init__(
        self, mode: str = "single", batch: int = BATCH, nan_rank: int | None = None, nan_step: int = -1,
        lr: float = 1e-3,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mode, self.batch, self.nan_rank, self.nan_step, self.lr = mode, batch, nan_rank, nan_step, lr
        self.inp = nn.Linear(FEATURES, D)
        self.attn = Attention(D, HEADS)
        self.block = Block(D)
        self.head = nn.Linear(D, 1)
        self.attn.o.register_forward_hook(self._maybe_nan)

    def _maybe_nan(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        if self.global_rank == self.nan_rank and self.global_step == self.nan_step and self.training:
            return output * math.nan
        return None

    def configure_model(self) -> None:
        if self.mode == "single":
            return
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if self.mode in ("tp", "fsdp2_tp"):
            tp = self.device_mesh["tensor_parallel"]
            plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel()}
            parallelize_module(self.attn, tp, plan)
            parallelize_module(self.block, tp, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        if self.mode in ("fsdp2", "fsdp2_tp"):
            dp = self.device_mesh["data_parallel"]
            fully_shard(self.attn, mesh=dp)
            fully_shard(self.block, mesh=dp)
            fully_shard(self, mesh=dp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.attn(self.inp(x)))).squeeze(-1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.training_step(batch, batch_idx)

    def _data(self, seed: int, batches: int) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(seed)
        n = self.batch * batches * (MODES[self.mode][1] if self.mode != "single" else 1)
        x = torch.randn(n, LENGTH, FEATURES, generator=g)
        y = x @ torch.randn(FEATURES, generator=g)
        data = torch.utils.data.TensorDataset(x, y)
        sampler = None
        if self.mode != "single":
            # Lightning's own sampler shuffles the training data (DistributedSampler(shuffle=True)): an unshuffled
            # one gives data-parallel rank r samples r, r+R, ..., so a step's batches over the ranks are the
            # single-process run's global batch (and its first sample_size rows, rank by rank).
            dp = self.device_mesh["data_parallel"]
            sampler = torch.utils.data.DistributedSampler(data, num_replicas=dp.size(), rank=dp.get_local_rank(),
                                                          shuffle=False)
        return torch.utils.data.DataLoader(data, batch_size=self.batch, sampler=sampler)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return self._data(1, TRAIN_BATCHES)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return self._data(2, VAL_BATCHES)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Copies of this rank's local shards: every parameter and every optimizer state tensor."""
    out = {f"param/{n}": _local(p).detach().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, entry in optimizer.state.items():
        for k, v in entry.items():
            if isinstance(v, torch.Tensor):
                out[f"opt/{names[id(p)]}/{k}"] = _local(v).detach().clone()
    return out


class Recorder(pl.Callback):
    """Test-only: the snapshot-step shards, the bitwise check after the rollback, the diag callbacks' states."""

    def __init__(self, alarm: AnomalyAlarm, snapshot_step: int) -> None:
        self.alarm, self.snapshot_step = alarm, snapshot_step
        self.at_snapshot: dict[str, torch.Tensor] | None = None
        self.rollback: dict[str, Any] = {}
        self.resumed_states: dict[str, Any] = {}

    def _diag_states(self, trainer: pl.Trainer) -> dict[str, Any]:
        return {cb.state_key: cb.state_dict() for cb in trainer.callbacks if isinstance(cb, DiagCallback)}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after the checkpoint's callback states were loaded (ModelParallelStrategy restores after setup)
        self.resumed_states = self._diag_states(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        optimizer = trainer.optimizers[0]
        if trainer.global_step == self.snapshot_step and self.at_snapshot is None:
            self.at_snapshot = local_state(pl_module, optimizer)
        if self.alarm.rollbacks and not self.rollback:
            now = local_state(pl_module, optimizer)
            same = self.at_snapshot is not None and now.keys() == self.at_snapshot.keys() and all(
                torch.equal(now[k], self.at_snapshot[k]) for k in now)
            differing = [k for k in now if self.at_snapshot is None or not torch.equal(now[k], self.at_snapshot[k])]
            self.rollback = {"step": trainer.global_step, "bitwise": same, "differing": differing[:5],
                             "tensors": len(now), "empty_shards": sum(1 for t in now.values() if t.numel() == 0)}


def make_callbacks(config: dict[str, Any]) -> list[pl.Callback]:
    alarm = AnomalyAlarm(on_nonfinite="rollback", rules={"nonfinite_rollback": {"every_n_steps": SNAPSHOT_EVERY}})
    callbacks: list[pl.Callback] = [
        # first: its on_train_start sees the states as the checkpoint restored them, before any callback's own
        # train-start work (DataDiagnostics measures there; AnomalyAlarm shares the loss sums over the ranks)
        Recorder(alarm, snapshot_step=SNAPSHOT_EVERY * max(1, config.get("nan_step", 0) // SNAPSHOT_EVERY)),
        alarm,
        AttentionEntropyMonitor(log_every_n_steps=1, sample_size=16),
        SharpnessProbe(),
        QuantizationProbe(backend="fake"),
        SystemMonitor(log_every_n_steps=2, nvml=False),
        DataDiagnostics(),
    ]
    if config.get("act_grads"):
        callbacks.insert(0, GradientFlowMonitor(log_every_n_steps=1, activation_grads=True))
    wanted = config.get("callbacks")
    if wanted is not None:
        callbacks = [cb for cb in callbacks if type(cb).__name__ in wanted or isinstance(cb, Recorder)]
    if config.get("ckpt_every"):
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=os.path.join(config["root"], "ckpt"),
                                                      every_n_train_steps=config["ckpt_every"], save_top_k=-1))
    return callbacks


def fit(config: dict[str, Any]) -> dict[str, Any]:
    """One fit per ``config`` in this process (one rank, or the single-process reference)."""
    from pytorch_lightning.strategies import ModelParallelStrategy

    torch.set_num_threads(1)
    mode, root = config.get("mode", "single"), config["root"]
    callbacks = make_callbacks(config)
    logger = _Logger()
    set_logger_series("all", logger)  # every series, per layer and per head: the comparison needs them
    common: dict[str, Any] = dict(
        max_steps=config.get("max_steps", 8), default_root_dir=root, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=bool(config.get("ckpt_every")), logger=logger,
        callbacks=callbacks, accelerator="cpu", num_sanity_val_steps=0, log_every_n_steps=1,
    )
    if mode == "single":
        dp = MODES[config["reference_of"]][1] if "reference_of" in config else 1
        model = AttnModel("single", BATCH * dp, lr=config.get("lr", 1e-3))
        trainer = pl.Trainer(devices=1, **common)
    else:
        n, dp, tp = MODES[mode]
        strategy = ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp, process_group_backend="gloo")
        model = AttnModel(mode, BATCH, config.get("nan_rank"), config.get("nan_step", -1), config.get("lr", 1e-3))
        trainer = pl.Trainer(devices=n, strategy=strategy, **common)
    trainer.fit(model, ckpt_path=config.get("ckpt_path"))
    recorder = next(cb for cb in callbacks if isinstance(cb, Recorder))
    out = {
        "rank": trainer.global_rank,
        "step": trainer.global_step,
        "rollbacks": recorder.alarm.rollbacks,
        "rollback": recorder.rollback,
        "alerts": {type(cb).__name__: [a.to_dict() for a in cb.alerts]
                   for cb in callbacks if isinstance(cb, DiagCallback)},
        "scalars": {k: {str(s): v for s, v in steps.items()} for k, steps in logger.scalars.items()},
    }
    os.makedirs(root, exist_ok=True)
    torch.save(recorder.resumed_states, os.path.join(root, f"states{trainer.global_rank}.pt"))
    with open(os.path.join(root, f"rank{trainer.global_rank}.json"), "w") as fh:
        json.dump(out, fh)
    return out


def _steps(scalars: dict[str, dict[str, float]]) -> dict[str, dict[int, float]]:
    return {k: {int(s): v for s, v in steps.items()} for k, steps in scalars.items()}


def run(root: Path, mode: str, timeout: float = 300, **config: Any) -> dict[str, Any]:
    """Launch :func:`fit` for ``mode`` in a subprocess (``"single"`` too: one process).

    Returns ``{"ranks": [each rank's results], "scalars": rank zero's {tag: {step: value}}, "stderr": ...,
    "root": ...}``.

    Raises:
        RuntimeError: If the run fails (with the end of its stderr).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / "config.json"
    path.write_text(json.dumps({"root": str(root), "mode": mode, **config}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH")]))}
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = launch.run([sys.executable, str(SCRIPT), str(path)], timeout=timeout,
                          env=env, cwd=root)
    if proc.returncode != 0:
        raise RuntimeError(f"run {mode} failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")
    count = 1 if mode == "single" else MODES[mode][0]
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(count)]
    return {"ranks": ranks, "scalars": _steps(ranks[0]["scalars"]), "stderr": proc.stderr, "root": str(root)}


if __name__ == "__main__":
    fit(json.loads(Path(sys.argv[1]).read_text()))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank has written its results
    # End without the interpreter's teardown: gloo's threads can abort it after a fit that passed ("terminate called
    # without an active exception", seen in CI); nothing is left to run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
