"""The measuring step's passes in issue 43's eighth pass give the values of the former computations, bit for bit:
``measure_step``'s gradient and weight norms from one multi-tensor pass instead of two, and the zero-gradient share
of ``ActivationWatch.readings`` (a guard for any later change of its count; NaN, Inf, -0, bfloat16 and float16
included)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_diag.instrument.activation_watch import ActivationWatch, _count_true
from lightning_diag.instrument.grad_measure import (
    GradientSquares,
    ParamIndex,
    measure_step,
    update_norms,
    update_ratio_values,
)
from lightning_diag.stats.grad import per_tensor_norms


def _same(got: torch.Tensor, former: torch.Tensor) -> None:
    """Equal bit for bit (NaN where NaN), the same dtype and shape."""
    torch.testing.assert_close(got, former, rtol=0, atol=0, equal_nan=True)


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _former_zero_share(grad: torch.Tensor) -> torch.Tensor:
    """The zero-gradient share as ``readings`` computes it on main: ``count_nonzero`` of the boolean tensor."""
    n = grad.numel()
    if n == 0 or n >= 1 << 24:
        return (grad == 0).float().mean()
    return (n - torch.count_nonzero(grad.bool())).float().div_(n)


def _special(n: int, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """``n`` random values with zeros, -0, NaN and both infinities mixed in."""
    x = torch.randn(n, generator=generator)
    u = torch.rand(n, generator=generator)
    x[u < 0.3] = 0.0
    x[(u >= 0.3) & (u < 0.35)] = -0.0
    x[(u >= 0.35) & (u < 0.37)] = math.nan
    x[(u >= 0.37) & (u < 0.38)] = math.inf
    x[(u >= 0.38) & (u < 0.39)] = -math.inf
    return x.to(dtype)


def _zero_shares(grads: list[torch.Tensor]) -> list[float | None]:
    """``diag/grad_zero`` of a watched ``Linear -> ReLU -> Linear`` whose first weight gradient is set to each of
    ``grads`` (its shape and dtype) after the backward; one watch for all (larger and smaller gradients in turn)."""
    out = []
    watch = ActivationWatch()
    for grad in grads:
        net = nn.Sequential(nn.Linear(grad.shape[1], grad.shape[0]), nn.ReLU(), nn.Linear(grad.shape[0], 1))
        net = net.to(grad.dtype)
        watch.attach(net)
        net(torch.randn(32, grad.shape[1], dtype=grad.dtype)).sum().backward()
        watch.detach()
        net[0].weight.grad = grad
        readings, _ = watch.readings(dict(net.named_modules()))
        out += [r.zero_grad for r in readings if r.dead is not None]
    return out


@pytest.mark.parametrize("dtype", _DTYPES)
def test_zero_share_as_before(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    sizes = torch.randint(1, 60, (40, 2), generator=g).tolist()
    grads = [_special(rows * cols, g, dtype).reshape(rows, cols) for rows, cols in sizes]
    grads += [torch.zeros(5, 3, dtype=dtype), torch.full((3, 4), -0.0, dtype=dtype), torch.ones(7, 2, dtype=dtype)]
    tiny = torch.finfo(dtype).smallest_normal / 4  # a denormal: nonzero
    grads += [torch.tensor([[tiny, -tiny, 0.0], [-0.0, tiny, math.nan]], dtype=dtype)]
    grads += [torch.full((4, 4), math.nan, dtype=dtype), _special(64 * 600, g, dtype).reshape(64, 600).t()]
    grads = [grads[-1], *grads[:-1]]  # the largest first
    former = [_former_zero_share(grad).item() for grad in grads]
    assert _zero_shares(grads) == former
    assert former == [(grad == 0).float().mean().item() for grad in grads]  # the quantity it stands for


@pytest.mark.parametrize("n", [0, 1, 7, 8, 2039, 2040, 2041, 2 * 2040 + 9, 255 * 2040, 255 * 2040 + 2047, 360_000])
def test_count_true_is_count_nonzero(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    patterns = {
        "all": torch.ones(n, dtype=torch.bool),  # every byte of a group's sum at its largest (255): no carry
        "none": torch.zeros(n, dtype=torch.bool),
        "random": torch.rand(n, generator=g) < 0.3,
        "every other": torch.arange(n) % 2 == 0,
        "sparse": torch.rand(n, generator=g) < 0.001,
    }
    for name, flags in patterns.items():
        got = _count_true(flags)
        assert got.dtype == torch.int64 and got.ndim == 0, name
        assert got.item() == torch.count_nonzero(flags).item(), name
    # a view that does not start on a word, and one that is not contiguous: counted all the same
    flags = patterns["random"]
    for view in (flags[3:], flags[8:], flags[::2]):
        assert _count_true(view).item() == torch.count_nonzero(view).item()


def _net(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)).to(dtype)
    net(torch.randn(32, 6, dtype=dtype)).sum().backward()
    return net


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("special", [False, True])
def test_measure_step_norms_as_two_passes(dtype: torch.dtype, special: bool) -> None:
    net = _net(dtype)
    named = list(net.named_parameters())
    params = [p for _, p in named]
    if special:  # NaN and infinities in gradients and weights, a -0 gradient
        with torch.no_grad():
            grads = [p.grad for p in params]
            assert grads[0] is not None and grads[2] is not None and grads[3] is not None
            grads[0][0, 0], grads[2][1, 1], grads[3][0] = math.nan, math.inf, -0.0
            params[4][0, 0], params[1][2] = -math.inf, math.nan
    index = ParamIndex([n for n, _ in named], params, False, dict(net.named_modules()))
    chosen = [0, 1, 2, 4, 5]  # not every parameter: the positions travel with the norms
    m = measure_step(index, chosen, torch.tensor(0.5))
    grads = [params[i].grad for i in chosen]
    former_grad = per_tensor_norms(grads).pow(2)  # type: ignore[arg-type]
    former_weight = per_tensor_norms([params[i] for i in chosen]).pow(2)
    assert m.weight_squares is not None
    _same(m.weight_squares, former_weight)
    # the driver's shared measurement of the same parameters: the same squares, and the step measured from them
    known = GradientSquares.measure([params[i] for i in chosen], weights=True)
    assert known is not None and known.weights is not None
    _same(known.squares, former_grad)
    _same(known.weights, former_weight)
    assert known.covers(grads)  # type: ignore[arg-type]
    from_known = measure_step(index, chosen, torch.tensor(0.5), known=known)
    assert from_known.weight_squares is not None
    _same(from_known.weight_squares, former_weight)
    # the update ratios from these squares: what they were from the separately measured ones
    before = [params[i].detach().clone() for i in chosen]
    with torch.no_grad():
        for p in params:
            p.add_(0.125)
    got = update_ratio_values(
        index, chosen, update_norms(index, chosen, [b.clone() for b in before], None, m.weight_squares).tolist()
    )
    expected = update_ratio_values(
        index, chosen, update_norms(index, chosen, [b.clone() for b in before], None, former_weight).tolist()
    )
    assert got.keys() == expected.keys() and len(got) == 6
    for key in got:
        assert got[key] == expected[key] or (math.isnan(got[key]) and math.isnan(expected[key])), key


def test_measure_step_norms_mixed_dtypes() -> None:
    """bfloat16 weights with float32 gradients: two buckets, each norm in its place."""
    net = _net(torch.float32)
    named = list(net.named_parameters())
    params = [p for _, p in named]
    with torch.no_grad():
        params[2].data = params[2].data.bfloat16()
    index = ParamIndex([n for n, _ in named], params, False, dict(net.named_modules()))
    chosen = list(range(len(params)))
    m = measure_step(index, chosen, None)
    known = GradientSquares.measure(params, weights=True)
    assert m.weight_squares is not None and known is not None and known.weights is not None
    _same(known.squares, per_tensor_norms([p.grad for p in params]).pow(2))  # type: ignore[misc]
    _same(known.weights, per_tensor_norms(params).pow(2))
    _same(m.weight_squares, per_tensor_norms(params).pow(2))
    assert m.weight_squares.dtype is torch.float32 and known.squares.dtype is torch.float32
