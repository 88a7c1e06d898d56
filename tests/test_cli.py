import json
import subprocess
import sys

import pytest

from lightning_diag.cli import main


def test_demo_nan_stops_with_critical_alert(tmp_path, capsys):
    assert main(["demo", "--fault", "nan", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "nonfinite_loss" in out and "[critical]" in out
    assert "tensorboard --logdir" in out
    files = list(tmp_path.rglob("alerts.jsonl"))
    assert len(files) == 1
    (record,) = [json.loads(x) for x in files[0].read_text().splitlines()]
    assert record["rule"] == "nonfinite_loss" and record["global_step"] == 30


def test_demo_leaves_out_lightnings_start_up_notes_and_restores_their_level(tmp_path, caplog):
    import logging

    notes = logging.getLogger("pytorch_lightning.utilities.rank_zero")
    before = notes.level
    with caplog.at_level(logging.INFO):
        assert main(["demo", "--fault", "none", "--max-epochs", "1", "--root", str(tmp_path)]) == 0
    lightning = [r.getMessage() for r in caplog.records if r.name.startswith("pytorch_lightning")]
    assert not [m for m in lightning if "GPU available" in m or "litlogger" in m], lightning
    assert notes.level == before


def test_demo_none_has_no_alerts(tmp_path, capsys):
    assert main(["demo", "--fault", "none", "--max-epochs", "2", "--root", str(tmp_path)]) == 0
    assert "alerts: none" in capsys.readouterr().out


def test_unknown_fault_is_rejected(capsys):
    with pytest.raises(SystemExit) as info:
        main(["demo", "--fault", "gremlins"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_bad_max_epochs(capsys):
    assert main(["demo", "--max-epochs", "0"]) == 2


def test_python_dash_m_help():
    out = subprocess.run([sys.executable, "-m", "lightning_diag", "demo", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--fault" in out.stdout


def test_report_help_names_the_mapping_roles_and_details(capsys):
    with pytest.raises(SystemExit) as done:
        main(["report", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert done.value.code == 0
    assert "--map ROLE=TAG" in out and "train_loss, train_loss_epoch, val_loss, lr or epoch" in out
    assert "--details" in out and "without lightning_diag callbacks" in out


def test_report_map_is_checked_before_the_folder_is_read(tmp_path, capsys):
    # a bad --map is bad input (exit 2, one line) even where the folder holds nothing to report
    assert main(["report", str(tmp_path), "--map", "nll"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["lightning-diag report: --map 'nll': expected ROLE=TAG, for example --map val_loss=valid/nll"]
