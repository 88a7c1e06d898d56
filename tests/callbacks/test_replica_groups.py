"""ddp_desync's pure parts across several replica groups, and which parameters ReplicaCheck compares (no processes)."""

from types import SimpleNamespace

import pytest
from pytorch_lightning.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from torch import nn

from lightning_diag.callbacks.anomaly_alarm.silent_checks import ReplicaCheck
from lightning_diag.rules.base import StepContext
from lightning_diag.rules.measures import Measures, ReplicaDifferences
from lightning_diag.rules.replicas import DesyncRule
from lightning_diag.stats.replicas import first_differences, member_differences


def _differences(per_param, names, first, compared=None):
    """The measures of one comparison of the replicas' checksums."""
    return Measures(replica_differences=ReplicaDifferences(per_param, names, first, compared))


def test_two_groups_judged_together_name_the_first_parameter_and_only_its_ranks() -> None:
    # HSDP 2 x 2: group (0, 2) holds shard 0, group (1, 3) shard 1; rank 3 differs on parameter 1, rank 2 on 4.
    g02 = member_differences([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0, 2.0]])
    g13 = member_differences([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 1.5, 1.0, 1.0, 1.0, 1.0]])
    first = {**first_differences(g02, [0, 2], [0, 1, 4], 1e-6), **first_differences(g13, [1, 3], [0, 1, 4], 1e-6)}
    assert first == {2: (4, 0), 3: (1, 1)}
    per_param = [0.0, 0.5, 0.0, 0.0, 1.0]  # parameters 2 and 3 have no replica (pure shards)
    rule = DesyncRule(1e-6)
    names = [f"p{i}" for i in range(5)]
    (alert,) = rule.judge(StepContext(0, 10), _differences(per_param, names, first, compared=3))
    assert alert.source == "p1" and alert.value == 0.5
    assert "rank(s) 3 differs from its replica(s) on rank(s) 1" in alert.message
    assert "2 of 3 replicated" in alert.message
    assert rule.judge(StepContext(0, 20), _differences(per_param, names, first)) == []  # latched
    assert rule.judge(StepContext(0, 30), _differences([0.0] * 5, names, {})) == []
    assert rule.checks == 3 and rule.last_max_diff == 0.0


class _Owner:
    def __init__(self) -> None:
        self.notices: dict[str, str] = {}

    def notice(self, trainer: object, key: str, message: str) -> None:
        self.notices.setdefault(key, message)


@pytest.mark.parametrize(
    ("strategy", "compared", "notice"),
    [
        (DDPStrategy(), [0, 1], None),
        (ModelParallelStrategy(), [0, 1], None),
        (FSDPStrategy(), [], "desync-plain-sharded"),
    ],
)
def test_plain_tensors_are_replicas_under_ddp_and_model_parallel_not_fsdp1(
    strategy: object, compared: list[int], notice: str | None
) -> None:
    owner = _Owner()
    check = ReplicaCheck(owner, DesyncRule.rule_id, 2, 1e-6)  # type: ignore[arg-type]
    trainer = SimpleNamespace(world_size=2, strategy=strategy)
    groups = check._groups(trainer, list(nn.Linear(2, 2).named_parameters()))  # type: ignore[arg-type]
    assert [i for g in groups.values() for i in g.params] == compared
    if notice is None:
        assert list(groups) == [(0, 1)] and owner.notices == {}
    else:
        assert "plain tensors, not DTensors" in owner.notices[notice] and "`weight`" in owner.notices[notice]
        assert "desync-no-replicas" in owner.notices


def test_replica_dims_are_the_replicate_placements_of_a_real_dtensor(tmp_path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from lightning_diag.instrument.sharding import mesh_dim_ranks, replica_dims

    if dist.is_initialized():  # pragma: no cover - never inside the test process
        pytest.skip("a process group is already initialised")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
        hsdp = distribute_tensor(torch.ones(4, 2), mesh, [Replicate(), Shard(0)])
        assert replica_dims(hsdp) == [0] and replica_dims(torch.ones(2)) == []
        assert replica_dims(distribute_tensor(torch.ones(4), mesh, [Shard(0), Shard(0)])) == []
        assert mesh_dim_ranks(mesh, 0) == (0,) and mesh_dim_ranks(mesh, 1) == (0,)
    finally:
        dist.destroy_process_group()
