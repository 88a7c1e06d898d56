"""ddp_desync under ModelParallelStrategy (2 gloo processes on CPU): true replicas are compared, shards are not.

HSDP (``fully_shard`` on a (2, 1) mesh: 2 replicas x 1 shard) compares every parameter across the replicate
dimension; tensor parallelism (a (1, 2) mesh) compares only ``RowwiseParallel``'s ``Replicate`` bias across the
tensor-parallel ranks (the sharded weights hold different data). One rank's perturbed copy is caught on every rank
at the same step, naming the parameter and the global ranks; healthy runs raise nothing.
"""

import json
import os
import sys
from pathlib import Path

import pytest

from tests import launch

SCRIPT = Path(__file__).with_name("sharded_desync_script.py")

pytestmark = pytest.mark.slow


def _run(tmp_path: Path, layout: str, mode: str, n: int = 2) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = launch.run(
        [sys.executable, str(SCRIPT), str(tmp_path), layout, mode], timeout=300,
        env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"{layout}-{mode}{r}.json").read_text()) for r in range(n)]


def _desync_records(tmp_path: Path) -> list[dict]:
    path = tmp_path / "diag" / "alerts.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if r["rule"] == "ddp_desync"]


@pytest.mark.parametrize(("layout", "param"), [("hsdp", "fc2.weight"), ("tp", "fc2.bias"), ("tpln", "ln.weight")])
def test_one_ranks_perturbed_replica_is_ddp_desync_on_every_rank(tmp_path: Path, layout: str, param: str) -> None:
    ranks = _run(tmp_path, layout, "perturb")
    for rank in ranks:
        hits = [a for a in rank["alerts"] if a["rule"] == "ddp_desync"]
        assert [(a["severity"], a["global_step"], a["source"]) for a in hits] == [("critical", 4, param)]
        assert "rank(s) 1 differs from its replica(s) on rank(s) 0" in hits[0]["message"]
        assert rank["checks"] == 5 and rank["groups"] == [[0, 1]]  # steps 1, 2, 4, 6, 8; one replica group
    assert len(_desync_records(tmp_path)) == 1  # global rank zero writes, once


@pytest.mark.parametrize("layout", ["hsdp", "tp"])
def test_healthy_sharded_run_has_identical_replicas_and_no_alert(tmp_path: Path, layout: str) -> None:
    ranks = _run(tmp_path, layout, "healthy")
    for rank in ranks:
        assert rank["alerts"] == [] and rank["checks"] == 5 and rank["max_diff"] == 0.0
    if layout == "tp":  # only the Replicate bias has replicas; the Shard(0)/Shard(1) weights are not compared
        assert ranks[0]["placements"]["fc2.bias"] == ["R"] and ranks[0]["placements"]["fc2.weight"] == ["S(1)"]
    else:
        assert all(p == ["R", "S(0)"] for p in ranks[0]["placements"].values())
    assert _desync_records(tmp_path) == []


def test_plain_layernorm_under_tensor_parallelism_is_compared_and_healthy_copies_agree(tmp_path: Path) -> None:
    """A LayerNorm left out of the tensor-parallel plan stays a plain tensor on every rank: ModelParallelStrategy
    does not keep it in sync, so ddp_desync compares it across the world (BLOOM-176B's drifting LayerNorms)."""
    ranks = _run(tmp_path, "tpln", "healthy")
    for rank in ranks:
        assert rank["placements"]["ln.weight"] == [] and rank["placements"]["fc2.bias"] == ["R"]
        assert rank["alerts"] == [] and rank["checks"] == 5 and rank["max_diff"] <= 1e-6
        assert rank["groups"] == [[0, 1]]
    assert _desync_records(tmp_path) == []


def test_clipping_by_each_ranks_own_shards_is_caught_at_the_first_step(tmp_path: Path) -> None:
    """The published bug: gradient clipping computed from each tensor-parallel rank's own shards scales the plain
    LayerNorm's gradient differently on each rank, so its copies drift from the first update: caught at step 1."""
    ranks = _run(tmp_path, "tpln", "clip")
    for rank in ranks:
        hits = [a for a in rank["alerts"] if a["rule"] == "ddp_desync"]
        assert [(a["global_step"], a["source"]) for a in hits] == [(1, "ln.weight")]
    assert len(_desync_records(tmp_path)) == 1


def test_hsdp_replica_groups_smaller_than_the_world_agree_on_one_decision(tmp_path: Path) -> None:
    """4 processes, a (2, 2) mesh: rank 3 is compared with rank 1 only (ranks 0 and 2 compare their own shards);
    one all_reduce then gives every rank the same decision, naming global rank 3 and its replica, rank 1."""
    ranks = _run(tmp_path, "hsdp4", "perturb", n=4)
    assert [r["groups"] for r in ranks] == [[[0, 2]], [[1, 3]], [[0, 2]], [[1, 3]]]
    for rank in ranks:
        hits = [a for a in rank["alerts"] if a["rule"] == "ddp_desync"]
        assert [(a["severity"], a["global_step"], a["source"]) for a in hits] == [("critical", 4, "fc2.weight")]
        assert "rank(s) 3 differs from its replica(s) on rank(s) 1" in hits[0]["message"]
        assert rank["checks"] == 5
    assert len({r["max_diff"] for r in ranks}) == 1  # the same numbers judged on every rank
    assert len(_desync_records(tmp_path)) == 1
