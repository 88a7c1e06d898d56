"""``lightning-diag report`` as a CI gate, one run at a time, and its pictures (issue 24).

The runs here are written by hand (alert logs, thresholds, event files from a ``SummaryWriter``): no training.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_diag.cli import main
from lightning_diag.core.alerts import Alert, Severity
from lightning_diag.report import build_report, gate, iter_reports, load_run, render, render_stream

THRESHOLDS = {
    "AnomalyAlarm": {"loss_swing": 0.1, "nonfinite_loss": 0.0},
    "GradientFlowMonitor": {"grad_explode": 10.0, "grad_vanish": 0.001},
    "SystemMonitor": {"dataloader_bound": 0.25},
    "DataDiagnostics": {"data_leakage": 0.15},
    "SharpnessProbe": {"sharp_minimum": 0.3},
}


def _run(path: Path, *alerts: Alert, callbacks: dict | None = None) -> Path:
    diag = path / "diag"
    diag.mkdir(parents=True)
    merged = {k: v for d in (callbacks or THRESHOLDS).values() for k, v in d.items()}
    (diag / "thresholds.json").write_text(json.dumps({"callbacks": callbacks or THRESHOLDS, "thresholds": merged}))
    if alerts:
        (diag / "alerts.jsonl").write_text("".join(a.to_json() + "\n" for a in alerts))
    return path


def _alert(rule: str, severity: str, step: int = 5) -> Alert:
    return Alert(rule, Severity(severity), f"{rule} fired", 0, step, 1.0, 0.1, "loss")


def _events(path: Path, scalars: dict[str, list[tuple[int, float]]]) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(path))
    for tag, points in scalars.items():
        for step, value in points:
            writer.add_scalar(tag, value, global_step=step)
    writer.close()


# -- --fail-on ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("severity", "fail_on", "code"),
    [
        ("warning", "never", 0),
        ("warning", "warning", 1),
        ("warning", "critical", 0),
        ("critical", "warning", 1),
        ("critical", "critical", 1),
        ("info", "warning", 0),
    ],
)
def test_fail_on_gates_on_alerts_at_that_level(tmp_path, capsys, severity, fail_on, code):
    rule = "nonfinite_loss" if severity == "critical" else "loss_swing"
    _run(tmp_path / "run", _alert(rule, severity))
    assert main(["report", str(tmp_path), "--fail-on", fail_on]) == code
    captured = capsys.readouterr()
    assert "# lightning-diag report" in captured.out  # the report is printed either way
    assert (f"--fail-on {fail_on}" in captured.err) == bool(code)


def test_fail_on_default_is_never(tmp_path, capsys):
    _run(tmp_path / "run", _alert("nonfinite_loss", "critical"))
    assert main(["report", str(tmp_path)]) == 0


def test_a_fail_row_without_a_logged_alert_gates(tmp_path, capsys):
    # No alert in the log, but the replayed rule fails the row: a FAIL row at warning level.
    run = _run(tmp_path / "run")
    # epoch points 20 optimizer steps apart whose step losses spread by 0.01: each change is far above its noise
    _events(run, {"diag/loss/train_epoch": [(20 * i, 1.25**i) for i in range(7)],
                  "diag/loss/train_spread": [(20 * i, 0.01) for i in range(7)],
                  "diag/loss/swing": [(20 * i, 0.25) for i in range(1, 7)]})
    (report,) = build_report(tmp_path)
    failed = [c for c in report.checks if c.status == "fail"]
    assert failed and all(c.severity == "warning" for c in failed) and not report.run.alerts
    assert main(["report", str(tmp_path), "--fail-on", "warning"]) == 1
    assert "FAIL row" in capsys.readouterr().err
    assert main(["report", str(tmp_path), "--fail-on", "critical"]) == 0


def test_gate_names_every_finding_and_checks_its_argument(tmp_path):
    _run(tmp_path / "run", _alert("loss_swing", "warning"), _alert("nonfinite_loss", "critical", 9))
    (report,) = build_report(tmp_path)
    reasons = gate(report, "warning")
    assert any("warning alert loss_swing at step 5" in r for r in reasons)
    assert any("critical alert nonfinite_loss at step 9" in r for r in reasons)
    assert all("loss_swing" not in r or "FAIL" in r for r in gate(report, "critical"))
    with pytest.raises(ValueError, match="fail_on"):
        gate(report, "sometimes")  # type: ignore[arg-type]


def test_fail_on_judges_every_run_of_a_folder(tmp_path, capsys):
    _run(tmp_path / "a")
    _run(tmp_path / "b", _alert("nonfinite_loss", "critical"))
    assert main(["report", str(tmp_path), "--fail-on", "critical"]) == 1
    err = capsys.readouterr().err
    assert str(tmp_path / "b") in err and str(tmp_path / "a") + ":" not in err


def test_bad_fail_on_is_rejected(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["report", str(tmp_path), "--fail-on", "sometimes"])
    assert info.value.code == 2


def test_no_diagnostics_prints_nothing_on_stdout(tmp_path, capsys):
    assert main(["report", str(tmp_path), "--fail-on", "warning"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "no lightning_diag diagnostics" in captured.err


def test_version(capsys):
    from lightning_diag import __version__

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"lightning-diag {__version__}"


def test_version_imports_neither_torch_nor_lightning():
    code = (
        "import sys\n"
        "from lightning_diag.cli import main\n"
        "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
        "sys.exit(1 if {'torch', 'pytorch_lightning'} & set(sys.modules) else 0)\n"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


# -- one run at a time ----------------------------------------------------------------------------------------------


def test_event_files_keep_only_diag_tags(tmp_path):
    run = _run(tmp_path / "run")
    _events(run, {"train_loss": [(0, 1.0), (1, 0.5)], "diag/grad_norm/total": [(1, 2.0), (0, 3.0)]})
    data = load_run(run)
    assert data.scalars == {"diag/grad_norm/total": [(0, 3.0), (1, 2.0)]}


def test_runs_are_reported_one_at_a_time(tmp_path):
    for name in ("a", "b", "c"):
        _events(_run(tmp_path / name), {"diag/grad_norm/total": [(s, 1.0) for s in range(5)]})
    seen: list[tuple[int, int]] = []
    reports = iter_reports(tmp_path, progress=lambda i, n, path: seen.append((i, n)))
    first = next(reports)
    assert seen == [(0, 3)]  # the next run is not read before this one is handed on
    assert first.run.scalars == {}  # its series are dropped once diagnosed
    rest = list(reports)
    assert seen == [(0, 3), (1, 3), (2, 3)] and len(rest) == 2
    kept = build_report(tmp_path)  # the list form keeps them
    assert all(r.run.scalars for r in kept)


def test_streamed_rendering_is_the_rendered_document(tmp_path):
    _run(tmp_path / "a", _alert("loss_swing", "warning"))
    _run(tmp_path / "b")
    reports = build_report(tmp_path)
    for fmt in ("md", "json", "html"):
        assert "".join(render_stream(reports, fmt)) == render(reports, fmt)  # type: ignore[arg-type]
    assert len(json.loads(render(reports, "json"))["runs"]) == 2


def test_progress_bar_only_on_a_terminal(tmp_path, capsys, monkeypatch):
    _run(tmp_path / "a")
    _run(tmp_path / "b")
    assert main(["report", str(tmp_path)]) == 0
    assert "[" not in capsys.readouterr().err  # not a terminal: no bar
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["report", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "lightning-diag report [" in err and "2/2" in err


# -- pictures ---------------------------------------------------------------------------------------------------------


def _pictured_run(root: Path) -> Path:
    run = _run(root / "run")
    steps = range(0, 20, 2)
    _events(
        run,
        {
            "diag/grad_norm/total": [(s, 1.0) for s in steps],
            "diag/grad_norm/fc": [(s, 0.5) for s in steps],
            "diag/grad_rms/fc": [(s, 0.01) for s in steps],
            "diag/grad_relative/fc": [(s, 0.05) for s in steps],
            "diag/system/step_time_s": [(s, 0.1) for s in steps],
            "diag/system/data_wait_share": [(s, 0.05) for s in steps],
            "diag/data/leaked_fraction": [(0, 0.0)],
            "diag/data/vocab_kl": [(0, 0.01)],
            "diag/sharpness/gap": [(9, 0.01), (19, 0.02)],
        },
    )
    return run


def test_gradient_thresholds_are_drawn_over_the_quantity_they_judge(tmp_path):
    pytest.importorskip("matplotlib")
    from lightning_diag.report import plots

    run = load_run(_pictured_run(tmp_path))
    judged = {c.title: (sorted(c.series), c.rules) for c in plots._charts(run, "Gradients") if c.rules}
    assert judged == {
        "RMS gradient per element, per layer (line: grad_explode)": (["diag/grad_rms/fc"], ["grad_explode"]),
        "relative gradient ||g|| / ||W|| per weight matrix (line: grad_vanish)": (
            ["diag/grad_relative/fc"],
            ["grad_vanish"],
        ),
    }


def test_system_data_and_probes_plots_in_the_html_report(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    _pictured_run(tmp_path / "logs")
    out = tmp_path / "out"
    assert main(["report", str(tmp_path / "logs"), "--format", "html", "--out", str(out)]) == 0
    pngs = sorted(p.name for p in out.rglob("*.png"))
    assert pngs == ["data.png", "grad_norms.png", "probes.png", "system.png"]
    page = (out / "report.html").read_text()
    for name in pngs:
        assert f"{name}'" in page
