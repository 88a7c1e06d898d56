"""``lightning-diag report`` end to end on a healthy run (issue 23 §5): a real-architecture corpus entry trained
with the default callbacks, then the report CLI on its log folder. A healthy run has no FAIL row."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_diag.cli import main
from lightning_diag.demo.corpus import CORPUS, run_corpus

#: The smallest healthy corpus entry (a CNN with BatchNorm, 300 steps, ~25 s on one CPU thread).
ENTRY = "cnn"
#: What the default callbacks measure on it, so these rows must pass (not merely be "not measured").
MEASURED = ("grad_norm_band", "grad_spread", "grad_collapse", "nonfinite", "loss_swing", "val_decline",
            "val_fluctuation")  # fmt: skip


@pytest.fixture(scope="module")
def healthy_run(tmp_path_factory):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert CORPUS[ENTRY].healthy
        return run_corpus(ENTRY, root=str(tmp_path_factory.mktemp("healthy")))
    finally:
        torch.set_num_threads(before)


def test_a_healthy_corpus_run_has_no_fail_row(healthy_run, capsys):
    assert [a.format() for a in healthy_run.alerts if a.severity != "info"] == []
    assert main(["report", healthy_run.log_dir, "--format", "json"]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    status = {check["id"]: check["status"] for check in run["checks"]}
    assert [name for name, s in status.items() if s == "fail"] == []
    assert {name: status[name] for name in MEASURED} == dict.fromkeys(MEASURED, "pass")
    assert main(["report", healthy_run.log_dir]) == 0
    markdown = capsys.readouterr().out
    assert "FAIL" not in markdown and "0 fail" in markdown
