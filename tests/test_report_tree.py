"""``benchmarks/report_tree.py`` on a small tree (the 1,000-run timing is in docs/report.md; no timing asserted
here): the generated TensorBoard and CSV runs are all reported, one summary line each, the worst first."""

import contextlib
import io
import json
from pathlib import Path

from lightning_diag.cli import main
from tests.test_benchmarks import _load


def _bench():
    return _load("report_tree")


def test_a_small_tree_is_summarised_worst_first(tmp_path):
    bench = _bench()
    bench.make_tree(tmp_path, 20, 140)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["report", str(tmp_path), "--format", "json"]) == 0
    summary = json.loads(out.getvalue())["summary"]
    assert len(summary) == 20 and {line["kind"] for line in summary} == {"plain"}
    verdicts = [line["verdict"] for line in summary]
    # runs 6 and 7 have a NaN loss (critical), 14 and 15 a worsening validation loss, the other 16 are healthy
    assert verdicts == ["FAIL (critical)"] * 2 + ["FAIL"] * 2 + ["ok"] * 16
    assert {Path(line["run"]).name for line in summary[:2]} == {"version_6", "version_7"}
    assert {line["finding"].split(":")[0] for line in summary[2:4]} == {"val_decline"}
    assert {Path(line["run"]).parent.name for line in summary} == {"tb", "csv"}


def test_the_benchmark_prints_its_table(capsys):
    assert _bench().main(["--runs", "4", "--steps", "40"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 4 |")]
    assert len(rows) == 1 and rows[0].split(" | ")[-1].rstrip(" |") == "4"
