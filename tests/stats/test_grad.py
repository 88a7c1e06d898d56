import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_diag.stats.grad import grouped_norms, per_tensor_norms


@settings(deadline=None)  # correctness, not timing: no 200 ms deadline on a shared machine
@given(
    st.lists(
        st.tuples(st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=6), st.sampled_from(["f32", "f64"])),
        min_size=1,
        max_size=6,
    )
)
def test_per_tensor_norms_match_numpy(specs):
    tensors = [torch.tensor(v, dtype=torch.float32 if d == "f32" else torch.float64) for v, d in specs]
    got = per_tensor_norms(tensors).tolist()
    want = [float(np.linalg.norm(np.asarray(v))) for v, _ in specs]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-5)


def test_grouped_norms_brute_force():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(k + 1, generator=g) for k in range(7)]
    groups = torch.tensor([0, 0, 1, 2, 2, 2, 1])
    got = grouped_norms(per_tensor_norms(tensors), groups, 3)
    for gi in range(3):
        flat = torch.cat([t for t, k in zip(tensors, groups.tolist(), strict=True) if k == gi])
        assert float(got[gi]) == pytest.approx(float(flat.norm()), rel=1e-6)


def test_empty_and_nonfinite():
    assert per_tensor_norms([]).numel() == 0
    norms = per_tensor_norms([torch.tensor([1.0, float("nan")]), torch.tensor([float("inf")])])
    assert torch.isnan(norms[0]) and torch.isinf(norms[1])
