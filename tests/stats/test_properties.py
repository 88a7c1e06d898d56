"""Property tests of ``stats/`` against numpy/scipy references, over empty, constant, huge and non-finite inputs."""

import math

import numpy as np
import pytest
import scipy.stats
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from lightning_diag.stats import all_finite, fluctuation, max_abs, relative_change, total_norm
from lightning_diag.stats.attention_probs import row_entropy
from lightning_diag.stats.grad import grouped_norms, per_tensor_norms
from lightning_diag.stats.norms import SUM_MIN_ELEMENTS, finite_probe, nonfinite_flag

FAST = settings(max_examples=60, deadline=None)
ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True, width=64)
HUGE = st.floats(min_value=1e300, max_value=1.7e308) | st.floats(min_value=-1.7e308, max_value=-1e300)
VALUES = st.one_of(st.floats(-1e6, 1e6), HUGE, st.sampled_from([math.nan, math.inf, -math.inf, 0.0]))


def chunks(elements=VALUES, min_size=0):
    return st.lists(st.lists(elements, min_size=0, max_size=5), min_size=min_size, max_size=4)


def same(got, want, rel=1e-9):
    """Equal as floats, with NaN equal to NaN and infinities exact."""
    if math.isnan(want):
        return math.isnan(got)
    if math.isinf(want):
        return got == want
    return got == pytest.approx(want, rel=rel, abs=1e-12)


# -- norms and the non-finite check -------------------------------------------------------------------------------
@FAST
@given(chunks())
def test_all_finite_matches_numpy_including_huge_values(parts):
    tensors = [torch.tensor(p, dtype=torch.float64) for p in parts]
    flat = np.array([v for p in parts for v in p], dtype=np.float64)
    assert bool(all_finite(tensors)) == bool(np.all(np.isfinite(flat)))  # empty: True, huge but finite: True


_DTYPES = st.sampled_from([torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64])


@FAST
@given(st.lists(st.tuples(st.lists(VALUES, max_size=5), _DTYPES), max_size=5))
def test_nonfinite_flag_and_probe_match_numpy_and_leave_the_values_unchanged(parts):
    tensors = [torch.tensor(values, dtype=torch.float64).to(dtype) for values, dtype in parts]
    # what is in the tensors after the cast (1e300 is Inf in float32; float16 overflows past 65504)
    flat = np.concatenate([t.to(torch.complex128).numpy().ravel() for t in tensors] + [np.zeros(0)])
    before = [t.clone() for t in tensors]
    want = 0.0 if np.all(np.isfinite(flat)) else 1.0
    assert nonfinite_flag(tensors).tolist() == [want]
    assert finite_probe(tensors).tolist() == [want]  # on CPU the probe is the exact check
    for t, b in zip(tensors, before, strict=True):  # the CPU check writes every value back as it was
        assert t.dtype == b.dtype and bool(((t == b) | (torch.isnan(t) & torch.isnan(b))).all())


def test_nonfinite_flag_ors_into_a_given_flag():
    found = torch.zeros(1)
    nonfinite_flag([torch.ones(2)], found)
    assert found.tolist() == [0.0]
    nonfinite_flag([torch.tensor([math.nan])], found)
    nonfinite_flag([torch.ones(2)], found)  # a clean call does not clear what an earlier one found
    assert found.tolist() == [1.0]
    assert nonfinite_flag([]).tolist() == [0.0]


def test_nonfinite_flag_takes_tensors_the_fused_kernel_refuses():
    """A sparse gradient and one that shares memory between elements (an expanded tensor) are tested one by one."""
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, math.inf], (4,), check_invariants=True)
    expanded = torch.tensor([2.0]).expand(3)
    assert nonfinite_flag([torch.ones(2), sparse]).tolist() == [1.0]
    assert nonfinite_flag([torch.ones(2), expanded]).tolist() == [0.0]
    assert nonfinite_flag([torch.tensor([math.nan]).expand(2), torch.ones(1)]).tolist() == [1.0]


@FAST
@given(chunks())
def test_max_abs_matches_numpy(parts):
    tensors = [torch.tensor(p, dtype=torch.float64) for p in parts]
    flat = np.array([v for p in parts for v in p], dtype=np.float64)
    want = 0.0 if flat.size == 0 else (math.nan if np.isnan(flat).any() else float(np.max(np.abs(flat))))
    assert same(float(max_abs(tensors)), want)


@FAST
@given(chunks(st.floats(-1e6, 1e6) | st.sampled_from([math.nan, math.inf, 0.0])))
def test_total_norm_matches_numpy(parts):
    tensors = [torch.tensor(p, dtype=torch.float64) for p in parts]
    flat = np.array([v for p in parts for v in p], dtype=np.float64)
    want = float(np.linalg.norm(flat)) if flat.size else 0.0
    assert same(float(total_norm(tensors)), want)


@FAST
@given(chunks(min_size=1))
def test_per_tensor_norms_match_numpy(parts):
    tensors = [torch.tensor(p, dtype=torch.float64) for p in parts]
    got = per_tensor_norms(tensors).tolist()
    for g, p in zip(got, parts, strict=True):
        ref = float(np.linalg.norm(np.asarray(p, dtype=np.float64))) if p else 0.0
        # the result is float32: a finite float64 norm beyond its range becomes inf
        assert same(g, float(np.float32(ref)) if math.isfinite(ref) else ref, rel=1e-6)


@FAST
@given(st.lists(st.tuples(st.floats(0.0, 1e3), st.integers(0, 3)), min_size=1, max_size=12))
def test_grouped_norms_match_numpy(rows):
    norms = torch.tensor([n for n, _ in rows], dtype=torch.float32)
    groups = torch.tensor([g for _, g in rows])
    got = grouped_norms(norms, groups, 4).tolist()
    for group in range(4):
        members = np.array([np.float32(n) for n, g in rows if g == group], dtype=np.float64)
        assert got[group] == pytest.approx(float(np.sqrt(np.sum(members**2))), rel=1e-5, abs=1e-6)


def test_constant_inputs():
    assert float(total_norm([torch.full((9,), 2.0)])) == pytest.approx(6.0)
    assert float(max_abs([torch.full((4,), -3.0)])) == 3.0
    assert per_tensor_norms([torch.zeros(0), torch.zeros(3)]).tolist() == [0.0, 0.0]


# -- entropy ------------------------------------------------------------------------------------------------------
@FAST
@given(arrays(np.float64, st.integers(1, 12), elements=st.floats(0.0, 1e6) | st.just(0.0)))
def test_row_entropy_matches_scipy(weights):
    assume(weights.sum() > 0)
    probs = weights / weights.sum()
    got = float(row_entropy(torch.tensor(probs)))
    assert got == pytest.approx(float(scipy.stats.entropy(probs)), abs=1e-9)
    assert -1e-12 <= got <= math.log(len(probs)) + 1e-9


@pytest.mark.parametrize("n", [1, 2, 7, 4096])
def test_row_entropy_constant_rows(n):
    assert float(row_entropy(torch.full((n,), 1.0 / n, dtype=torch.float64))) == pytest.approx(math.log(n))
    one_hot = torch.zeros(n, dtype=torch.float64)
    one_hot[0] = 1.0
    assert float(row_entropy(one_hot)) == 0.0


def test_row_entropy_empty_and_non_finite():
    assert row_entropy(torch.zeros(3, 0)).tolist() == [0.0, 0.0, 0.0]  # no keys: no uncertainty
    assert math.isnan(float(row_entropy(torch.tensor([0.5, math.nan]))))


# -- trend measures -----------------------------------------------------------------------------------------------
@FAST
@given(ANY_FLOAT, ANY_FLOAT)
def test_relative_change_matches_its_formula(previous, current):
    got = relative_change(previous, current)
    if not (math.isfinite(previous) and math.isfinite(current)) or previous == 0:
        assert math.isnan(got)
    else:
        with np.errstate(over="ignore"):
            want = float((np.float64(current) - np.float64(previous)) / abs(np.float64(previous)))
        assert same(got, want)


def _reference_fluctuation(y):
    y = np.asarray(y, dtype=np.float64)
    x = np.arange(y.size, dtype=np.float64)
    positive = bool(np.all(y > 0))
    target = np.log(y) if positive else y
    a = np.vander(x, 2 if y.size < 5 else 3)
    coef = np.linalg.lstsq(a, target, rcond=None)[0]
    rms = math.sqrt(np.mean((target - a @ coef) ** 2))
    return rms if positive else rms / float(np.mean(np.abs(y)))


@FAST
@given(st.lists(st.floats(1e-300, 1e300), min_size=3, max_size=10))
def test_fluctuation_of_positive_series_over_the_whole_range(values):
    assume(len(set(values)) > 1)
    assert fluctuation(values) == pytest.approx(_reference_fluctuation(values), rel=1e-6, abs=1e-6)


@FAST
@given(st.lists(st.floats(-1e3, 1e3), min_size=3, max_size=10), st.floats(1e-3, 1e3))
def test_fluctuation_of_any_sign_and_its_scale_invariance(values, scale):
    assume(len(set(values)) > 1 and np.mean(np.abs(values)) > 1e-3)
    got = fluctuation(values)
    assert got == pytest.approx(_reference_fluctuation(values), rel=1e-6, abs=1e-9)
    assert fluctuation([v * scale for v in values]) == pytest.approx(got, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize(
    ("series", "expected"),
    [
        ([], math.nan),
        ([1.0, 2.0], math.nan),
        ([4.0, 4.0, 4.0, 4.0], 0.0),
        ([0.0, 0.0, 0.0], math.nan),
        ([1.0, math.nan, 2.0], math.nan),
        ([1.0, math.inf, 2.0], math.nan),
        ([1e308, 1e308, 1e308], 0.0),
    ],
)
def test_fluctuation_edge_cases(series, expected):
    got = fluctuation(series)
    assert (math.isnan(got) and math.isnan(expected)) or got == expected


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, None])
def test_finite_probe_on_large_cpu_tensors_never_misses_a_nonfinite_value(dtype, bad):
    """Tensors of SUM_MIN_ELEMENTS elements or more on average are probed by their sums: a NaN or Inf anywhere is
    found; finite values whose sum overflows read as a possible one (a false alarm the exact check clears), never
    the other way round."""
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(SUM_MIN_ELEMENTS + 5, generator=g).to(dtype) for _ in range(3)]
    if bad is not None:
        tensors[1][12345] = bad
    probe = finite_probe(tensors).item()
    assert (probe != 0) == (bad is not None)
    assert (probe != 0) == bool(nonfinite_flag(tensors).item())
    huge = [torch.full((SUM_MIN_ELEMENTS,), torch.finfo(dtype).max, dtype=dtype) for _ in range(2)]
    overflows = dtype != torch.float16  # half values summed in float32 stay finite
    assert (finite_probe(huge).item() != 0) == overflows  # a possible one ...
    assert nonfinite_flag(huge).item() == 0  # ... that the exact check clears
    before = [t.clone() for t in tensors]
    finite_probe(tensors)  # read only
    assert all(bool(((t == b) | (torch.isnan(t) & torch.isnan(b))).all()) for t, b in zip(tensors, before, strict=True))
