"""`report` and `compare` on broken and hostile files (issue 36): a report with a `problems` line for each, never a
traceback, a hang or a silent loss."""

import json
import math
import os
import struct

import pytest

from lightning_diag.cli import main
from lightning_diag.report import load_fits, load_run
from tests.report.runs import LOSS, alert, cli, make_run, write_events


def _json_report(logdir, capsys) -> dict:
    assert main(["report", str(logdir), "--format", "json"]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    return run


def _md_report(logdir, capsys) -> str:
    assert main(["report", str(logdir)]) == 0
    return capsys.readouterr().out


def _alert_lines(run, *lines: bytes) -> None:
    (run / "diag" / "alerts.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))


GOOD = alert().to_json().encode()


def test_invalid_utf8_in_the_alert_log_is_read_with_replacement_and_said(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    _alert_lines(run, GOOD.replace(b"loss swings", b"loss \xff\xfe swings"), GOOD)
    rep = _json_report(run, capsys)
    assert [a["message"] for a in rep["alerts"]] == ["loss \ufffd\ufffd swings", "loss swings"]
    assert any("alerts.jsonl" in p and "not UTF-8" in p for p in rep["problems"])


def test_a_lone_surrogate_in_a_message_prints_in_every_format(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    _alert_lines(run, GOOD.replace(b"loss swings", b"loss \\ud800 swings"))
    for fmt in ("md", "html", "json"):
        assert main(["report", str(run), "--format", fmt]) == 0
        out = capsys.readouterr().out
        out.encode("utf-8")  # a lone surrogate would not encode
        assert "loss \ufffd swings" in (json.loads(out)["runs"][0]["alerts"][0]["message"] if fmt == "json" else out)


def test_numbers_too_large_for_a_float_are_no_crash(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    big = b"1" + b"0" * 400
    _alert_lines(
        run,
        GOOD.replace(b'"value": 0.2', b'"value": 1e400'),
        GOOD.replace(b'"threshold": 0.1', b'"threshold": ' + big),
        GOOD.replace(b'"global_step": 20', b'"global_step": ' + big),
    )
    rep = _json_report(run, capsys)
    assert [a["value"] for a in rep["alerts"]] == ["inf", 0.2]  # the 400-digit step cannot be a step
    assert any(
        "alerts.jsonl: 1 line(s) that are not alerts were skipped (first at line 3" in p for p in rep["problems"]
    )


def test_deeply_nested_brackets_are_skipped_with_a_note(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    _alert_lines(run, b"[" * 100_000 + b"]" * 100_000, GOOD)
    rep = _json_report(run, capsys)
    assert len(rep["alerts"]) == 1
    assert any("first at line 1: nested too deeply" in p for p in rep["problems"])


def test_unparseable_alert_lines_are_a_problem_in_json_and_md(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    _alert_lines(run, GOOD, b"{not json", b'{"rule": "x"}', GOOD)
    rep = _json_report(run, capsys)
    assert len(rep["alerts"]) == 2
    (problem,) = [p for p in rep["problems"] if "alerts.jsonl" in p]
    assert "2 line(s) that are not alerts were skipped (first at line 2" in problem
    out = _md_report(run, capsys)
    assert "### Problems" in out and "2 line(s) that are not alerts were skipped" in out


def test_a_torn_last_line_stays_silent(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    (run / "diag" / "alerts.jsonl").write_bytes(GOOD + b"\n" + GOOD[:30])
    rep = _json_report(run, capsys)
    assert len(rep["alerts"]) == 1 and rep["problems"] == []


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("loss_swing.patience", 0, "is not a whole number in 1 .. 1000000"),
        ("grad_collapse.baseline_measurements", 0, "is not a whole number in 1 .. 1000000"),
        ("grad.patience", 0, "is not a whole number in 1 .. 1000000"),
        ("grad.patience", 1e300, "is not a whole number in 1 .. 1000000"),
        ("val_decline", "NaN", "is not finite"),
        ("loss_swing", "Infinity", "is not finite"),
        ("grad_explode", "big", "is not a number"),
    ],
)
def test_bad_thresholds_fall_back_to_the_declared_default_with_a_note(tmp_path, capsys, key, value, why):
    from lightning_diag.core.registry import default

    run = make_run(tmp_path / "run", alerts=[alert()], thresholds={"AnomalyAlarm": {"loss_swing": 0.1}})
    text = json.dumps({"callbacks": {"GradientFlowMonitor": {key: 1.0}, "AnomalyAlarm": {"loss_swing": 0.1}}})
    raw = value if isinstance(value, str) and value in ("NaN", "Infinity") else json.dumps(value)
    (run / "diag" / "thresholds.json").write_text(text.replace(f'"{key}": 1.0', f'"{key}": {raw}'))
    write_events(run, {"diag/grad_blocks/norm": [1.0] * 8, "diag/grad_relative/l.0.w": [0.1] * 8}, suffix=".g")
    rep = _json_report(run, capsys)
    assert rep["thresholds"][key] == default(key)
    (note,) = [p for p in rep["problems"] if key in p]
    assert why in note and f"the default {default(key):g} is used" in note and "thresholds.json" in note


def test_a_run_folder_with_non_utf8_bytes_in_its_name(tmp_path, capsys):
    made = make_run(tmp_path / "made", alerts=[alert()])
    run = tmp_path / os.fsdecode(b"run-\xff\xfe")
    os.rename(made, run)
    out = _md_report(run, capsys)
    assert "run-\ufffd\ufffd" in out
    rep = _json_report(run, capsys)
    assert rep["run"].endswith("run-\ufffd\ufffd")


def test_a_fifo_in_place_of_a_file_is_refused_at_once(tmp_path):
    runs = [make_run(tmp_path / n, alerts=[alert()]) for n in ("a", "b")]
    os.mkfifo(runs[0] / "diag" / "run.json")
    os.unlink(runs[1] / "diag" / "alerts.jsonl")
    os.mkfifo(runs[1] / "diag" / "alerts.jsonl")
    done = cli("compare", str(runs[0]), str(runs[1]), "--format", "json", timeout=60)  # hung forever before
    assert done.returncode == 0, done.stderr
    problems = json.loads(done.stdout)["problems"]
    assert any("run.json" in p and "FIFO" in p for p in problems)
    assert any("alerts.jsonl" in p and "FIFO" in p for p in problems)
    done = cli("report", str(tmp_path), "--format", "json", timeout=60)
    assert done.returncode == 0 and b"FIFO" in done.stderr


def _flip_a_byte_in_record(path, index: int) -> None:
    """Flip one byte inside the payload of the ``index``-th record of a TFRecord file."""
    data = bytearray(path.read_bytes())
    pos = 0
    for _ in range(index):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        pos += 12 + length + 4
    data[pos + 12 + 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_an_event_file_loses_one_point_and_says_so(tmp_path, capsys):
    run = make_run(tmp_path / "run", alerts=[alert()])
    (events,) = [p for p in run.iterdir() if p.name.startswith("events.out")]
    _flip_a_byte_in_record(events, 3)  # record 0 is the file version; record 3 holds step 20
    loaded = load_run(run)
    assert [s for s, _ in loaded.scalars[LOSS]] == [0, 10, 30, 40, 50, 60, 70]  # the rest is still read
    assert any("1 damaged record(s)" in p for p in loaded.problems)
    assert "1 damaged record(s) (checksum mismatch) left out" in _md_report(run, capsys)


def test_two_fits_in_one_diag_folder_are_two_runs(tmp_path, capsys):
    run = tmp_path / "run"
    diag = run / "diag"
    write_events(diag, {LOSS: [1.0, 0.9, 0.8, 0.7]}, suffix=".1")
    write_events(diag, {LOSS: [2.0, 1.9, 1.8]}, suffix=".2")  # the second fit, from step 0 again
    first, second = load_fits(run)
    assert [s for s, _ in first.scalars[LOSS]] == [0, 10, 20, 30] and first.scalars[LOSS][0] == (0, 1.0)
    assert second.scalars[LOSS] == [(0, 2.0), (10, pytest.approx(1.9)), (20, pytest.approx(1.8))]
    assert (first.fit, second.fit) == ("fit 1 of 2", "fit 2 of 2")
    (problem,) = second.problems
    assert "2 fits were logged into this folder" in problem and "this is fit 2 of 2" in problem
    assert load_run(run).scalars == second.scalars  # load_run: the last fit, and it says so
    assert any("only the last of 2 fits" in p for p in load_run(run).problems)
    assert main(["report", str(run), "--format", "json"]) == 0
    reports = json.loads(capsys.readouterr().out)["runs"]
    assert [r["fit"] for r in reports] == ["fit 1 of 2", "fit 2 of 2"]
    assert reports[1]["problems"] == [problem]


def test_a_resume_keeps_the_points_before_its_first_step(tmp_path):
    diag = tmp_path / "run" / "diag"
    write_events(diag, {LOSS: [1.0, 0.9, 0.8, 0.7]}, suffix=".1")  # steps 0..30
    write_events(diag, {LOSS: [0.5, 0.4]}, suffix=".2", start=20)  # resumed from the checkpoint at step 20
    loaded = load_run(tmp_path / "run")
    assert [s for s, _ in loaded.scalars[LOSS]] == [0, 10, 20, 30]
    assert [v for _, v in loaded.scalars[LOSS]][2:] == [0.5, pytest.approx(0.4)]


def test_a_latest_link_is_followed_and_a_run_is_listed_once(tmp_path, capsys):
    store = tmp_path / "store"
    make_run(store / "version_3", alerts=[alert()])
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "latest").symlink_to(store / "version_3")
    assert main(["report", str(logs), "--format", "json"]) == 0  # exit 1, "no diagnostics", before
    (rep,) = json.loads(capsys.readouterr().out)["runs"]
    assert rep["run"] == str(logs / "latest")
    (store / "loop").symlink_to(store)  # a cycle, and version_3 reached twice
    (store / "alias").symlink_to(store / "version_3")
    assert main(["report", str(store), "--format", "json"]) == 0
    assert [r["run"] for r in json.loads(capsys.readouterr().out)["runs"]] == [str(store / "version_3")]


def test_compare_json_is_valid_json_without_nan(tmp_path, capsys):
    a = make_run(tmp_path / "a", alerts=[alert()])
    b = make_run(tmp_path / "b", alerts=[alert()])
    for run, lr in ((a, 0.1), (b, float("nan"))):
        (run / "diag" / "run.json").write_text(json.dumps({"hyperparameters": {"lr": lr, "w": float("inf")}}))
    assert main(["compare", str(a), str(b), "--format", "json"]) == 0
    out = capsys.readouterr().out

    def refuse(name):
        raise AssertionError(f"bare {name} in the JSON")

    data = json.loads(out, parse_constant=refuse)
    assert data["differences"]["hyperparameters.lr"] == [0.1, "nan"]
    assert not math.isnan(data["differences"]["hyperparameters.lr"][0])


def test_a_check_the_logged_values_break_is_one_row_not_the_report(tmp_path, capsys, monkeypatch):
    from lightning_diag.rules.rows import MEASURES

    def broken(run, check):
        raise ZeroDivisionError("hostile values")

    monkeypatch.setitem(MEASURES, "loss_swing", broken)
    rep = _json_report(make_run(tmp_path / "run", alerts=[alert()]), capsys)
    row = next(c for c in rep["checks"] if c["id"] == "loss_swing")
    assert row["status"] == "not measured" and "ZeroDivisionError: hostile values" in row["note"]
    assert any("check loss_swing could not be judged" in p for p in rep["problems"])
    assert sum(c["status"] != "not measured" for c in rep["checks"]) > 0  # the other rows are judged


def test_special_and_deeply_nested_files_in_the_diag_folder(tmp_path, capsys):
    run = make_run(tmp_path / "run", alerts=[alert()])
    (run / "diag" / "thresholds.json").write_text("[" * 100_000 + "]" * 100_000)
    os.mkfifo(run / "events.out.tfevents.0.fifo")
    rep = _json_report(run, capsys)
    assert any("thresholds.json: could not be read (nested too deeply)" in p for p in rep["problems"])
    assert any("events.out.tfevents.0.fifo: skipped: not a regular file (a FIFO)" in p for p in rep["problems"])
    assert rep["alerts"] and rep["threshold_source"].startswith("not logged")


def test_a_resume_whose_late_series_start_again_is_one_fit(tmp_path):
    diag = tmp_path / "run" / "diag"
    write_events(diag, {LOSS: [1.0] * 8, "diag/probe": [0.0] * 5 + [0.5, 0.4, 0.3]}, suffix=".1")
    # resumed from step 20: the probe, first measured at step 50, is measured at step 50 again
    write_events(diag, {LOSS: [0.5] * 6, "diag/probe": [0.0] * 3 + [0.2, 0.1]}, suffix=".2", start=20)
    (fit,) = load_fits(tmp_path / "run")
    assert fit.fit == "" and [s for s, _ in fit.scalars[LOSS]] == [0, 10, 20, 30, 40, 50, 60, 70]


def _alert_table(directory, count: int, suffix: str) -> None:
    """An event file holding the alert table the library writes at each alert (its head counts the fit's alerts)."""
    from tensorboard.compat.proto import types_pb2
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writer = EventFileWriter(str(directory), filename_suffix=suffix)
    text = TensorProto(dtype=types_pb2.DT_STRING, string_val=[f"**{count} alerts, newest first**\n\n|...|".encode()])
    value = Summary.Value(tag="diag/alerts/text_summary", tensor=text)
    writer.add_event(Event(step=30, summary=Summary(value=[value])))
    writer.close()


@pytest.mark.parametrize(("tables", "shares"), [((1, 2), [1, 2]), ((1, 1), [0, 3])])
def test_the_alert_log_is_shared_out_by_each_fits_alert_table(tmp_path, tables, shares):
    run = tmp_path / "run"
    diag = run / "diag"
    write_events(diag, {LOSS: [1.0, 0.9, 0.8, 0.7]}, suffix=".1")
    _alert_table(diag, tables[0], ".1b")
    write_events(diag, {LOSS: [2.0, 1.9, 1.8]}, suffix=".2")
    _alert_table(diag, tables[1], ".2b")
    make_run(run, alerts=[alert(step=10), alert(step=5), alert(step=20)], points=0)
    first, second = load_fits(run)
    assert [len(first.alerts), len(second.alerts)] == shares
    if shares == [1, 2]:
        assert [a.global_step for a in second.alerts] == [5, 20]
    else:  # the tables count 2 of the 3 alerts: they cannot be told apart, and that is said
        assert any("cannot be told apart" in p for p in second.problems)


def test_a_damaged_metrics_csv_is_read_as_far_as_it_goes(tmp_path, capsys):
    run = tmp_path / "csv" / "version_0"
    run.mkdir(parents=True)
    rows = ["epoch,step,train_loss,val_loss"] + [f"0,{s},{1.0 / (s + 1)}," for s in range(30)]
    rows += [
        "0,thirty,0.5,",
        "0,31,not-a-number,",
        "0,32,1e400,",
        "0,33,nan,",
        '0,34,"0.2',
        "0,35",
    ]  # a torn quote eats the rest
    (run / "metrics.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    rep = _json_report(tmp_path, capsys)
    assert rep["kind"] == "plain" and rep["mapping"]["train_loss"] == "train_loss"
    assert any("metrics.csv: 3 cell(s) or row(s) that are not numbers were skipped" in p for p in rep["problems"])
    nonfinite = next(c for c in rep["checks"] if c["id"] == "nonfinite")
    assert nonfinite["status"] == "fail" and "train_loss at step 32" in nonfinite["measured"]  # 1e400 is inf


def test_a_metrics_csv_without_a_step_column_is_not_a_run(tmp_path, capsys):
    (tmp_path / "metrics.csv").write_text("epoch,loss\n0,1.0\n", encoding="utf-8")
    assert main(["report", str(tmp_path)]) == 1
    assert "no logged loss" in capsys.readouterr().err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_fifo_in_place_of_metrics_csv_is_refused_at_once(tmp_path):
    os.mkfifo(tmp_path / "metrics.csv")
    write_events(tmp_path, {"train_loss": [1.0, 0.9, 0.8]})
    done = cli("report", str(tmp_path), "--format", "json", timeout=60)
    assert done.returncode == 0 and b"FIFO" in done.stderr
