import json
import re
from pathlib import Path
from unittest.mock import MagicMock

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from torch.utils.tensorboard import SummaryWriter

from lightning_diag import AnomalyAlarm, GradientFlowMonitor
from lightning_diag.callbacks.common.base import DiagCallback
from lightning_diag.callbacks.common.session import DiagSession
from lightning_diag.core.alerts import Alert, Severity
from lightning_diag.demo.run import run_demo
from lightning_diag.output.dashboard import dashboard_layout
from lightning_diag.output.writer import DiagWriter


def _accumulator(log_dir: str) -> EventAccumulator:
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _layout(acc: EventAccumulator) -> layout_pb2.Layout:
    (event,) = acc.Tensors("custom_scalars__config__")
    return layout_pb2.Layout.FromString(event.tensor_proto.string_val[0])


def test_layout_is_in_the_event_file_once(nan_run):
    acc = _accumulator(nan_run.log_dir)
    layout = _layout(acc)
    charts = {c.title: {ch.title: ch for ch in c.chart} for c in layout.category}
    assert list(charts) == ["Gradients", "Attention", "Loss & LR"]  # the three default callbacks
    # Each gradient threshold is drawn beside the quantity its rule judges (issue 11), not beside raw norms.
    rms = charts["Gradients"]["RMS gradient per element, per layer (line: grad_explode)"].multiline.tag
    relative = charts["Gradients"]["relative gradient ||g|| / ||W|| per weight matrix (line: grad_vanish)"]
    assert list(rms) == ["diag/grad_rms/", "diag/threshold/grad_explode$"]
    assert list(relative.multiline.tag) == ["diag/grad_relative/", "diag/threshold/grad_vanish$"]
    # Every multiline regex matches at least one tag the run wrote, as TensorBoard matches them (re.match).
    scalars = acc.Tags()["scalars"]
    for category in layout.category:
        for chart in category.chart:
            for regex in chart.multiline.tag:
                if "fluctuation" in regex:
                    continue  # needs 5 validation runs; the nan demo stops after 2
                if "swing" in regex:
                    continue  # needs two epoch points; the nan demo stops at 30, in its second epoch
                if "replicas" in regex or "ddp_desync" in regex:
                    continue  # written under DDP only (tests/callbacks/test_silent_ddp.py)
                assert any(re.match(regex, t) for t in scalars), (chart.title, regex)


def test_margin_band_has_the_steps_of_the_global_norm(nan_run):
    # TensorBoard's margin chart refuses series whose steps differ.
    acc = _accumulator(nan_run.log_dir)
    steps = [e.step for e in acc.Scalars("diag/grad_norm/total")]
    assert steps and [e.step for e in acc.Scalars("diag/threshold/grad_vanish")] == steps
    assert [e.value for e in acc.Scalars("diag/threshold/grad_explode")] == [10.0] * len(steps)


def test_swing_threshold_line_has_the_steps_of_the_swing(tmp_path):
    # the nan demo stops before two epoch points: a run of 8-step epochs, every epoch a point
    import pytorch_lightning as pl

    from tests.callbacks.tiny import FAST, TinyAttention

    alarm = AnomalyAlarm()
    trainer = pl.Trainer(max_epochs=3, default_root_dir=tmp_path, callbacks=[alarm], **FAST)
    trainer.fit(TinyAttention())
    acc = _accumulator(trainer.log_dir)
    swing_steps = [e.step for e in acc.Scalars("diag/loss/swing")]
    assert len(swing_steps) == 2  # epochs 2 and 3 against the one before
    assert [e.step for e in acc.Scalars("diag/threshold/loss_swing")] == swing_steps


def test_thresholds_in_effect_are_logged(nan_run):
    logged = json.loads((Path(nan_run.log_dir) / "diag" / "thresholds.json").read_text())
    assert logged["callbacks"]["GradientFlowMonitor"] == GradientFlowMonitor().thresholds()
    assert logged["callbacks"]["AnomalyAlarm"] == AnomalyAlarm().thresholds()
    assert logged["thresholds"]["grad_explode"] == 10.0 and logged["thresholds"]["loss_swing"] == 0.1
    acc = _accumulator(nan_run.log_dir)
    (event,) = acc.Tensors("diag/thresholds/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert "| GradientFlowMonitor | grad_vanish | 0.001 |" in text
    assert "| AnomalyAlarm | val_decline | 5 |" in text


def test_alert_text_is_in_the_event_file(nan_run):
    acc = _accumulator(nan_run.log_dir)
    (event,) = acc.Tensors("diag/alerts/text_summary")
    assert event.step == 30
    text = event.tensor_proto.string_val[0].decode()
    assert "1 alert, newest first" in text and "| 30 | 1 | critical | nonfinite_loss | loss |" in text


def _alert(rule: str, step: int) -> Alert:
    return Alert(rule, Severity.WARNING, f"{rule} fired", 0, step, 1.0, 0.5, "layer")


def test_alert_table_holds_every_alert_newest_first(tmp_path):
    writer = MagicMock(spec=SummaryWriter)
    session = DiagSession(str(tmp_path), MagicMock(), is_global_zero=True)
    session._writer = DiagWriter(writer)
    session.alert_log.write([_alert("grad_vanish", 5), _alert("loss_swing", 9)])
    session.alert_log.write(_alert("val_decline", 20))
    assert [c.kwargs["global_step"] for c in writer.add_text.call_args_list] == [5, 9, 20]
    tag, table = writer.add_text.call_args.args
    assert tag == "diag/alerts"
    rows = [line for line in table.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [r.split("|")[4].strip() for r in rows] == ["val_decline", "loss_swing", "grad_vanish"]
    assert table.startswith("**3 alerts, newest first**")
    session.close()


def test_layout_sections_follow_the_rules_in_effect():
    assert dashboard_layout([]) == {}
    layout = dashboard_layout(["attn_entropy_low", "attn_entropy_high", "attn_sink"])
    assert list(layout) == ["Attention"]
    (mean_chart, head_chart, sink_chart) = layout["Attention"].values()
    mean_regex, band_regex = mean_chart[1]
    assert re.match(mean_regex, "diag/attn_entropy/encoder.layers.0.self_attn/mean")
    assert not re.match(mean_regex, "diag/attn_entropy/encoder.layers.0.self_attn/head_1")
    assert re.match(band_regex, "diag/threshold/attn_entropy_low")
    assert re.match(head_chart[1][0], "diag/attn_entropy/encoder.layers.0.self_attn/head_11")
    assert re.match(sink_chart[1][0], "diag/attn_sink/encoder.layers.0.self_attn")
    per_layer = dashboard_layout(["grad_vanish"])["Gradients"][
        "gradient L2 norm per layer"
    ]
    assert re.match(per_layer[1][0], "diag/grad_norm/encoder.layers.0") and not re.match(
        per_layer[1][0], "diag/grad_norm/total"
    )


class _AttentionLike(DiagCallback):
    """Stands for a callback that is not on this branch: its thresholds reach the file and the layout."""

    def thresholds(self) -> dict[str, float]:
        return {"attn_entropy_low": 0.5, "attn_entropy_high": 2.5, "attn_sink": 0.5}


def test_any_callback_thresholds_reach_file_and_layout(tmp_path):
    result = run_demo(
        "none",
        max_epochs=1,
        root=str(tmp_path),
        callbacks=[AnomalyAlarm(), _AttentionLike()],
        limit_train_batches=3,
        log_every_n_steps=1,
        limit_val_batches=1,
    )
    logged = json.loads((Path(result.log_dir) / "diag" / "thresholds.json").read_text())
    assert logged["callbacks"]["_AttentionLike"] == {
        "attn_entropy_low": 0.5,
        "attn_entropy_high": 2.5,
        "attn_sink": 0.5,
    }
    titles = [c.title for c in _layout(_accumulator(result.log_dir)).category]
    assert titles == ["Attention", "Loss & LR"]
