"""The probes' pure maths: SAM gap against a hand computation, INT8 fake quantization against brute force."""

import math

import pytest
import torch
from torch import nn

from lightning_diag.stats.quantization import (
    LayerErrorAccumulator,
    fake_quantize,
    max_error_pct_of_scale,
    outlier_ratio,
    quantize_symmetric,
    relative_error,
)
from lightning_diag.stats.sharpness import layer_of, relative_gap, sam_epsilon, sam_gap


def test_sam_gap_of_a_quadratic_matches_the_closed_form():
    # L(w) = 0.5 * a * |w|^2 : ∇L = a w, ε = ρ w/|w|, L(w+ε) - L(w) = a (ρ|w| + ρ²/2)
    a, rho = 3.0, 0.1
    w = nn.Parameter(torch.tensor([1.0, 2.0, 2.0]))
    result = sam_gap([("w", w)], lambda: 0.5 * a * w.pow(2).sum(), rho)
    assert result.gap == pytest.approx(a * (rho * 3.0 + rho**2 / 2), rel=1e-5)
    assert result.grad_norm == pytest.approx(a * 3.0, rel=1e-6)
    assert result.relative_gap == pytest.approx(result.gap / result.loss)
    assert torch.equal(w.detach(), torch.tensor([1.0, 2.0, 2.0])) and w.grad is None


def test_sam_gap_restores_parameters_even_when_the_closure_fails():
    w = nn.Parameter(torch.randn(5))
    before = w.detach().clone()
    calls = []

    def closure():
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("boom")
        return w.pow(3).sum()

    with pytest.raises(RuntimeError):
        sam_gap([("w", w)], closure, 0.05)
    assert torch.equal(w.detach(), before)


def test_per_layer_gaps_name_the_layers_and_the_zero_gradient_case():
    a = nn.Parameter(torch.tensor([1.0]))
    b = nn.Parameter(torch.tensor([1.0]))
    result = sam_gap([("l1.weight", a), ("l2.weight", b)], lambda: 10 * a.pow(2).sum() + b.pow(2).sum(), 0.1,
                     per_layer=True)
    assert set(result.layers) == {"l1", "l2"} and result.layers["l1"] > result.layers["l2"] > 0
    eps, norm = sam_epsilon([torch.zeros(3)], 0.05)
    assert norm == 0.0 and torch.equal(eps[0], torch.zeros(3))
    assert layer_of("a.b.weight") == "a.b" and relative_gap(1.0, 0.0) == 1e8


@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel"])
@pytest.mark.parametrize("shape", [(7,), (4, 9), (3, 2, 3, 3)])
def test_fake_quantize_against_brute_force(granularity, shape):
    torch.manual_seed(0)
    w = torch.randn(shape)
    q, _ = quantize_symmetric(w, granularity)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    rows = w.reshape(w.shape[0], -1) if (granularity == "per_channel" and w.dim() > 1) else w.reshape(1, -1)
    expected = []
    for row in rows:
        s = float(row.abs().max()) / 127
        expected.append([max(-127, min(127, round(float(v) / s))) * s for v in row])
    assert torch.allclose(fake_quantize(w, granularity).reshape(rows.shape), torch.tensor(expected), atol=1e-6)
    # round to nearest, no clipping: the error is at most half a step (seed 000 §5.1's measure <= 50%)
    assert 0 < max_error_pct_of_scale(w, granularity) <= 50.0 + 1e-3


def test_zero_tensor_outliers_and_relative_error():
    assert torch.equal(fake_quantize(torch.zeros(4)), torch.zeros(4))
    w = torch.randn(1000).abs() + 0.5
    assert outlier_ratio(w) < 2
    w[3] = 200 * w.max()
    assert outlier_ratio(w) > 100
    assert outlier_ratio(torch.zeros(10)) == 0.0 and math.isinf(outlier_ratio(torch.tensor([0.0] * 999 + [1.0])))
    assert relative_error(0.001, 0.002, floor=0.01) == pytest.approx(0.1)


def test_channel_outlier_ratio():
    from lightning_diag.stats.quantization import channel_outlier_ratio

    x = torch.ones(2, 5, 3, 3)
    x[:, 4] = -30.0
    assert channel_outlier_ratio(x, channel_dim=1) == 30.0 and channel_outlier_ratio(x, channel_dim=-1) == 1.0
    assert channel_outlier_ratio(torch.zeros(3, 4)) == 0.0 and channel_outlier_ratio(torch.ones(4)) == 0.0


def test_relative_mse_averages_channels_so_a_loud_channel_does_not_hide_the_others():
    acc = LayerErrorAccumulator(channel_dim=1)
    y = torch.ones(2, 3, 4)
    y[:, 0] = 1000.0
    noisy = y.clone()
    noisy[:, 1:] = 0.0  # channels 1 and 2 lost entirely
    acc.add(y, noisy)
    acc.add(y, noisy)
    assert acc.relative_mse == pytest.approx(2 / 3)
    assert acc.mse == pytest.approx(32 / 48)  # 2 of 3 channels off by 1 everywhere
