"""The benchmarks of issue 35's matrices and costs: the two-process matrix's section and splice, the detection
matrix keeping that section when it rewrites the page, and zero_output's cost measurement."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_multiprocess_section_counts_catches_and_healthy_warnings(tmp_path):
    mp = _load("multiprocess_matrix")
    fault, healthy = mp.CASES[0], next(c for c in mp.CASES if c.healthy)
    alert = {"rule": "ddp_desync", "global_step": 4, "source": "last.weight", "severity": "critical"}
    outcomes = [
        mp.Outcome(fault, [{"alerts": [alert], "checks": 5}, {"alerts": [alert], "checks": 5}], 1.0),
        mp.Outcome(healthy, [{"alerts": [], "checks": 5, "max_diff": 0.0}] * 2, 1.0),
    ]
    text = mp.section(outcomes)
    assert "1 of 1 faults caught" in text and "0 warning/critical alerts on the 1 healthy runs" in text
    assert "**`ddp_desync`** step 4, +1 steps, on every rank, naming `last.weight`" in text
    missed = mp.Outcome(fault, [{"alerts": [], "checks": 5}, {"alerts": [alert], "checks": 5}], 1.0)
    assert not missed.caught() and "on 1 of 2 ranks" in missed.cell()

    page = tmp_path / "detection.md"
    page.write_text(f"head\n{mp.START}\nold\n{mp.END}\ntail\n")
    mp.splice(str(page), text)
    written = page.read_text()
    assert written.startswith("head\n") and written.endswith("\ntail\n") and "old" not in written
    assert written.count(mp.START) == 1 and "1 of 1 faults caught" in written


def test_detection_matrix_keeps_the_multiprocess_section(tmp_path, capsys):
    matrix = _load("detection_matrix")
    page = tmp_path / "detection.md"
    page.write_text(f"{matrix.MP_START}\nmeasured rows\n{matrix.MP_END}\n")
    assert matrix.main(["--only", "healthy_gru", "--max-epochs", "1", "--no-comparisons", "--write", str(page)]) == 0
    text = page.read_text()
    assert "measured rows" in text and "Not measured yet" not in text and text.count(matrix.MP_START) == 1


def test_zero_output_cost_reports_each_model(capsys):
    cost = _load("zero_output_cost")
    assert cost.main(["--reps", "1"]) == 0
    rows = [x for x in capsys.readouterr().out.splitlines() if x.startswith("| ") and "µs" in x]
    assert [r.split("|")[1].strip() for r in rows] == [
        "demo transformer", "corpus `bert`", "corpus `gpt2`", "corpus `cnn`"
    ]  # fmt: skip
