"""The scalars of one step reach a ``SummaryWriter`` as one event whose summary is, byte for byte, the one a list of
``add_scalar`` values would make, in the order written; another step, any other write or a flush sends it."""

from pathlib import Path

import numpy as np
import torch
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
from tensorboard.compat.proto.summary_pb2 import Summary
from torch.utils.tensorboard import SummaryWriter

from lightning_diag.output.writer import DiagWriter


def events(log_dir):
    paths = sorted(Path(log_dir).glob("events.out.tfevents.*"))
    return [e for path in paths for e in LegacyEventFileLoader(str(path)).Load() if e.HasField("summary")]


def expected_summary(values):
    """What ``add_scalar`` writes for each value, gathered in one summary."""
    return Summary(value=[Summary.Value(tag=k, simple_value=float(v)) for k, v in values]).SerializeToString()


def test_each_steps_scalars_are_one_event_with_add_scalars_values(tmp_path):
    experiment = SummaryWriter(str(tmp_path))
    writer = DiagWriter(experiment)
    first = {"diag/grad_norm/total": 1.5, "diag/grad_norm/net.0": torch.tensor(0.25)}
    second = {"diag/update_ratio/net.0": np.float32(1e-3), "diag/threshold/grad_vanish": 1e-7}
    writer.scalars(first, 3)
    writer.scalars(second, 3)  # the same step: joins the pending event
    writer.scalars({"diag/loss/train_step": float("nan")}, 4)  # another step: step 3's event goes
    writer.text("diag/alerts", "table", 4)  # any other write sends step 4's
    writer.scalars({"diag/loss/train_step": -2.0}, 5)
    writer.scalars({}, 6)  # nothing to write: step 5's stays pending
    writer.flush()
    written = [(e.step, e.summary.SerializeToString()) for e in events(tmp_path) if e.summary.value[0].HasField(
        "simple_value")]
    assert written == [
        (3, expected_summary([*first.items(), *second.items()])),
        (4, expected_summary([("diag/loss/train_step", float("nan"))])),
        (5, expected_summary([("diag/loss/train_step", -2.0)])),
    ]
    writer.close()
    experiment.close()


def test_nothing_pending_writes_no_event(tmp_path):
    experiment = SummaryWriter(str(tmp_path))
    writer = DiagWriter(experiment)
    writer.flush()
    writer.text("diag/alerts", "table", 0)
    writer.flush()
    assert [e.summary.value[0].tag for e in events(tmp_path)] == ["diag/alerts/text_summary"]
    experiment.close()
