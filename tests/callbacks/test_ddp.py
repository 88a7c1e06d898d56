import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("ddp_nan_script.py")


@pytest.mark.slow
def test_nan_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["step"] == ranks[1]["step"] == 7  # the blocked step 6 was the last one
    assert all(r["finite"] for r in ranks)
    # every rank decided the same; rank 0 (whose own loss was finite) knows it was the loss
    assert [a["rule"] for a in ranks[0]["alerts"]] == [a["rule"] for a in ranks[1]["alerts"]] == ["nonfinite_loss"]
    # gradient-flow decisions come from the synchronised gradient: identical on both ranks
    assert ranks[0]["grad_alerts"] and ranks[0]["grad_alerts"] == ranks[1]["grad_alerts"]
    assert ranks[0]["grad_streaks"] == ranks[1]["grad_streaks"]
    records = [json.loads(x) for x in (tmp_path / "diag" / "alerts.jsonl").read_text().splitlines()]
    # one set of records: only global rank zero writes
    assert [r["rule"] for r in records if r["rule"].startswith("nonfinite")] == ["nonfinite_loss"]
    assert len(records) == len(ranks[0]["grad_alerts"]) + 1
    assert next(r for r in records if r["rule"] == "nonfinite_loss")["global_step"] == 6


@pytest.mark.slow
def test_ddp_spawn_runs_with_the_alarm(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), "ddp_spawn"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (tmp_path / "diag" / "alerts.jsonl").read_text().splitlines()
    assert [json.loads(x)["rule"] for x in lines if "nonfinite" in x] == ["nonfinite_loss"]
