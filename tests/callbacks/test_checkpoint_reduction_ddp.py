"""The declared state of every callback of a trainer is reduced over the ranks once per checkpoint, by the driver
(issue 43): one collective per reduction kind for all callbacks together, the same entries as the per-callback
logic it replaced, during a fit and after it, and a fit resumes from them."""

import json
import sys
from pathlib import Path

import pytest
import torch

from lightning_diag.callbacks.anomaly_alarm.nonfinite_guard import DeferredFindings
from lightning_diag.stats.loss_sums import LossSums
from tests import launch

SCRIPT = Path(__file__).with_name("ddp_reduce_script.py")


def reduced_parts(saved):
    """The reduced values of each alarm's entry: the declared sums and first bad steps, and the pending losses."""
    sums, steps = LossSums(1).specs, DeferredFindings().specs
    out = {}
    for key, entry in json.loads(saved).items():
        if key.startswith("AnomalyAlarm"):
            out[key] = (
                {name: entry["accumulators"][name] for name in sums},
                {name: entry["pending_nonfinite"][name] for name in steps},
                entry["runtime_pending"]["losses"],
            )
    assert len(out) == 2
    return out


def dumps(value):
    return json.dumps(value, sort_keys=True, default=repr)  # as the script writes them: NaN and tuples compared


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("reduce")
    proc = launch.run([sys.executable, str(SCRIPT), str(root)], timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((root / f"reduce{r}.json").read_text()) for r in (0, 1)]
    return root, ranks


@pytest.mark.slow
def test_saved_entries_equal_the_per_callback_logic_on_every_rank(run):
    _root, ranks = run
    for rank in ranks:
        # two checkpoints during the fit (steps 6 and 12) and one after its teardown (`trainer.save_checkpoint`)
        assert [record["step"] for record in rank["records"]] == [6, 12, 12]
        for record in rank["records"]:
            assert record["saved"] == record["expected"]
            assert record["saved"] != record["local"]  # the ranks' own sums were replaced by the ones over both
    # what was reduced is the same on both ranks (the rest of an entry is each rank's own, saved from rank zero)
    reduced = [[reduced_parts(record["saved"]) for record in rank["records"]] for rank in ranks]
    assert reduced[0] == reduced[1]
    assert ranks[0]["records"][0]["local"] != ranks[1]["records"][0]["local"]  # the ranks saw different batches


@pytest.mark.slow
def test_one_collective_per_reduction_kind_for_all_callbacks(run):
    _root, ranks = run
    for rank in ranks:
        for record in rank["records"]:
            # both alarms' SUM-declared sums in one reduce, their MIN-declared steps in another; each alarm's pending
            # losses (a float32 mean, when it holds some) in one of its own
            means = [["reduce", "mean"]] * sum(record["pending"])
            assert record["calls"] == [["reduce", "sum"], ["reduce", "min"], *means]
            # before: one reduce per kind per alarm
            legacy = record["legacy_calls"]
            assert legacy.count(["reduce", "sum"]) == legacy.count(["reduce", "min"]) == 2
            assert len(legacy) == 4 + len(means)


@pytest.mark.slow
def test_written_checkpoints_hold_the_saved_entries_and_a_fit_resumes_from_them(run):
    root, ranks = run
    records = ranks[0]["records"]
    files = [root / "ckpt" / "epoch=0-step=6.ckpt", root / "ckpt" / "epoch=0-step=12.ckpt", root / "after.ckpt"]
    saved = [torch.load(path, weights_only=False)["callbacks"] for path in files]
    assert [dumps(entry) for entry in saved] == [record["saved"] for record in records]
    assert all(ranks[r]["resumed_step"] == 16 for r in (0, 1))
    # each rank resumed a share of the sums over both ranks: together, the saved sums
    alarm = next(key for key in saved[0] if "'swing_window': 'epoch'" in key)
    restored = [json.loads(ranks[r]["restored"])["accumulators"] for r in (0, 1)]
    for key in ("epoch_sum", "epoch_count", "initial_sum"):
        assert restored[0][key] + restored[1][key] == pytest.approx(saved[0][alarm]["accumulators"][key], rel=1e-12)
