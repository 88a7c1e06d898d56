import runpy
from pathlib import Path


def test_example_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    runpy.run_path(
        str(Path(__file__).resolve().parents[1] / "examples" / "train_with_diagnostics.py"),
        run_name="__main__",
    )
    assert "0 alerts" in capsys.readouterr().out
    assert list(tmp_path.rglob("events.out.tfevents.*"))
