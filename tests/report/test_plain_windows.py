"""How a plain run's per-step losses become the points ``loss_swing`` judges when no epoch mean was logged:
windows long enough that one batch's noise cannot make a swing (no real fit: the series are written directly)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from lightning_diag.report.load import RunData
from lightning_diag.report.plain import WINDOW_POINTS, diagnose_plain, map_plain_run, step_noise


def _run(train: list[float], every: int = 10) -> RunData:
    steps = [every * i + every - 1 for i in range(len(train))]
    run = RunData(Path("run"))
    run.user = {"train_loss": list(zip(steps, train, strict=True)), "epoch": [(s, float(s // 480)) for s in steps]}
    assert map_plain_run(run)
    return run


def _noisy(points: int, noise: float, seed: int) -> list[float]:
    """A healthy loss: it decays to a floor, each logged value one batch's loss (lognormal noise)."""
    rng = random.Random(seed)
    return [(0.3 + 1.1 * math.exp(-i / 40)) * rng.lognormvariate(0, noise) for i in range(points)]


@pytest.mark.parametrize("seed", range(5))
def test_noisy_batch_losses_do_not_swing(seed):
    rep = diagnose_plain(_run(_noisy(600, 0.3, seed)))
    row = next(c for c in rep.checks if c.id == "loss_swing")
    assert row.status == "pass", row.note
    assert "judged on means of" in row.note and int(row.note.split("means of ")[1].split()[0]) > WINDOW_POINTS


def test_a_loss_that_swings_between_windows_still_fails():
    # every 8 logged steps (one window) the loss jumps between two levels 60% apart; within a level it is quiet
    rng = random.Random(0)
    train = [(1.0 if (i // WINDOW_POINTS) % 2 else 1.6) * rng.lognormvariate(0, 0.03) for i in range(600)]
    rep = diagnose_plain(_run(train))
    assert next(c for c in rep.checks if c.id == "loss_swing").status == "fail"
    assert "loss_swing" in {a.rule for a in rep.run.alerts}


def test_step_noise_is_that_of_one_value():
    rng = random.Random(1)
    values = [rng.lognormvariate(0, 0.2) for _ in range(4000)]
    assert step_noise(values) == pytest.approx(0.2, rel=0.15)
    assert math.isnan(step_noise([1.0, 2.0]))


def _stagnant_row(train: list[float], every: int):
    rep = diagnose_plain(_run(train, every))
    return next(c for c in rep.checks if c.id == "loss_stagnant"), {a.rule for a in rep.run.alerts}


def test_the_initial_loss_is_the_mean_of_the_first_logged_steps_handed_with_the_loss_points():
    # logged at steps 0, 1, 2, ...: the first 5 steps (loss_stagnant.baseline_steps) average 2.0, then a flat 1.9
    rng = random.Random(2)
    train = [2.0] * 5 + [1.9 * rng.lognormvariate(0, 0.01) for _ in range(195)]
    row, rules = _stagnant_row(train, every=1)
    assert row.status == "fail" and "loss_stagnant" in rules
    assert row.measured is not None and "below the initial 2" in row.measured
    # the same loss falling to a tenth of its initial level learned: no alert, measured against the same baseline
    falling = [2.0] * 5 + [2.0 * math.exp(-i / 30) for i in range(195)]
    row, rules = _stagnant_row(falling, every=1)
    assert row.status == "pass" and "loss_stagnant" not in rules and "below the initial 2" in row.measured


def test_without_loss_points_or_the_first_steps_loss_stagnant_says_which_is_missing():
    row, _ = _stagnant_row([1.0, 0.9, 0.8, 0.7, 0.6], every=1)  # an initial loss, no full window of points
    assert row.measured is None and "needs 4 points" in row.note
    row, _ = _stagnant_row([1.0] * 100, every=10)  # first logged at step 9: past the first 5 steps
    assert row.measured is None and "needs the training loss of the first 5 steps" in row.note
