import json
import sys
from pathlib import Path

import pytest

from tests import launch

SCRIPT = Path(__file__).with_name("ddp_data_script.py")


@pytest.mark.slow
def test_each_rank_reads_its_shard_the_ranks_decide_together_and_rank_zero_writes(tmp_path):
    proc = launch.run([sys.executable, str(SCRIPT), str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["alerts"] == ranks[1]["alerts"] and ranks[0]["latch"] == ranks[1]["latch"]
    assert ranks[0]["last"] == ranks[1]["last"]
    # the union of both shards: every sample once
    assert ranks[0]["last"]["train/samples"] == 400 and ranks[0]["last"]["val/samples"] == 100
    # the copies cross the shards: only the gathered data finds them
    assert ranks[0]["last"]["leaked_fraction"] == pytest.approx(0.4)
    rules = {(a["rule"], a["source"]) for a in ranks[0]["alerts"]}
    # index 7 (the NaN) is read by rank 1 only, in both splits
    assert rules == {("data_leakage", "val"), ("data_nonfinite", "train:extra"), ("data_nonfinite", "val:extra")}
    records = [json.loads(x) for x in (tmp_path / "diag" / "alerts.jsonl").read_text().splitlines()]
    assert records == ranks[0]["alerts"]  # written once, by rank zero
