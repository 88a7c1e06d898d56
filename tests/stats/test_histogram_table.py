"""The prefix table of :func:`lightning_diag.stats.histogram.cpu_histogram` is built block by block, the first time
a value of a block is binned: every entry built is the one the whole table, built at once, held (the buckets of
the prefix's smallest and largest magnitude, the straddling mark where they differ), and a histogram whose
values reach blocks not built yet is the same as one over a fully built table."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_diag.stats import histogram


def _whole_table(edges: np.ndarray) -> np.ndarray:
    """The table as it was built before, all at once."""
    keys = np.arange(1 << 20, dtype=np.uint32) << 12
    with np.errstate(invalid="ignore"):
        low = keys.view(np.float32).astype(np.float64)
        high = (keys | ((1 << 12) - 1)).view(np.float32).astype(np.float64)
    low_bucket = histogram._buckets(low, edges)
    return np.where(low_bucket == histogram._buckets(high, edges), low_bucket, len(edges))


def test_every_block_built_is_the_whole_tables():
    edges = np.asarray(histogram.default_edges(), dtype=np.float64)
    table = torch.full((1 << 20,), len(edges) + 1, dtype=torch.int16)
    histogram._build_blocks(table, edges, np.array([0, 200, 300, 511]))  # a few blocks, both signs
    whole = _whole_table(edges)
    built = table.numpy() != len(edges) + 1
    assert built.sum() == 4 * 2048
    assert np.array_equal(table.numpy()[built], whole[built].astype(np.int16))
    histogram._build_blocks(table, edges, np.arange(512))
    assert np.array_equal(table.numpy(), whole.astype(np.int16))


@pytest.mark.parametrize("scale", [1e-30, 1e-9, 1.0, 1e15, 1e25])
def test_a_histogram_that_reaches_new_blocks_is_the_same(monkeypatch, scale):
    torch.manual_seed(0)
    values = torch.randn(5000) * scale
    values[::97] = 0.0
    values[1] = -0.0
    values[2] = 1e-12  # an edge
    edges = np.asarray(histogram.default_edges(), dtype=np.float64)
    full = torch.from_numpy(_whole_table(edges).astype(np.int16))
    monkeypatch.setattr(histogram, "_prefix_table", lambda: (edges, full))
    expected = histogram.cpu_histogram(values)
    fresh = torch.full((1 << 20,), len(edges) + 1, dtype=torch.int16)
    monkeypatch.setattr(histogram, "_prefix_table", lambda: (edges, fresh))
    assert histogram.cpu_histogram(values) == expected  # blocks built on the way
    assert (fresh.numpy() != len(edges) + 1).sum() < 1 << 20  # not the whole table
    assert histogram.cpu_histogram(values) == expected  # and read again
