import runpy
from pathlib import Path

import pytest


def test_example_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    runpy.run_path(
        str(Path(__file__).resolve().parents[1] / "examples" / "train_with_diagnostics.py"),
        run_name="__main__",
    )
    assert "0 alerts" in capsys.readouterr().out
    assert list(tmp_path.rglob("events.out.tfevents.*"))


def test_hugging_face_example_logs_attention_entropy(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "hf_attention.py"), run_name="__main__")
    assert "0 alerts" in capsys.readouterr().out
    (events,) = tmp_path.rglob("events.out.tfevents.*")
    acc = EventAccumulator(str(events.parent))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    layers = [f"bert.encoder.layer.{i}.attention.self" for i in range(2)]  # seen without any call in the model
    assert {f"diag/attn_entropy/{n}/head_{h}" for n in layers for h in range(4)} <= tags
    assert len(acc.Scalars(f"diag/attn_entropy/{layers[0]}/mean")) == 3  # steps 4, 9, 14 of 16 (logging steps)
