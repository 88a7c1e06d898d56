import numpy as np
import pytest

from lightning_diag.stats.timing import block_fluctuation, detect_period, growth, slow_mask


def _noisy(n, seed=0, jitter=0.3):
    rng = np.random.default_rng(seed)
    return 0.02 * (1 + jitter * rng.random(n))


@pytest.mark.parametrize("period", [7, 10, 25])
def test_a_periodic_stall_is_found_with_its_period(period):
    t = _noisy(200)
    t[3::period] += 0.05
    found = detect_period(t)
    assert found.period == period and found.phase == 3
    assert found.coverage == 1.0 and found.precision == 1.0 and found.share > 0.05


def test_random_slow_steps_are_not_periodic():
    for seed in range(20):
        rng = np.random.default_rng(seed)
        t = _noisy(200, seed)
        t[rng.choice(200, 20, replace=False)] += 0.05 * rng.random(20) + 0.02
        assert not detect_period(t).found, seed


def test_a_periodic_stall_among_random_spikes_is_still_found():
    rng = np.random.default_rng(1)
    t = _noisy(200)
    t[rng.choice(200, 8, replace=False)] += 0.04
    t[5::10] += 0.2
    assert detect_period(t).period == 10


def test_jitter_is_not_slow_on_a_noisy_machine():
    t = _noisy(200, jitter=1.0)  # uniform over 1x..2x the base: a badly shared CPU
    assert slow_mask(t, 0.5).sum() == 0


def test_block_fluctuation_against_brute_force():
    steady = np.tile([0.01, 0.03], 50)  # alternating steps: the blocks are identical
    assert block_fluctuation(steady, 10) == 0.0
    drifting = np.repeat([0.01, 0.02, 0.01, 0.02, 0.01, 0.02], 10)
    assert block_fluctuation(drifting, 10) == pytest.approx(0.01 / (np.sqrt(2) * 0.015))
    assert np.isnan(block_fluctuation([1.0] * 20, 10))
    rng = np.random.default_rng(0)
    medians = 1.0 + rng.random(9)
    blocks = np.repeat(medians, 10)
    brute = np.median(np.abs(np.diff(medians))) / (np.sqrt(2) * np.median(medians))
    assert block_fluctuation(blocks, 10) == pytest.approx(brute)


def test_block_fluctuation_ignores_level_shifts_and_slow_drift_but_not_ups_and_downs():
    shift = np.repeat([1.0] * 10 + [1.5] * 10, 10)  # one 50% step up (a batch-size ramp, layers unfrozen)
    assert block_fluctuation(shift, 10) == 0.0
    ramp = np.repeat(np.linspace(1.0, 2.0, 20), 10)  # the step time doubling slowly over the window
    assert block_fluctuation(ramp, 10) < 0.05
    bouncing = np.repeat([1.0, 1.5] * 10, 10)  # the same two levels, alternating block by block
    assert block_fluctuation(bouncing, 10) > 0.25


def test_block_fluctuation_of_independent_block_noise_is_on_the_relative_mad_scale():
    rng = np.random.default_rng(1)
    medians = 1.0 + 0.1 * rng.standard_normal(20_000)
    x = np.repeat(medians, 3)
    relative_mad = np.median(np.abs(medians - np.median(medians))) / np.median(medians)
    assert block_fluctuation(x, 3) == pytest.approx(relative_mad, rel=0.05)


def test_block_fluctuation_discounts_the_chance_difference_of_jittering_blocks():
    rng = np.random.default_rng(2)
    jitter = 1.0 + 0.15 * rng.standard_normal(400)  # i.i.d. steps spread by 15%: blocks differ by chance only
    raw, discounted = block_fluctuation(jitter, 10), block_fluctuation(jitter, 10, z=2.0)
    assert raw > 0.03  # the chance differences of 10-step medians, several percent of the level
    assert discounted < raw / 4
    # brute force: one pair's change beyond z standard errors of the difference of two medians
    grid = jitter.reshape(40, 10)
    med = np.median(grid, axis=1)
    se = 1.2533 * 1.4826 * np.median(np.abs(grid - med[:, None]), axis=1) / np.sqrt(10)
    beyond = np.maximum(0.0, np.abs(np.diff(med)) - 2.0 * np.hypot(se[1:], se[:-1]))
    assert discounted == pytest.approx(np.median(beyond) / (np.sqrt(2) * np.median(med)))
    # steps just as noisy inside blocks whose levels bounce by 50%: the bounce stands above the noise
    bouncing = np.repeat([1.0, 1.5] * 20, 10) * (1.0 + 0.15 * rng.standard_normal(400))
    assert block_fluctuation(bouncing, 10, z=2.0) > 0.15  # above the default threshold
    # steady blocks (no spread): z changes nothing
    exact = np.repeat([1.0, 1.5] * 5, 10)
    assert block_fluctuation(exact, 10, z=2.0) == block_fluctuation(exact, 10)


def test_growth_of_a_leak_and_of_a_cache_that_fills_once():
    rel, rising = growth(100 + 5 * np.arange(8.0))
    assert rel == pytest.approx(35 / 100) and rising == 1.0
    rel, rising = growth([100, 150, 150, 150, 150, 150, 150, 150])
    assert rising < 0.2
