"""ddp_desync under DDP (2 gloo processes): one rank's perturbed weights are caught on every rank at the same
step, naming the parameter and the rank; a healthy DDP run raises nothing."""

import json
import sys
from pathlib import Path

import pytest

from tests import launch

SCRIPT = Path(__file__).with_name("ddp_desync_script.py")


def _run(tmp_path, mode):
    proc = launch.run(
        [sys.executable, str(SCRIPT), str(tmp_path), mode], timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"{mode}{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_one_ranks_perturbed_weights_are_ddp_desync_on_every_rank(tmp_path):
    ranks = _run(tmp_path, "perturb")
    for rank in ranks:
        hits = [a for a in rank["alerts"] if a["rule"] == "ddp_desync"]
        assert [(a["severity"], a["global_step"], a["source"]) for a in hits] == [("critical", 4, "last.weight")]
        assert "rank(s) 1" in hits[0]["message"]
        assert rank["checks"] == 5  # steps 1, 2, 4, 6, 8
    records = [json.loads(x) for x in (tmp_path / "diag" / "alerts.jsonl").read_text().splitlines()]
    assert [r["rule"] for r in records if r["rule"] == "ddp_desync"] == ["ddp_desync"]  # rank zero writes once


@pytest.mark.slow
def test_healthy_ddp_run_has_identical_replicas_and_no_new_alert(tmp_path):
    ranks = _run(tmp_path, "healthy")
    for rank in ranks:
        assert rank["alerts"] == [] and rank["checks"] == 5 and rank["max_diff"] == 0.0


@pytest.mark.slow
def test_gradients_never_all_reduced_are_caught_at_the_first_step(tmp_path):
    """Each rank keeps its own gradient (no all-reduce): the replicas drift from step 1 and the first comparison,
    after step 1, catches it on every rank; rank zero writes one alert."""
    ranks = _run(tmp_path, "nosync")
    for rank in ranks:
        hits = [a for a in rank["alerts"] if a["rule"] == "ddp_desync"]
        assert [(a["severity"], a["global_step"]) for a in hits] == [("critical", 1)]
    records = [json.loads(x) for x in (tmp_path / "diag" / "alerts.jsonl").read_text().splitlines()]
    assert [r["global_step"] for r in records if r["rule"] == "ddp_desync"] == [1]
