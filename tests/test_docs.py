import re
from pathlib import Path

import lightning_diag.callbacks.anomaly_alarm as alarm_module
import lightning_diag.rules.anomaly as anomaly_rules

DOCS = Path(__file__).resolve().parents[1] / "docs"
MODULES = (anomaly_rules, alarm_module)


def _rows():
    for line in (DOCS / "thresholds.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[2].startswith("`DEFAULT_"):
            yield cells


def test_thresholds_table_matches_the_constants():
    rows = list(_rows())
    documented = {}
    for _rule, argument, constant, default, _meaning, _source in rows:
        name = constant.strip("`")
        value = next(getattr(m, name) for m in MODULES if hasattr(m, name))
        assert float(default) == float(value), name
        documented[name] = argument
    in_code = {n for m in MODULES for n in dir(m) if n.startswith("DEFAULT_")}
    assert in_code <= set(documented), f"undocumented constants: {in_code - set(documented)}"


def test_thresholds_arguments_are_real_constructor_arguments():
    import inspect

    from lightning_diag import AnomalyAlarm

    params = inspect.signature(AnomalyAlarm).parameters
    for _rule, argument, _constant, default, _m, _s in _rows():
        arg = argument.strip("`")
        if arg == "—":
            continue
        assert arg in params, arg
        assert float(params[arg].default) == float(default), arg


def test_anomaly_alarm_page_lists_every_tag_and_rule():
    page = (DOCS / "anomaly_alarm.md").read_text()
    for needle in (
        "diag/lr/",
        "diag/loss/train_step",
        "diag/loss/train_epoch",
        "diag/loss/train_window",
        "diag/loss/swing",
        "diag/loss/val",
        "diag/loss/val_fluctuation",
        "diag/loss/train_fluctuation",
        "nonfinite_loss",
        "nonfinite_grad",
        "loss_swing",
        "val_decline",
        "val_fluctuation",
    ):
        assert needle in page, needle
    for match in re.findall(r"`(\w+)=", page):
        assert match in __import__("inspect").signature(__import__("lightning_diag").AnomalyAlarm).parameters
