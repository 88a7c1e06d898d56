import json
import sys
from pathlib import Path

import pytest

from tests import launch

SCRIPT = Path(__file__).with_name("ddp_attention_script.py")


@pytest.mark.slow
def test_ranks_take_identical_attention_decisions_and_only_rank_zero_writes(tmp_path):
    proc = launch.run([sys.executable, str(SCRIPT), str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # statistics are averaged over the ranks before the rules run: the same streaks and alerts everywhere
    assert ranks[0]["streaks"] == ranks[1]["streaks"]
    assert ranks[0]["alerts"] == ranks[1]["alerts"]
    assert {a["rule"] for a in ranks[0]["alerts"]} == {"attn_entropy_low", "attn_sink"}
    assert {a["global_step"] for a in ranks[0]["alerts"]} == {39}
    assert len(ranks[0]["alerts"]) == 2  # the heads (layers) tripping one rule at one step make one alert
    log_dir = Path(ranks[0]["log_dir"])
    records = [json.loads(x) for x in (log_dir / "diag" / "alerts.jsonl").read_text().splitlines()]
    assert records == ranks[0]["alerts"]  # one set of records, written once
    assert len(list(tmp_path.rglob("events.out.tfevents.*"))) == 1
