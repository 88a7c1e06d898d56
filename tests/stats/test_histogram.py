"""The device-side TensorBoard histogram against torch.utils.tensorboard's own (NumPy) computation."""

import math

import numpy as np
import pytest
import torch
from torch.utils.tensorboard.summary import histogram, histogram_raw, make_histogram

from lightning_diag.stats.histogram import cpu_histogram, default_edges, tensorboard_histogram

EDGES = np.array(default_edges(), dtype=float)


def test_edges_are_summary_writers_default_bins(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    try:
        assert list(writer.default_bins) == list(default_edges())
    finally:
        writer.close()


@pytest.mark.parametrize(
    "values",
    [
        torch.randn(20_000, generator=torch.Generator().manual_seed(0)) * 1e-3,
        torch.randn(3_000, generator=torch.Generator().manual_seed(1)).double() * 1e6,
        torch.tensor(EDGES[700:850]).float(),  # float32 roundings of edges: next to a bucket boundary
        torch.tensor(EDGES[760:790]),  # exactly on the edges
        torch.tensor([1e-13, -1e-13, 0.0, -0.0, 3.0, -1e-12, 1e-12]),
        torch.zeros(5),
        torch.full((4, 3), -2.5).half(),
    ],
)
def test_buckets_and_moments_match_add_histogram(values):
    ref = make_histogram(values.numpy().astype(float), EDGES)
    got = tensorboard_histogram(values)
    assert got is not None
    assert [float(c) for c in got.bucket_counts] == list(ref.bucket)
    assert got.bucket_limits == list(ref.bucket_limit)
    assert (got.min, got.max, got.num) == (ref.min, ref.max, ref.num)
    assert got.sum == pytest.approx(ref.sum, rel=1e-12, abs=1e-300)
    assert got.sum_squares == pytest.approx(ref.sum_squares, rel=1e-12, abs=1e-300)


def test_chunks_add_up(monkeypatch):
    import lightning_diag.stats.histogram as histogram

    values = torch.randn(1_000, generator=torch.Generator().manual_seed(2))
    whole = tensorboard_histogram(values)
    monkeypatch.setattr(histogram, "_CHUNK", 7)
    chunked = tensorboard_histogram(values)
    assert (chunked.bucket_counts, chunked.bucket_limits) == (whole.bucket_counts, whole.bucket_limits)
    assert (chunked.min, chunked.max, chunked.num) == (whole.min, whole.max, whole.num)
    assert chunked.sum_squares == pytest.approx(whole.sum_squares, rel=1e-12)


@pytest.mark.parametrize("bad", [torch.tensor([1.0, float("nan")]), torch.tensor([float("inf")]), torch.zeros(0)])
def test_nonfinite_or_empty_is_none(bad):
    assert tensorboard_histogram(bad) is None


_F32 = torch.tensor(EDGES, dtype=torch.float64).float()
_DECADES = (torch.rand(100_000, generator=torch.Generator().manual_seed(9)) - 0.5) * 10.0 ** torch.randint(
    -20, 10, (100_000,), generator=torch.Generator().manual_seed(10)
)


@pytest.mark.parametrize(
    "values",
    [
        torch.randn(600, 600, generator=torch.Generator().manual_seed(3)) * 1e-3,  # a layer's gradient
        torch.randn(5_000, generator=torch.Generator().manual_seed(4)) * 1e15,
        torch.randn(1_000, generator=torch.Generator().manual_seed(5)) * 1e-13,  # inside the bucket around 0
        _F32,  # float32 roundings of every edge, and the floats on either side of them: the straddling prefixes
        torch.nextafter(_F32, torch.full_like(_F32, math.inf)),
        torch.nextafter(_F32, torch.full_like(_F32, -math.inf)),
        torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-12, -1e-12, 1e20, -1e20, 3e20, -3e20]),  # denormals, out of range
        torch.tensor([1.0, math.nan, -math.inf, 2.0]),  # NumPy leaves NaN and infinities out of every bucket
        torch.zeros(10),
        torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(6)).transpose(0, 2),  # not contiguous
        torch.full((1_000,), 0.37),  # all equal
        torch.full((7, 9), -3.0e-5),
        torch.tensor([0.0, 2.0, 1.0, 0.0, -0.0]),  # a zero minimum: NumPy's own zero
        torch.tensor([-0.0, -2.0, -1.0, 0.0]),  # a zero maximum
        torch.tensor([-0.0] * 5),
        torch.randn(4_000, generator=torch.Generator().manual_seed(7)) * 1e18,  # beyond 1e20 in part: left out
        torch.randn(4_000, generator=torch.Generator().manual_seed(8)) * 1e-38,  # float32 denormals
        torch.tensor([3e38, -3e38, 1e-30, -1e-30]),  # the largest float32 magnitudes (their squares overflow float32)
        _DECADES,  # 30 decades, both signs
    ],
)
def test_cpu_histogram_writes_what_add_histogram_writes(values):
    """Byte for byte: the summary ``add_histogram`` builds against the one ``add_histogram_raw`` builds from
    :func:`cpu_histogram`."""
    ref = histogram("t", values, EDGES).SerializeToString()
    got = cpu_histogram(values)
    assert got is not None
    raw = histogram_raw("t", got.min, got.max, got.num, got.sum, got.sum_squares, got.bucket_limits, got.bucket_counts)
    assert raw.SerializeToString() == ref


@pytest.mark.parametrize(
    "values",
    [torch.zeros(0), torch.ones(3).double(), torch.ones(3).half(), torch.tensor([math.nan, math.inf, 1e30])],
)
def test_cpu_histogram_leaves_other_tensors_to_add_histogram(values):
    assert cpu_histogram(values) is None


@pytest.mark.parametrize("seed", range(4))
def test_cpu_histogram_on_a_trained_mlps_gradients(seed):
    """A real gradient (the weights of a trained 64 -> 600 -> 600 layer pair, a few SGD steps): every field equal to
    ``add_histogram``'s, the sums included."""
    g = torch.Generator().manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(64, 600), torch.nn.ReLU(), torch.nn.Linear(600, 600))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    for _ in range(3):
        optimizer.zero_grad()
        net(torch.randn(32, 64, generator=g)).square().mean().backward()
        optimizer.step()
    for p in net.parameters():
        got = cpu_histogram(p.grad)
        assert got is not None
        raw = histogram_raw(
            "t", got.min, got.max, got.num, got.sum, got.sum_squares, got.bucket_limits, got.bucket_counts
        )
        assert raw.SerializeToString() == histogram("t", p.grad, EDGES).SerializeToString()
