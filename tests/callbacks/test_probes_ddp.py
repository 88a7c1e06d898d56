"""The probes under DDP (2 CPU processes, gloo): rank zero measures, every rank takes the same decisions."""

import json
import sys
from pathlib import Path

import pytest

from tests import launch

SCRIPT = Path(__file__).with_name("ddp_probe_script.py")


@pytest.mark.slow
def test_rank_zero_probes_and_every_rank_takes_its_decisions(tmp_path):
    proc = launch.run([sys.executable, str(SCRIPT), str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["measured"] for r in ranks] == [True, False]  # only rank zero ran the probe
    assert [a["rule"] for a in ranks[0]["sharp"]] == ["sharp_minimum"]
    assert "quantization_error" in {a["rule"] for a in ranks[0]["quant"]}
    for key in ("sharp", "quant", "sharp_state", "quant_state"):
        assert ranks[0][key] == ranks[1][key], key
    records = [json.loads(x) for x in (tmp_path / "diag" / "alerts.jsonl").read_text().splitlines()]
    assert len(records) == len(ranks[0]["sharp"]) + len(ranks[0]["quant"])  # written once, by rank zero
