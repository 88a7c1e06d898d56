import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from lightning_diag.cli import main
from lightning_diag.core.alerts import Alert, Severity
from lightning_diag.core.registry import default_thresholds
from lightning_diag.report import build_report, find_runs, load_run

CHECK_IDS = [
    "data_label_balance",
    "data_train_test_overlap",
    "grad_norm_band",
    "grad_spread",
    "grad_collapse",
    "units_alive",
    "activations_in_range",
    "outputs_vary",
    "attn_entropy_band",
    "attn_sink",
    "attn_logits_bounded",
    "attn_range",
    "error_concentration",
    "robustness",
    "nonfinite",
    "loss_swing",
    "val_decline",
    "val_fluctuation",
    "update_size",
    "loss_surface",
    "updates_applied",
    "replicas_agree",
    "deploy_quantization_error",
    "deploy_latency_fluctuation",
    # no check row of their own: listed from the callbacks' thresholds() under "Other"
    "amp_not_applied",
    "loss_outlier",
    "loss_stagnant",
    "zero_output",
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
    attention = checks["attn_entropy_band"]
    assert attention["status"] == "pass" and attention["threshold_value"] == {"low": 0.5, "high": 2.5}
    assert 0.5 < attention["measured_value"]["min"] <= attention["measured_value"]["max"] < 3.0
    assert checks["data_label_balance"]["status"] == "not measured"
    assert [a["rule"] for a in run["alerts"]] == ["nonfinite_loss"]
    assert run["dashboard_layout"] is True and run["callbacks"] == [
        "AnomalyAlarm",
        "AttentionEntropyMonitor",
        "GradientFlowMonitor",
    ]


def test_html_with_out_writes_report_and_plots(nan_run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "report"
    assert main(["report", nan_run.log_dir, "--format", "html", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    html = (out / "report.html").read_text()
    pngs = sorted(p.name for p in out.rglob("*.png"))
    assert pngs == ["attn_entropy.png", "grad_norms.png", "loss.png"]
    for png in out.rglob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
        assert f"src='{png.relative_to(out)}'" in html
    assert "nonfinite_loss" in html and "class='fail'" in html


def test_html_to_stdout_embeds_the_plots(nan_run, capsys):
    pytest.importorskip("matplotlib")
    assert main(["report", nan_run.log_dir, "--format", "html"]) == 0
    assert capsys.readouterr().out.count("src='data:image/png;base64,") == 3


def test_md_and_json_work_without_matplotlib(nan_run, tmp_path):
    # torchmetrics imports matplotlib whenever it is installed, so matplotlib itself cannot be hidden here:
    # the plotting module fails to import instead, as it does on an install without the `plots` extra.
    code = (
        "import sys; sys.modules['lightning_diag.report.plots'] = None\n"
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
        "sys.exit(1 if 'lightning_diag.report.plots' in sys.modules else 0)\n"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, env=_env()).returncode == 0
    assert "nonfinite_loss at step 30" in (tmp_path / "report.md").read_text()
    assert not list(tmp_path.rglob("*.png"))


def test_several_runs_are_reported_one_after_another(nan_run, tmp_path, capsys):
    # a copy of the shared run: the session fixture's folder is read by other tests and stays as the demo left it
    root = tmp_path / "runs"
    shutil.copytree(nan_run.log_dir, root / "nan" / "version_0")  # <root>/nan/version_0
    _write_run(root / "other" / "version_0", {"diag/grad_norm/total": [1.0, 0.5], "diag/grad_norm/fc": [1.0, 0.5]})
    assert main(["report", str(root), "--details"]) == 0
    out = capsys.readouterr().out
    sections = [line for line in out.splitlines() if line.startswith("## Run")]
    assert len(sections) == 2 and "nan/version_0" in sections[0] and "other/version_0" in sections[1]
    assert main(["report", str(root)]) == 0  # without --details: one summary line per run, the worst first
    out = capsys.readouterr().out
    assert "## Run" not in out
    rows = [line for line in out.splitlines() if line.startswith(("| FAIL", "| ok"))]
    assert len(rows) == 2 and rows[0].startswith("| FAIL (critical) |") and "nan/version_0" in rows[0]


def test_no_diagnostics_is_a_clear_error(tmp_path, capsys):
    writer = SummaryWriter(str(tmp_path / "plain"))
    writer.add_scalar("accuracy", 1.0, 0)  # no diag/ tag and no loss (a logged loss is a plain run, judged)
    writer.close()
    assert main(["report", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "no lightning_diag diagnostics and no logged loss" in err and "Traceback" not in err
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
    assert "GradientFlowMonitor was not attached" in checks["grad_norm_band"]["note"]


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


_HEAVY = ("torch", "pytorch_lightning", "lightning")


def _heavy_modules_after(code: str) -> list[str]:
    listing = f"sorted({{m.split('.')[0] for m in sys.modules}} & {set(_HEAVY)!r})"
    probe = f"{code}\nimport json, sys\nprint(json.dumps({listing}))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=_env(), check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_report_and_its_cli_load_neither_torch_nor_lightning(tmp_path):
    run = _write_run(tmp_path / "run", {"diag/grad_norm/total": [1.0, 2.0], "diag/grad_norm/fc": [0.5, 0.4]})
    # One process for all three: none of them may have loaded a heavy module by the end.
    code = (
        "import contextlib, io\nimport lightning_diag, lightning_diag.report\nfrom lightning_diag.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n        main(['report', '--help'])\n    except SystemExit:\n        pass\n"
        f"    assert main(['report', {str(run)!r}]) == 0\n"
        "assert 'GradientFlowMonitor' in dir(lightning_diag)"
    )
    assert _heavy_modules_after(code) == []


def test_titles_and_thresholds_come_from_the_registry(tmp_path, capsys):
    thresholds = {"GradientFlowMonitor": {"grad_vanish": 1e-4, "grad_explode": 20.0, "grad_layer_spread": 1000.0}}
    _write_run(tmp_path / "run", {"diag/grad_norm/fc": [0.5, 0.4], "diag/grad_norm/out": [0.1, 0.1]}, (), thresholds)
    (run,) = _report_json(tmp_path, capsys)["runs"]
    checks = {c["id"]: c for c in run["checks"]}
    band = "Gradient of every layer within 0.0001 (||g||/||W||) .. 20 (RMS per element)"
    assert checks["grad_norm_band"]["title"] == band
    assert checks["grad_spread"]["title"] == "Relative gradients of one role across blocks within a ratio of 1000"
    assert checks["val_decline"]["title"] == "Validation metric does not worsen on 5 consecutive runs"


def test_checklist_cannot_pass_what_the_replayed_rules_reject(tmp_path, capsys):
    """The run's alert log is missing; the rules replayed over the logged series still fail the checks."""
    scalars = {
        "diag/attn_entropy/enc.attn/head_0": [1.2, 0.2, 0.2, 0.2],  # collapsed for 3 measurements (patience 2)
        "diag/attn_entropy/enc.attn/head_1": [1.2, 1.1, 1.2, 1.1],
        "diag/attn_entropy/enc.attn/uniform": [2.7, 2.7, 2.7, 2.7],
        "diag/grad_rms/fc": [0.5, 40.0, 0.5, 0.5],  # RMS per element above grad_explode (patience 1)
        "diag/grad_rms/out": [0.5, 0.5, 0.5, 0.5],
        "diag/grad_relative/h.0.fc": [0.01, 0.8, 0.01, 0.01],
        "diag/grad_relative/h.1.fc": [0.01, 0.01, 0.01, 0.01],
    }
    thresholds = {"AttentionEntropyMonitor": {}, "GradientFlowMonitor": {}}
    _write_run(tmp_path / "run", scalars, (), thresholds)
    (run,) = _report_json(tmp_path, capsys)["runs"]
    checks = {c["id"]: c for c in run["checks"]}
    for check_id, step in (("attn_entropy_band", 20), ("grad_norm_band", 10)):
        check = checks[check_id]
        assert check["status"] == "fail", check
        assert check["alerts"] == 0 and check["replayed"] == 1 and check["first_alert_step"] == step
        assert "replaying the rule" in check["note"]
    assert checks["grad_spread"]["status"] == "pass"  # 80x once: below 100


@pytest.mark.parametrize("noted", [False, True])
def test_replay_honours_the_runs_own_sink_and_alignment_notes(tmp_path, capsys, noted):
    """A causal attention sink is explained by statistics that are not logged; the run's info note says so."""
    scalars = {
        "diag/attn_entropy/dec.self_attn/head_0": [1.2, 0.2, 0.2, 0.2],
        "diag/attn_entropy/dec.self_attn/uniform": [2.7, 2.7, 2.7, 2.7],
    }
    note = Alert("attn_entropy_low", Severity.INFO, "1 of 1 heads ... attention sink", 0, 20, 0.9, 0.5, "dec.self_attn")
    _write_run(tmp_path / "run", scalars, [note] if noted else [], {"AttentionEntropyMonitor": {}})
    (run,) = _report_json(tmp_path, capsys)["runs"]
    band = next(c for c in run["checks"] if c["id"] == "attn_entropy_band")
    assert band["status"] == ("pass" if noted else "fail"), band
    assert band["replayed"] == (0 if noted else 1)


def test_replay_excuses_the_explained_module_only_when_heads_are_grouped(tmp_path, capsys):
    """The explained module holds the worst head of the step; the other module's collapse still fails the check."""
    scalars = {
        "diag/attn_entropy/dec.self_attn/head_0": [1.2, 0.05, 0.05, 0.05],  # the sink the run's note explains
        "diag/attn_entropy/dec.self_attn/uniform": [2.7, 2.7, 2.7, 2.7],
        "diag/attn_entropy/dec.cross_attn/head_0": [1.2, 0.2, 0.2, 0.2],  # collapsed at the same steps
        "diag/attn_entropy/dec.cross_attn/uniform": [2.7, 2.7, 2.7, 2.7],
    }
    note = Alert("attn_entropy_low", Severity.INFO, "1 of 1 heads ... attention sink", 0, 20, 0.9, 0.5, "dec.self_attn")
    _write_run(tmp_path / "run", scalars, [note], {"AttentionEntropyMonitor": {}})
    (run,) = _report_json(tmp_path, capsys)["runs"]
    band = next(c for c in run["checks"] if c["id"] == "attn_entropy_band")
    assert band["status"] == "fail" and band["replayed"] == 1, band


def test_replay_tells_learned_sharpness_from_a_collapse_with_the_logged_loss(tmp_path, capsys):
    """Issue 23: a head that sharpens gradually while the logged training loss falls is learned, not a collapse."""
    scalars = {
        "diag/attn_entropy/h.1.attn/head_0": [1.2, 0.9, 0.7, 0.55, 0.47, 0.45, 0.46],
        "diag/attn_entropy/h.1.attn/head_1": [1.5] * 7,
        "diag/attn_entropy/h.1.attn/uniform": [2.7] * 7,
        "diag/loss/train_step": [3.0, 2.5, 2.0, 1.6, 1.2, 1.0, 0.9],
    }
    _write_run(tmp_path / "run", scalars, (), {"AttentionEntropyMonitor": {}})
    (run,) = _report_json(tmp_path, capsys)["runs"]
    band = next(c for c in run["checks"] if c["id"] == "attn_entropy_band")
    assert band["status"] == "pass" and band["replayed"] == 0, band


@pytest.mark.parametrize(("uniform", "hint"), [(3.0, False), (2.7, True)])
def test_high_entropy_is_judged_as_the_rule_judges_it(tmp_path, capsys, uniform, hint):
    # 2.6 nats is above attn_entropy_high's 2.5; the rule also needs 0.9 of uniform after 200 steps, and is info.
    writer = SummaryWriter(str(tmp_path / "run"))
    for step in (300, 310, 320):
        writer.add_scalar("diag/attn_entropy/enc.attn/head_0", 2.6, global_step=step)
        writer.add_scalar("diag/attn_entropy/enc.attn/uniform", uniform, global_step=step)
    writer.close()
    (tmp_path / "run" / "diag").mkdir()
    logged = {"AttentionEntropyMonitor": default_thresholds("AttentionEntropyMonitor")}  # what the callback writes
    (tmp_path / "run" / "diag" / "thresholds.json").write_text(json.dumps({"callbacks": logged}))
    (run,) = _report_json(tmp_path, capsys)["runs"]
    band = next(c for c in run["checks"] if c["id"] == "attn_entropy_band")
    assert "while near uniform (0.9 of it) after step 200" in band["title"]
    assert "0.9 of uniform" in band["threshold"]
    assert band["status"] == "pass" and "3 measurements above 2.5 nats" in band["note"]
    assert ("replayed info hints: attn_entropy_high" in band["note"]) == hint


def test_latency_fluctuation_row_is_measured_from_the_system_monitor(tmp_path, capsys):
    from lightning_diag.core.alerts import Alert

    rows = {}
    alert = Alert("step_time_fluctuation", "warning", "fluctuates", 0, 20, 0.4, 0.15, "step_time")
    for name, values, alerts in (("ok", [0.03, 0.05, 0.04], ()), ("bad", [0.3, 0.35, 0.4], [alert])):
        _write_run(tmp_path / name, {"diag/system/step_time_fluctuation": values}, alerts=alerts)
        (run,) = _report_json(tmp_path / name, capsys)["runs"]
        rows[name] = next(c for c in run["checks"] if c["id"] == "deploy_latency_fluctuation")
    assert rows["ok"]["status"] == "pass" and rows["ok"]["measured_value"]["max"] == pytest.approx(0.05)
    assert rows["ok"]["threshold_value"] == {"value": 0.15}
    assert rows["bad"]["status"] == "fail" and rows["bad"]["measured_value"]["max"] == pytest.approx(0.4)
