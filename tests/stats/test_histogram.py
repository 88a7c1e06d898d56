"""The device-side TensorBoard histogram against torch.utils.tensorboard's own (NumPy) computation."""

import numpy as np
import pytest
import torch
from torch.utils.tensorboard.summary import make_histogram

from lightning_diag.stats.histogram import default_edges, tensorboard_histogram

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
