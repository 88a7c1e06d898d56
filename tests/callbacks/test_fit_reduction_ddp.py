"""Issue 43: what the alarms reduce over the ranks during the fit (a period's loss sums at an epoch's end, a step
window's close and a validation's end; warn mode's findings at an epoch's end) is reduced by the driver, one
collective per reduction kind at each point for every callback together. Under 2 gloo ranks the values logged and
the alerts are those of each alarm reducing its own (the code of before), with fewer collectives."""

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests import launch

SCRIPT = Path(__file__).with_name("ddp_fit_reduce_script.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("fit_reduce")
    proc = launch.run([sys.executable, str(SCRIPT), str(root)], timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((root / f"fit_reduce{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_the_driver_reduces_the_fit_with_the_same_values_and_alerts(ranks):
    for rank in ranks:  # what is logged and alerted: rank zero's; the other logs and alerts nothing either way
        driven, own = rank["driven"], rank["own"]
        assert driven["values"] == own["values"]  # every diag/ value logged, bit for bit (repr of the floats)
        assert driven["alerts"] == own["alerts"]
    driven = ranks[0]["driven"]
    rules = [(by, alert["rule"], alert["global_step"]) for by, alert in driven["alerts"]]
    assert sorted(rules) == [("epoch", "nonfinite_loss", 6), ("window", "nonfinite_loss", 6)]
    logged = {key for _step, key, _value in driven["values"]}
    assert {"diag/loss/train_window", "diag/loss/train_epoch", "diag/loss/swing", "diag/loss/val"} <= logged


@pytest.mark.slow
def test_the_driver_runs_fewer_collectives(ranks):
    for rank in ranks:
        driven, own = Counter(map(tuple, rank["driven"]["calls"])), Counter(map(tuple, rank["own"]["calls"]))
        saved = own - driven
        assert not driven - own  # no collective the alarms did not run before
        # at each of the 3 epochs' ends one SUM for both alarms' epoch sums (and the first alarm's initial period
        # at the first: 4 fewer) and, at the first two, one MIN for both alarms' findings (2 fewer); at each of the
        # 3 validations' ends one SUM for both alarms' sums since the last (3 fewer); at the step window's first
        # close one SUM for its sums and the initial period's (1 fewer)
        assert saved == Counter({("reduce", "sum", "torch.float64"): 8, ("reduce", "min", "torch.float64"): 2})
    assert ranks[0]["driven"]["calls"] == ranks[1]["driven"]["calls"]  # every rank ran the same collectives


@pytest.fixture(scope="module")
def two_windows(tmp_path_factory):
    root = tmp_path_factory.mktemp("fit_reduce_windows")
    proc = launch.run([sys.executable, str(SCRIPT), str(root), "windows"], timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((root / f"fit_reduce{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_two_step_windows_closing_at_one_batch_end_keep_their_values(two_windows):
    """The first alarm's window closes before the second alarm's batch end has added the batch's loss: the second's
    window is not reduced then (it would lose that loss), but at its own close, as before."""
    for rank in two_windows:
        driven, own = rank["driven"], rank["own"]
        assert driven["values"] == own["values"]
        assert driven["alerts"] == own["alerts"]
        assert not Counter(map(tuple, driven["calls"])) - Counter(map(tuple, own["calls"]))
    logged = {key for _step, key, _value in two_windows[0]["driven"]["values"]}
    assert {"diag/loss/train_window", "diag/loss/swing"} <= logged
    assert two_windows[0]["driven"]["calls"] == two_windows[1]["driven"]["calls"]
