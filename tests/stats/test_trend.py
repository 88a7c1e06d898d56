import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_diag.stats import all_finite, fluctuation, max_abs, relative_change, total_norm


@pytest.mark.parametrize(
    ("prev", "cur", "expected"),
    [(1.0, 1.1, 0.1), (2.0, 1.0, -0.5), (-2.0, -1.0, 0.5), (0.0, 1.0, math.nan), (math.nan, 1.0, math.nan)],
)
def test_relative_change(prev, cur, expected):
    got = relative_change(prev, cur)
    assert (math.isnan(got) and math.isnan(expected)) or got == pytest.approx(expected)


def _reference_fluctuation(y):
    y = np.asarray(y, dtype=float)
    x = np.arange(len(y))
    t = np.log(y) if np.all(y > 0) else y
    deg = 1 if len(y) < 5 else 2
    # brute force least squares through the normal equations
    a = np.vander(x, deg + 1)
    coef = np.linalg.lstsq(a, t, rcond=None)[0]
    rms = math.sqrt(np.mean((t - a @ coef) ** 2))
    return rms if np.all(y > 0) else rms / np.mean(np.abs(y))


@settings(deadline=None)  # correctness, not timing: no 200 ms deadline on a shared machine
@given(st.lists(st.floats(0.01, 100.0), min_size=3, max_size=12))
def test_fluctuation_matches_reference(values):
    if all(v == values[0] for v in values):
        assert fluctuation(values) == 0.0
    else:
        assert fluctuation(values) == pytest.approx(_reference_fluctuation(values), abs=1e-7)


def test_fluctuation_smooth_vs_zigzag():
    assert fluctuation([2.0 * 0.8**k for k in range(6)]) < 1e-9  # a steady 20% fall is all trend
    assert fluctuation([1.0, 1.5, 1.0, 1.5, 1.0, 1.5]) > 0.1
    assert math.isnan(fluctuation([1.0, 2.0]))
    assert math.isnan(fluctuation([1.0, math.inf, 2.0]))
    assert fluctuation([3.0, 3.0, 3.0]) == 0.0


@settings(deadline=None)  # correctness, not timing: no 200 ms deadline on a shared machine
@given(st.lists(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=5), min_size=1, max_size=4))
def test_total_norm_matches_numpy(chunks):
    tensors = [torch.tensor(c, dtype=torch.float64) for c in chunks]
    flat = np.concatenate([np.asarray(c) for c in chunks])
    assert float(total_norm(tensors)) == pytest.approx(float(np.linalg.norm(flat)), rel=1e-9, abs=1e-12)
    assert float(max_abs(tensors)) == pytest.approx(float(np.max(np.abs(flat))))


def test_all_finite():
    assert bool(all_finite([torch.ones(3), torch.tensor([1e30])]))  # huge but finite is finite
    assert not bool(all_finite([torch.ones(3), torch.tensor([math.inf])]))
    assert not bool(all_finite([torch.tensor([math.nan])]))
    assert bool(all_finite([]))
