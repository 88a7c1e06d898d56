"""Where and how `report`, `compare` and `repro` write (issue 36): never over a user's file or outside `--out`,
never an empty report on a failing disk, output escaped for its format, no control character on a terminal,
one-line messages and exit code 2 for bad input."""

import errno
import json
import re

import pytest

from lightning_diag.cli import main
from tests.report.runs import alert, cli, make_run, write_events

HOSTILE = "<script>alert(1)</script><img src=x onerror=alert(2)> [x](javascript:y) `code` | cell"
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f]")  # everything but tab and newline


def test_cp1252_stdout_degrades_instead_of_crashing(tmp_path):
    run = make_run(tmp_path / "run", alerts=[alert(message="ε − loss swings")])
    for fmt in ("md", "html"):
        done = cli("report", str(run), "--format", fmt, env={"PYTHONIOENCODING": "cp1252"})
        assert done.returncode == 0, done.stderr.decode("cp1252", "replace")
        assert b"Traceback" not in done.stderr
        assert "? ? loss swings" in done.stdout.decode("cp1252")  # neither ε nor − is in cp1252


def test_out_that_cannot_be_created_is_one_line_and_exit_2(tmp_path, capsys):
    run = make_run(tmp_path / "run", alerts=[alert()])
    (tmp_path / "file").write_text("mine")
    assert main(["report", str(run), "--out", str(tmp_path / "file" / "sub")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "file/sub" in err and "cannot be created" in err


def test_a_full_disk_leaves_no_empty_report_and_keeps_the_earlier_one(tmp_path, capsys, monkeypatch):
    import lightning_diag.report as report

    run = make_run(tmp_path / "run", alerts=[alert()])
    out = tmp_path / "out"
    assert main(["report", str(run), "--out", str(out)]) == 0
    earlier = (out / "report.md").read_text()

    def full(reports, fmt, plot_base=None, details=True):
        list(reports)
        yield "# lightning-diag report\n"
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(report, "render_stream", full)
    assert main(["report", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and err.count("\n") == 1
    assert (out / "report.md").read_text() == earlier
    assert sorted(p.name for p in out.iterdir()) == ["lightning-diag-plots", "report.md"]  # no temp file left
    out2 = tmp_path / "out2"
    assert main(["report", str(run), "--out", str(out2)]) == 2
    assert not (out2 / "report.md").exists()


def test_out_never_overwrites_a_users_file_of_the_same_name(tmp_path, capsys):
    run = make_run(tmp_path / "run", alerts=[alert()])
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("my own notes")
    assert main(["report", str(run), "--out", str(out)]) == 2
    assert "not a lightning-diag report; not overwritten" in capsys.readouterr().err
    assert (out / "report.md").read_text() == "my own notes"
    assert main(["report", str(run), "--out", str(out), "--format", "json"]) == 0  # report.json is free
    assert main(["report", str(run), "--out", str(out), "--format", "json"]) == 0  # and ours to replace


def test_a_run_folder_named_report_md_is_not_written_over(tmp_path, capsys):
    logs = tmp_path / "logs"
    make_run(logs / "report.md", alerts=[alert()])
    assert main(["report", str(logs), "--out", str(logs)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "report.md exists and is not a regular file" in err
    assert (logs / "report.md" / "diag" / "alerts.jsonl").is_file()


def test_html_into_the_log_folder_writes_only_its_own_files(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    logs = tmp_path / "logs"
    run = make_run(logs / "my run #2", alerts=[alert()])
    (run / "loss.png").write_bytes(b"the user's own plot")
    before = {p: p.read_bytes() for p in logs.rglob("*") if p.is_file()}
    assert main(["report", str(logs), "--format", "html", "--out", str(logs)]) == 0
    capsys.readouterr()
    for path, data in before.items():
        assert path.read_bytes() == data
    new = sorted(str(p.relative_to(logs)) for p in logs.rglob("*") if p.is_file() and p not in before)
    assert new == ["lightning-diag-plots/my run #2/loss.png", "report.html"]
    page = (logs / "report.html").read_text()
    assert "src='lightning-diag-plots/my%20run%20%232/loss.png'" in page  # URL-encoded link


def test_markdown_plot_links_are_url_encoded(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    make_run(tmp_path / "logs" / "my run #2", alerts=[alert()])
    assert main(["report", str(tmp_path / "logs"), "--out", str(tmp_path / "out")]) == 0
    assert "](lightning-diag-plots/my%20run%20%232/loss.png)" in (tmp_path / "out" / "report.md").read_text()


def test_a_mathtext_tag_skips_its_plot_with_a_note(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = make_run(tmp_path / "run", alerts=[alert()])
    write_events(run, {"diag/grad_norm/$\\foo$": [1.0] * 8, "diag/grad_norm/total": [1.0] * 8}, suffix=".g")
    out = tmp_path / "out"
    assert main(["report", str(run), "--format", "html", "--out", str(out)]) == 0
    page = (out / "report.html").read_text()
    assert "grad_norms.png: plot skipped" in page and "loss.png'" in page
    assert sorted(p.name for p in out.rglob("*.png")) == ["loss.png"]
    assert "grad_norms.png: plot skipped" in capsys.readouterr().err


def _hostile_run(path):
    name = "run\x1b]0;pwned\x07\x1b[2J"
    run = make_run(path / name, alerts=[alert(message=HOSTILE + "\r\n| injected | row |", source="<b>src</b>\n#")])
    thresholds = {"<img src=x onerror=alert(3)>": {"loss_swing": 0.1}, "AnomalyAlarm": {"loss_swing": 0.1}}
    (run / "diag" / "thresholds.json").write_text(json.dumps({"callbacks": thresholds}))
    return run


def test_markdown_report_escapes_html_markdown_and_line_breaks(tmp_path, capsys):
    _hostile_run(tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "<script>" not in out and "<img" not in out and "<b>" not in out
    assert "&lt;script>" in out and "\\[x\\](javascript:y)" in out and "\\`code\\`" in out
    assert not any(line.startswith("| injected") for line in out.splitlines())  # CR/LF start no line
    row = next(line for line in out.splitlines() if "loss_swing | " in line and "&lt;script" in line)
    assert row.count(" | ") == 7  # the eight cells of the timeline, no more: `|` escaped
    assert not CONTROL.search(out)
    assert "\x1b" not in out and "\x07" not in out


def test_html_report_escapes_and_strips_control_characters(tmp_path, capsys):
    _hostile_run(tmp_path)
    assert main(["report", str(tmp_path), "--format", "html"]) == 0
    out = capsys.readouterr().out
    assert "<script>" not in out and "<img src=x" not in out and "&lt;script&gt;" in out
    assert not CONTROL.search(out)


def test_terminal_messages_carry_no_control_characters(tmp_path, capsys):
    run = _hostile_run(tmp_path)
    (run / "diag" / "alerts.jsonl").write_text("{broken\x1b[31m\n" + alert(message="a\x07b").to_json() + "\n")
    assert main(["report", str(tmp_path), "--fail-on", "warning"]) == 1
    captured = capsys.readouterr()
    assert not CONTROL.search(captured.out) and not CONTROL.search(captured.err)
    assert "alerts.jsonl: 1 line(s) that are not alerts were skipped" in captured.err
    assert main(["report", str(tmp_path / "missing\x1b[2J")]) == 2
    err = capsys.readouterr().err
    assert not CONTROL.search(err) and err.count("\n") == 1 and "does not exist" in err


def test_compare_markdown_and_html_escape_hyperparameters(tmp_path, capsys):
    runs = [make_run(tmp_path / n, alerts=[alert(message=HOSTILE)]) for n in ("a", "b")]
    for run, value in zip(runs, ("<script>x</script>\n| fake | row |", "\x1b[2Jplain"), strict=True):
        (run / "diag" / "run.json").write_text(json.dumps({"hyperparameters": {"note": value}}))
    for fmt in ("md", "html"):
        assert main(["compare", str(runs[0]), str(runs[1]), "--format", fmt]) == 0
        out = capsys.readouterr().out
        assert "<script>" not in out and "&lt;script" in out and not CONTROL.search(out)
        assert not any(line.startswith("| fake") for line in out.splitlines())


def test_repro_with_invalid_yaml_says_what_is_wrong_in_one_line(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text("model:\n  class_path: x\n  init_args: [unclosed\n")
    assert main(["repro", "--config", str(config)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert str(config) in captured.err and "invalid YAML at line" in captured.err
    config.write_text("- just\n- a list\n")
    assert main(["repro", "--config", str(config)]) == 2
    assert "is a mapping" in capsys.readouterr().err


def test_repro_with_a_config_lightning_rejects_is_one_line(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text("trainer:\n  no_such_argument: 1\n")
    assert main(["repro", "--config", str(config)]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "LightningCLI rejects it" in captured.err and str(config) in captured.err
    assert "usage:" not in captured.out + captured.err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["report", "{tmp}/missing"], "LOGDIR {tmp}/missing: does not exist"),
        (["report", "{tmp}/file"], "LOGDIR {tmp}/file: not a directory"),
        (["report", "{tmp}/run", "--out", "{tmp}/file"], "--out {tmp}/file: exists and is not a directory"),
        (["compare", "{tmp}/run"], "give at least two RUN directories"),
        (["compare", "{tmp}/run", "{tmp}/missing"], "not a directory: {tmp}/missing"),
        (["repro", "--config", "{tmp}/missing.yaml"], "--config {tmp}/missing.yaml: not a file"),
        (["repro", "--config", "{tmp}/file", "--fraction", "2"], "--fraction must be in (0, 1]"),
    ],
)
def test_bad_input_exits_2_with_one_line_naming_it(tmp_path, capsys, argv, said):
    make_run(tmp_path / "run", alerts=[alert()])
    (tmp_path / "file").write_text("x")
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"lightning-diag {argv[0]}: ")
    assert said.format(tmp=tmp_path) in err
