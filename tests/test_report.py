import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from lightning_diag.alerts import Alert, Severity
from lightning_diag.cli import main
from lightning_diag.report import build_report, find_runs, load_run

CHECK_IDS = [
    "data_label_balance",
    "data_train_test_overlap",
    "grad_norm_band",
    "grad_spread",
    "grad_collapse",
    "attn_entropy_band",
    "attn_sink",
    "nonfinite",
    "loss_swing",
    "val_decline",
    "val_fluctuation",
    "deploy_quantization_error",
    "deploy_latency_fluctuation",
]


def _env() -> dict[str, str]:
    # The subprocess imports this checkout's package, whatever the venv's editable install points at.
    root = str(Path(__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


def _report_json(logdir, capsys) -> dict:
    assert main(["report", str(logdir), "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def _write_run(path: Path, scalars: dict[str, list[float]], alerts=(), thresholds=None) -> Path:
    """A synthetic run: scalars at steps 0, 10, 20, ..., an alert log and a thresholds file."""
    writer = SummaryWriter(str(path))
    for name, values in scalars.items():
        for i, v in enumerate(values):
            writer.add_scalar(name, v, global_step=10 * i)
    writer.close()
    diag = path / "diag"
    diag.mkdir(parents=True, exist_ok=True)
    if alerts:
        (diag / "alerts.jsonl").write_text("".join(a.to_json() + "\n" for a in alerts))
    if thresholds is not None:
        (diag / "thresholds.json").write_text(json.dumps({"callbacks": thresholds}))
    return path


def test_md_report_of_the_nan_demo_names_the_alert_and_its_step(nan_run, capsys):
    assert main(["report", nan_run.log_dir]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "No NaN/Inf" in x)
    assert "**FAIL**" in line and "nonfinite_loss at step 30" in line
    assert "| 30 | 1 | critical | nonfinite_loss | loss |" in out  # the timeline
    assert "Thresholds: diag/thresholds.json" in out


def test_json_report_carries_every_check(nan_run, capsys):
    (run,) = _report_json(nan_run.log_dir, capsys)["runs"]
    checks = {c["id"]: c for c in run["checks"]}
    assert list(checks) == CHECK_IDS
    assert all(c["status"] in ("pass", "fail", "not measured") for c in checks.values())
    nonfinite = checks["nonfinite"]
    assert nonfinite["status"] == "fail" and nonfinite["first_alert_step"] == 30
    band = checks["grad_norm_band"]
    assert band["status"] == "pass" and band["threshold_value"] == {"low": 0.001, "high": 10.0}
    assert 0.001 < band["measured_value"]["min"] <= band["measured_value"]["max"] < 10.0
    assert checks["attn_entropy_band"]["status"] == "not measured"
    assert "AttentionEntropyMonitor was not attached" in checks["attn_entropy_band"]["note"]
    assert checks["data_label_balance"]["status"] == "not measured"
    assert [a["rule"] for a in run["alerts"]] == ["nonfinite_loss"]
    assert run["dashboard_layout"] is True and run["callbacks"] == ["AnomalyAlarm", "GradientFlowMonitor"]


def test_html_with_out_writes_report_and_plots(nan_run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "report"
    assert main(["report", nan_run.log_dir, "--format", "html", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    html = (out / "report.html").read_text()
    pngs = sorted(p.name for p in out.rglob("*.png"))
    assert pngs == ["grad_norms.png", "loss.png"]
    for png in out.rglob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
        assert f"src='{png.relative_to(out)}'" in html
    assert "nonfinite_loss" in html and "class='fail'" in html


def test_html_to_stdout_embeds_the_plots(nan_run, capsys):
    pytest.importorskip("matplotlib")
    assert main(["report", nan_run.log_dir, "--format", "html"]) == 0
    assert capsys.readouterr().out.count("src='data:image/png;base64,") == 2


def test_md_and_json_work_without_matplotlib(nan_run, tmp_path):
    # torchmetrics imports matplotlib whenever it is installed, so matplotlib itself cannot be hidden here:
    # the plotting module fails to import instead, as it does on an install without the `plots` extra.
    code = (
        "import sys; sys.modules['lightning_diag.plots'] = None\n"
        "from lightning_diag.cli import main\n"
        f"sys.exit(main(['report', {nan_run.log_dir!r}, '--out', {str(tmp_path)!r}]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
    assert out.returncode == 0, out.stderr
    assert "matplotlib is not installed" in out.stderr
    # Without --out, md and json never touch the plotting module.
    code = (
        "import sys\nfrom lightning_diag.cli import main\n"
        f"assert main(['report', {nan_run.log_dir!r}, '--format', 'json']) == 0\n"
        "sys.exit(1 if 'lightning_diag.plots' in sys.modules else 0)\n"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, env=_env()).returncode == 0
    assert "nonfinite_loss at step 30" in (tmp_path / "report.md").read_text()
    assert not list(tmp_path.rglob("*.png"))


def test_several_runs_are_reported_one_after_another(nan_run, tmp_path, capsys):
    root = Path(nan_run.log_dir).parents[1]  # <root>/nan/version_0
    _write_run(root / "other" / "version_0", {"diag/grad_norm/total": [1.0, 0.5], "diag/grad_norm/fc": [1.0, 0.5]})
    assert main(["report", str(root)]) == 0
    out = capsys.readouterr().out
    sections = [line for line in out.splitlines() if line.startswith("## Run")]
    assert len(sections) == 2 and "nan/version_0" in sections[0] and "other/version_0" in sections[1]


def test_no_diagnostics_is_a_clear_error(tmp_path, capsys):
    writer = SummaryWriter(str(tmp_path / "plain"))
    writer.add_scalar("train_loss", 1.0, 0)
    writer.close()
    assert main(["report", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "no lightning_diag diagnostics" in err and "Traceback" not in err
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_bad_format_and_out_are_rejected(nan_run, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["report", nan_run.log_dir, "--format", "pdf"])
    assert info.value.code == 2
    (tmp_path / "file").write_text("x")
    assert main(["report", nan_run.log_dir, "--out", str(tmp_path / "file")]) == 2


def test_attention_and_new_rules_are_judged_from_the_log(tmp_path, capsys):
    heads = {f"diag/attn_entropy/enc.layers.0.attn/head_{h}": [1.5, 0.9 - 0.4 * h, 0.2] for h in range(2)}
    alerts = [
        Alert("attn_entropy_low", Severity.WARNING, "head collapsed", 0, 20, 0.2, 0.4, "enc.layers.0.attn/head_0"),
        Alert("attn_rank_collapse", Severity.WARNING, "a future rule", 0, 10, 3.0, 2.0, "enc"),
    ]
    thresholds = {"AttentionEntropyMonitor": {"attn_entropy_low": 0.4, "attn_entropy_high": 3.0, "attn_sink": 0.6}}
    _write_run(tmp_path / "run", {**heads, "diag/attn_sink/enc.layers.0.attn": [0.1, 0.2, 0.3]}, alerts, thresholds)
    (run,) = _report_json(tmp_path, capsys)["runs"]
    checks = {c["id"]: c for c in run["checks"]}
    band = checks["attn_entropy_band"]
    assert band["status"] == "fail" and band["first_alert_step"] == 20
    assert band["threshold_value"] == {"low": 0.4, "high": 3.0}
    assert band["measured_value"] == {"min": pytest.approx(0.2), "max": pytest.approx(1.5)}
    sink = checks["attn_sink"]
    assert sink["status"] == "pass" and sink["measured_value"]["max"] == pytest.approx(0.3)
    assert sink["threshold_value"] == {"value": 0.6}
    assert checks["attn_rank_collapse"]["status"] == "fail" and checks["attn_rank_collapse"]["layer"] == "Other"
    assert checks["grad_norm_band"]["status"] == "not measured"


def test_attention_heatmap_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    heads = {f"diag/attn_entropy/enc.layers.{i}.attn/head_{h}": [1.0, 1.2, 0.8] for i in range(2) for h in range(4)}
    _write_run(tmp_path / "run", heads, thresholds={"AttentionEntropyMonitor": {"attn_entropy_low": 0.5}})
    (report,) = build_report(tmp_path, plot_dir=tmp_path / "plots")
    assert [p.name for p in report.plots] == ["attn_entropy.png"]


def test_training_checks_measure_the_logged_series(tmp_path, capsys):
    scalars = {
        "diag/loss/val": [1.0, 1.1, 1.2, 1.3, 1.2, 1.3],  # 3 worse in a row, then 1
        "diag/loss/swing": [-0.3, 0.15, -0.12],
        "diag/loss/train_fluctuation": [0.1, 0.1],
        "diag/loss/val_fluctuation": [0.1, 0.25],
        "diag/grad_norm/total": [1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.004],
    }
    _write_run(tmp_path / "run", scalars)  # no thresholds logged: the library defaults are used
    (run,) = _report_json(tmp_path, capsys)["runs"]
    assert run["threshold_source"].startswith("not logged")
    checks = {c["id"]: c for c in run["checks"]}
    assert checks["val_decline"]["measured_value"] == {"max": 3.0} and checks["val_decline"]["status"] == "pass"
    assert checks["loss_swing"]["measured_value"] == {"max": pytest.approx(0.15), "min": pytest.approx(-0.3)}
    assert checks["val_fluctuation"]["measured_value"] == {"max": pytest.approx(2.5)}
    assert checks["grad_collapse"]["measured_value"]["min"] == pytest.approx(0.004)
    assert checks["grad_collapse"]["threshold_value"] == {"value": 0.01}


def test_runs_are_found_beside_their_diag_folder(tmp_path):
    # Without a TensorBoard logger the library writes its events into <log_dir>/diag.
    _write_run(tmp_path / "a" / "diag", {"diag/grad_norm/total": [1.0]})
    _write_run(tmp_path / "b", {"diag/grad_norm/total": [1.0]})
    assert find_runs(tmp_path) == [tmp_path / "a", tmp_path / "b"]
    assert load_run(tmp_path / "a").scalars["diag/grad_norm/total"] == [(0, 1.0)]


def test_a_callback_without_thresholds_is_judged_by_its_alert_thresholds(tmp_path, capsys):
    # An attention callback that writes no thresholds() yet: the report takes them from its alerts.
    alerts = [Alert("attn_sink", Severity.WARNING, "sink", 2, 35, 1.0, 0.5, "encoder.layers.0.self_attn")]
    thresholds = {"AttentionEntropyMonitor": {}, "AnomalyAlarm": {"loss_swing": 0.1}}
    _write_run(tmp_path / "run", {"diag/attn_sink/encoder.layers.0.self_attn": [0.1, 1.0]}, alerts, thresholds)
    (run,) = _report_json(tmp_path, capsys)["runs"]
    sink = next(c for c in run["checks"] if c["id"] == "attn_sink")
    assert sink["status"] == "fail" and sink["threshold_value"] == {"value": 0.5}
    assert sink["measured_value"] == {"max": 1.0} and sink["first_alert_step"] == 35
