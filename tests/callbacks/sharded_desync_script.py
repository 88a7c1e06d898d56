"""Run by test_silent_sharded.py: 2 CPU processes (gloo) through ``ModelParallelStrategy``.

``argv``: root, layout (``hsdp``: ``fully_shard`` on a (2, 1) mesh, replicate x shard; ``hsdp4``: 4 processes, a
(2, 2) mesh, so that each replica group is half the world; ``tp``: a (1, 2) mesh, ``ColwiseParallel`` fc1 and
``RowwiseParallel`` fc2, whose bias is ``Replicate`` on the tensor-parallel ranks; ``tpln``: the same with a plain
``LayerNorm`` on the input, left out of the tensor-parallel plan, and SGD), mode (``perturb``: the last rank's local
``fc2.bias`` (tp), ``fc2.weight`` shard (hsdp) or plain ``ln.weight`` (tpln) is nudged after step 3; ``clip``
(tpln): gradients clipped by each rank's norm of its own shards, the published Megatron/BLOOM-style bug that makes
the plain copies drift from the first step; ``healthy``).
"""

import json
import os
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_diag import AnomalyAlarm


class Net(pl.LightningModule):
    def __init__(self, layout: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layout = layout
        self.ln = nn.LayerNorm(8) if layout == "tpln" else nn.Identity()
        self.fc1, self.fc2 = nn.Linear(8, 64), nn.Linear(64, 8)
        self.clip_local = False

    def configure_model(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if self.layout.startswith("hsdp"):
            shape = (2, 1) if self.layout == "hsdp" else (2, 2)
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
            for layer in (self.fc1, self.fc2, self):  # the layers are called directly, not through forward
                fully_shard(layer, mesh=mesh)
        else:
            parallelize_module(self, self.device_mesh["tensor_parallel"],
                               {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.fc2(torch.relu(self.fc1(self.ln(x)))), y)

    def configure_optimizers(self):
        if self.layout == "tpln":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if not self.clip_local:
            return
        # The bug: the norm of this rank's own shards, not of the full gradient, so each rank scales differently.
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in self.parameters()]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        coef = min(1.0, 0.05 / (float(norm) + 1e-6))
        for p in self.parameters():
            p.grad.mul_(coef)


class Perturb(pl.Callback):
    """The last rank's copy changed outside the optimizer: a rank-dependent bug."""

    def __init__(self, name: str) -> None:
        self.name = name

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == trainer.world_size - 1 and trainer.global_step == 3:
            with torch.no_grad():
                p = dict(pl_module.named_parameters())[self.name]
                (p.to_local() if hasattr(p, "to_local") else p).add_(1e-3)


if __name__ == "__main__":
    from pytorch_lightning.strategies import ModelParallelStrategy

    torch.set_num_threads(1)
    root, layout, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    dp, tp = {"hsdp": (2, 1), "hsdp4": (4, 1), "tp": (1, 2), "tpln": (1, 2)}[layout]
    alarm = AnomalyAlarm(rules={"ddp_desync": {"every_n_steps": 2}})
    target = {"tp": "fc2.bias", "tpln": "ln.weight"}.get(layout, "fc2.weight")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=dp * tp,
        strategy=ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp, process_group_backend="gloo"),
        max_steps=8,
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        num_sanity_val_steps=0,
        callbacks=[alarm, *([Perturb(target)] if mode == "perturb" else [])],
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 8, generator=g)
    model = Net(layout)
    model.clip_local = mode == "clip"
    trainer.fit(model, DataLoader(TensorDataset(x, x * 0.5), batch_size=8))
    out = {
        "alerts": [a.to_dict() for a in alarm.alerts if a.severity != "info"],
        "checks": alarm.desync_rule.checks,
        "max_diff": alarm.desync_rule.last_max_diff,
        "groups": [list(g) for g in alarm.replicas.last_groups],
        "placements": {n: [str(q) for q in getattr(p, "placements", ())] for n, p in model.named_parameters()},
    }
    (root / f"{layout}-{mode}{trainer.global_rank}.json").write_text(json.dumps(out))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank has written its results
    # End without the interpreter's teardown: gloo's threads can abort it after a fit that passed ("terminate called
    # without an active exception", seen in CI); nothing is left to run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
