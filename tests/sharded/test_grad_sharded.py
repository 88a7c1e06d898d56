"""GradientFlowMonitor and AnomalyAlarm's non-finite guard under FSDP2, TP, FSDP2+TP and HSDP (gloo, CPU).

Every gradient scalar logged by a sharded run equals the single-process run's (same seed, same global batch) to
1e-5 relative, under the same names; a NaN on one rank stops every rank at the same step with the module named;
an empty local shard is measured and checked.
"""

from __future__ import annotations

import pytest

from tests.sharded.harness import run_sharded, run_single

pytestmark = pytest.mark.slow

STEPS = 4
#: The tag families the comparison covers: every gradient quantity GradientFlowMonitor logs as a scalar.
FAMILIES = (
    "diag/grad_norm/",
    "diag/grad_rms/",
    "diag/grad_relative/",
    "diag/grad_blocks/",
    "diag/weight_norm/",
    "diag/update_ratio/",
)


def _gradient_scalars(scalars: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
    return {tag: steps for tag, steps in scalars.items() if tag.startswith(FAMILIES)}


@pytest.mark.parametrize("mode", ["fsdp2", "tp", "fsdp2_tp", "hsdp"])
def test_gradient_scalars_equal_the_single_process_run(tmp_path, mode):
    sharded = run_sharded(tmp_path / mode, mode=mode, max_steps=STEPS)
    single = run_single(tmp_path / "single", reference_of=mode, max_steps=STEPS)
    got, want = _gradient_scalars(sharded["scalars"]), _gradient_scalars(single["scalars"])
    # the same names: no _fsdp_wrapped_module, no DTensor in them, nothing missing or extra
    assert sorted(got) == sorted(want)
    assert {"diag/grad_norm/total", "diag/grad_norm/gate", "diag/grad_relative/blocks.1.fc2"} <= set(got)
    assert not [tag for tag in got if "_fsdp" in tag or "DTensor" in tag or "_orig_mod" in tag]
    for tag, steps in want.items():
        assert sorted(got[tag]) == sorted(steps) == list(range(STEPS)), tag
        for step, value in steps.items():
            assert got[tag][step] == pytest.approx(value, rel=1e-5, abs=1e-12), (tag, step)
    # the parameters were sharded, and every rank ended healthy and quiet
    rank0 = sharded["ranks"][0]
    assert "blocks.0.fc1.weight" in rank0["sharded"]
    for rank in sharded["ranks"]:
        assert rank["step"] == STEPS and rank["finite"]
        assert rank["alerts"] == {"GradientFlowMonitor": [], "AnomalyAlarm": []}
    if mode == "fsdp2":  # the empty-shard case: gate.scale has one element, so rank 1's shard is empty
        assert "gate.scale" in sharded["ranks"][1]["empty_shards"]
        assert got["diag/grad_norm/gate"][0] > 0


def test_nan_on_one_rank_stops_every_rank_at_the_same_step_with_the_module_named(tmp_path):
    sharded = run_sharded(tmp_path / "nan", mode="fsdp2", max_steps=8, nan_rank=1, nan_step=3)
    ranks = sharded["ranks"]
    assert ranks[0]["step"] == ranks[1]["step"]
    assert ranks[0]["step"] < 8  # stopped, not run to max_steps
    assert all(rank["finite"] for rank in ranks)  # the non-finite update was never applied
    alerts = [rank["alerts"]["AnomalyAlarm"] for rank in ranks]
    assert [(a["rule"], a["global_step"], a["source"]) for a in alerts[0]] == [("nonfinite_loss", 3, "blocks.1.fc2")]
    assert [(a["rule"], a["global_step"], a["source"]) for a in alerts[1]] == [("nonfinite_loss", 3, "blocks.1.fc2")]
    assert "gate.scale" in ranks[1]["empty_shards"]  # rank 1 checked an empty local shard
