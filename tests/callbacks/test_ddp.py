import json
import sys
from pathlib import Path

import pytest
import torch

from tests import launch

SCRIPT = Path(__file__).with_name("ddp_nan_script.py")


@pytest.mark.slow
def test_nan_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    proc = launch.run([sys.executable, str(SCRIPT), str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["step"] == ranks[1]["step"] == 7  # the blocked step 6 was the last one
    assert all(r["finite"] for r in ranks)
    # every rank decided the same; rank 0 (whose own loss was finite) knows it was the loss
    assert [a["rule"] for a in ranks[0]["alerts"]] == [a["rule"] for a in ranks[1]["alerts"]] == ["nonfinite_loss"]
    # gradient-flow decisions come from the synchronised gradient: identical on both ranks
    assert ranks[0]["grad_alerts"] and ranks[0]["grad_alerts"] == ranks[1]["grad_alerts"]
    assert ranks[0]["grad_streaks"] == ranks[1]["grad_streaks"]
    # attention statistics are averaged over the ranks: the same decisions everywhere
    assert ranks[0]["attn_alerts"] and ranks[0]["attn_alerts"] == ranks[1]["attn_alerts"]
    assert ranks[0]["attn_state"] == ranks[1]["attn_state"]
    records = [json.loads(x) for x in (tmp_path / "diag" / "alerts.jsonl").read_text().splitlines()]
    # one set of records: only global rank zero writes
    assert [r["rule"] for r in records if r["rule"].startswith("nonfinite")] == ["nonfinite_loss"]
    assert len(records) == len(ranks[0]["grad_alerts"]) + len(ranks[0]["attn_alerts"]) + 1
    assert next(r for r in records if r["rule"] == "nonfinite_loss")["global_step"] == 6


@pytest.mark.slow
def test_ddp_spawn_runs_with_the_alarm(tmp_path):
    proc = launch.run(
        [sys.executable, str(SCRIPT), str(tmp_path), "ddp_spawn"], timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (tmp_path / "diag" / "alerts.jsonl").read_text().splitlines()
    assert [json.loads(x)["rule"] for x in lines if "nonfinite" in x] == ["nonfinite_loss"]


@pytest.mark.slow
def test_warn_mode_under_ddp_agrees_on_the_first_bad_step_and_checkpoints_all_ranks_sums(tmp_path):
    proc = launch.run(
        [sys.executable, str(SCRIPT), str(tmp_path), "warn"], timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"warn{r}.json").read_text()) for r in (0, 1)]
    # rank 1's loss was NaN at step 6; rank 0's only from step 7 on (the NaN update was applied): MIN over ranks
    for rank in ranks:
        assert [(a["rule"], a["global_step"]) for a in rank["alerts"]] == [("nonfinite_loss", 6)]
    records = [json.loads(x) for x in (tmp_path / "diag" / "alerts.jsonl").read_text().splitlines()]
    assert [(r["rule"], r["global_step"]) for r in records] == [("nonfinite_loss", 6)]
    (ckpt,) = (tmp_path / "ckpt").glob("*step=8*.ckpt")
    saved = next(v for k, v in torch.load(ckpt, weights_only=False)["callbacks"].items() if "AnomalyAlarm" in k)
    local = [rank["local"] for rank in ranks]
    assert local[0]["epoch_sum"] != local[1]["epoch_sum"]  # the ranks saw different batches
    for key in ("epoch_sum", "epoch_count", "since_val_sum", "since_val_count"):
        assert saved["accumulators"][key] == pytest.approx(local[0][key] + local[1][key], rel=1e-6), key
    # not yet read back at step 8: the first bad steps over all ranks are saved (rank 0's own loss step is 7)
    assert (saved["pending_nonfinite"]["loss_step"], saved["pending_nonfinite"]["grad_step"]) == (6, 6)
