"""Shard-aware norms (stats/grad.py, stats/norms.py) on hand-built DTensors.

One process: a 1-rank gloo group and CPU ``DeviceMesh`` (cheap). Four processes (slow): a 2x2 mesh with every
kind of placement, a 1-D sub-mesh and a plain tensor; one SUM of the weighted local sums of squares must give
the full tensors' sums of squares exactly where nothing is gathered.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torch.distributed.tensor")
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from lightning_diag.stats.grad import copy_weights, is_dtensor, local_tensor, per_tensor_norms
from lightning_diag.stats.norms import all_finite, fast_finite, max_abs, total_norm


@pytest.fixture
def one_rank_mesh(tmp_path):
    if dist.is_initialized():  # pragma: no cover - never inside the test process
        pytest.skip("a process group is already initialised")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_dtensor_norms_are_of_the_local_shard_and_counted_once(one_rank_mesh):
    full = torch.arange(12.0).reshape(3, 4)
    sharded = distribute_tensor(full, one_rank_mesh, [Shard(0)])
    replicated = distribute_tensor(full, one_rank_mesh, [Replicate()])
    assert is_dtensor(sharded) and not is_dtensor(full)
    assert local_tensor(sharded).shape == (3, 4)
    assert per_tensor_norms([sharded, replicated, full]).tolist() == pytest.approx([float(full.norm())] * 3)
    assert copy_weights([sharded, replicated, full], 1) == [1.0, 1.0, 1.0]
    assert float(total_norm([sharded])) == pytest.approx(float(full.norm()))
    assert float(max_abs([sharded])) == 11.0
    assert bool(fast_finite([sharded])) and bool(all_finite([sharded]))


def test_partial_placements_are_refused(one_rank_mesh):
    pending = DTensor.from_local(torch.ones(2), one_rank_mesh, [Partial()])
    with pytest.raises(ValueError, match="Partial"):
        copy_weights([pending], 1)


def test_fast_finite_is_exact_with_the_confirm():
    huge = [torch.full((8,), 1e30)]  # finite, its L2 overflows float32
    assert not bool(fast_finite(huge)) and bool(all_finite(huge))
    for bad in (math.nan, math.inf, -math.inf):
        tensors = [torch.ones(3), torch.tensor([1.0, bad])]
        assert not bool(fast_finite(tensors)) and not bool(all_finite(tensors))
    assert bool(fast_finite([torch.zeros(0), torch.ones(2)]))  # an empty shard is finite
    assert bool(fast_finite([torch.full((1000,), 60000.0, dtype=torch.float16)]))  # fp16: float32 accumulation
    assert bool(fast_finite([]))


_WORKER = r"""
import json, os, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from lightning_diag.stats.grad import copy_weights, local_tensor, per_tensor_norms
from lightning_diag.stats.norms import fast_finite

rank = int(sys.argv[2])
dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + "/store", rank=rank, world_size=4)
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
torch.manual_seed(0)
full = [torch.randn(6, 4), torch.randn(5, 3), torch.randn(4), torch.randn(3, 2), torch.randn(1), torch.randn(7)]
tensors = [
    distribute_tensor(full[0], mesh, [Shard(0), Shard(1)]),
    distribute_tensor(full[1], mesh, [Replicate(), Shard(0)]),   # HSDP-like: replicated over a, sharded over b
    distribute_tensor(full[2], mesh, [Shard(0), Replicate()]),   # TP-like: replicated over b
    distribute_tensor(full[3], mesh["b"], [Shard(0)]),           # a 1-D sub-mesh: copies over a
    distribute_tensor(full[4], mesh["b"], [Shard(0)]),           # one element over 2 shards: an empty shard
    full[5],                                                     # plain, the same on every rank
]
weights = torch.tensor(copy_weights(tensors, 4))
squares = per_tensor_norms(tensors).pow(2) * weights
dist.all_reduce(squares)
flag = (~fast_finite(tensors)).float()
dist.all_reduce(flag)
if rank == 0:
    out = {"got": squares.tolist(), "want": [float(t.pow(2).sum()) for t in full], "weights": weights.tolist(),
           "flag": flag.item()}
    json.dump(out, open(sys.argv[1] + "/out.json", "w"))
dist.barrier()  # every rank is done before any tears its group down (gloo aborts a rank whose peer left early)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_one_sum_over_ranks_gives_the_full_sums_of_squares(tmp_path):
    import contextlib

    from tests import launch

    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    with contextlib.ExitStack() as stack:  # every rank's group is killed on leaving, a failed assertion included
        procs = [
            stack.enter_context(launch.started([sys.executable, str(script), str(tmp_path), str(r)], env=env))
            for r in range(4)
        ]
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["weights"] == [1.0, 0.5, 0.5, 0.5, 0.5, 0.25]
    assert out["got"] == pytest.approx(out["want"], rel=1e-6)
    assert out["flag"] == 0.0
