"""The measuring step's small computations read weights and gradients outside autograd, not from ``detach()``-ed
views (one dispatched operator fewer per tensor): the same values as the former computations, NaN and Inf
included, no result attached to a graph, and the operators counted."""

from __future__ import annotations

import math

import torch
from torch import nn

from lightning_diag.instrument.activation_watch import ActivationWatch
from lightning_diag.instrument.grad_measure import WeightCopies
from lightning_diag.instrument.output_watch import ZeroOutputWatch
from lightning_diag.stats.updates import ElementSample, unchanged_counts
from tests.callbacks.op_names import OpNames


def _former_gather(sample: ElementSample, tensors: list[torch.Tensor | None]) -> torch.Tensor:
    """``ElementSample.gather`` as it was: a ``take`` of each ``detach()``-ed tensor, zeros for ``None``."""
    parts = []
    for t, pos in zip(tensors, sample.positions, strict=True):
        if t is None:
            parts.append(torch.zeros(len(pos)))
            continue
        part = torch.take(t.detach(), pos)
        parts.append(part if part.dtype is torch.float32 else part.float())
    return torch.cat(parts)


def _former_counts(
    before: torch.Tensor, after: torch.Tensor, grads: torch.Tensor, segment: torch.Tensor, count: int
) -> torch.Tensor:
    """``unchanged_counts`` as it was: one ``index_add_`` per row."""
    live = torch.isfinite(grads) & (grads != 0)
    same = live & (after == before)
    out = torch.zeros(2, count)
    out[0].index_add_(0, segment, live.float())
    out[1].index_add_(0, segment, same.float())
    return out


def _params() -> list[nn.Parameter]:
    torch.manual_seed(0)
    ps = [
        nn.Parameter(torch.randn(60, 50)),
        nn.Parameter(torch.randn(7)),
        nn.Parameter(torch.randn(3, 4, 5).bfloat16()),
        nn.Parameter(torch.randn(1)),
    ]
    with torch.no_grad():
        ps[0][0, 0], ps[0][-1, -1], ps[1][3] = math.nan, math.inf, -math.inf
    return ps


def test_gather_same_values_bit_for_bit_outside_autograd() -> None:
    ps = _params()
    sample = ElementSample(ps, 32)
    views: list[torch.Tensor] = [p.t() if p.ndim == 2 else p for p in ps]  # a non-contiguous view reads the same
    for tensors in (ps, [None] * 4, [ps[0], None, ps[2], None], views):
        former, now = _former_gather(sample, list(tensors)), sample.gather(tensors)
        assert now.dtype == former.dtype == torch.float32
        assert torch.equal(now.view(torch.int32), former.view(torch.int32))  # NaN and Inf bit for bit
        assert not now.requires_grad


def test_gather_operators() -> None:
    ps = _params()[:2]
    sample = ElementSample(ps, 8)
    with OpNames() as ops:
        sample.gather(ps)
    assert ops.names == {"take.default": 2, "cat.default": 1}  # no detach
    with OpNames() as ops:
        out = sample.gather([None, None])
    assert ops.names == {"zeros.default": 1} and out.tolist() == [0.0] * 15
    try:
        sample.gather([None])
    except ValueError as e:
        assert "expected 2 tensors" in str(e)
    else:
        raise AssertionError("a wrong number of tensors must raise")


def test_unchanged_counts_as_before_with_nan_and_inf() -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(100):
        n = 50
        before = torch.randn(n, generator=gen)
        after, grads = before.clone(), torch.randn(n, generator=gen)
        after[torch.rand(n, generator=gen) < 0.5] += 1.0
        grads[torch.rand(n, generator=gen) < 0.2] = 0.0
        grads[torch.rand(n, generator=gen) < 0.1] = math.nan
        grads[torch.rand(n, generator=gen) < 0.1] = -math.inf
        before[torch.rand(n, generator=gen) < 0.1] = math.nan
        segment = torch.sort(torch.randint(0, 5, (n,), generator=gen)).values
        now = unchanged_counts(before, after, grads, segment, 5)
        assert torch.equal(now, _former_counts(before, after, grads, segment, 5))
        assert now[1].le(now[0]).all()


def test_weight_copies_outside_autograd() -> None:
    ps = _params()
    copies = WeightCopies()
    first = copies.take(0, ps)
    assert all(
        torch.equal(c.view(-1).float().nan_to_num(7.0), p.detach().view(-1).float().nan_to_num(7.0))
        for c, p in zip(first, ps, strict=True)
    )
    assert not any(c.requires_grad for c in first)
    copies.release()
    with torch.no_grad():
        ps[1].add_(1.0)
    with OpNames() as ops:
        second = copies.take(0, ps)
    assert ops.names == {"_foreach_copy_.default": 1}  # into the buffers, no detach
    assert second[1] is first[1] and torch.equal(second[1], ps[1].detach())


def test_activation_watch_hooks_dispatch_no_detach() -> None:
    torch.manual_seed(0)
    first, second = nn.Linear(4, 8), nn.Linear(8, 8)
    net = nn.Sequential(first, nn.ReLU(), second, nn.Tanh(), nn.Linear(8, 1))
    with torch.no_grad():
        first.bias[:3] = -100.0  # three of eight units dead
    x = torch.randn(32, 4) * 3
    with OpNames() as plain:
        net(x)  # autograd's own detach of a saved output, without the watch
    watch = ActivationWatch()
    watch.attach(net)
    with OpNames() as ops:
        out = net(x)
    watch.detach()
    out.sum().backward()
    assert ops.names["detach.default"] == plain.names["detach.default"]  # the watch adds none
    readings, rms = watch.readings(dict(net.named_modules()))
    hidden = first(x)
    assert [(r.layer, r.dead) for r in readings if r.dead is not None] == [("0", 3 / 8)]
    saturated = (second(torch.relu(hidden)).abs() > 5.0).float().mean().item()
    assert [(r.layer, r.saturated) for r in readings if r.saturated is not None] == [("2", saturated)]
    assert rms == x.pow(2).mean().item() ** 0.5
    grad = first.weight.grad
    assert grad is not None
    assert [r.zero_grad for r in readings if r.dead is not None] == [(grad == 0).float().mean().item()]


def _former_zero_counts(
    watch: ZeroOutputWatch, calls: list[tuple[str, torch.Tensor, torch.Tensor]], signs: bool
) -> torch.Tensor:
    """``ZeroOutputWatch.counts`` as it was: one ``index_add_`` per row, the index built at every call."""
    lows = torch.stack([low for _, low, _ in calls])
    flags = ((lows != 0) | (torch.stack([high for _, _, high in calls]) != 0)).float()
    index = torch.tensor([watch.index[name] for name, _, _ in calls])
    n = len(watch.order)
    ran = torch.zeros(n).index_add_(0, index, torch.ones_like(flags))
    nonzero = torch.zeros(n).index_add_(0, index, flags)
    rows = [(ran > 0).float(), ((ran > 0) & (nonzero == 0)).float()]
    if signs:
        rows.append((torch.zeros(n).index_add_(0, index, (lows < 0).float()) > 0).float())
    return torch.stack(rows)


def test_zero_output_counts_as_before() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4), nn.Tanh())
    watch = ZeroOutputWatch(net)
    gen = torch.Generator().manual_seed(2)
    specials = [0.0, -0.0, math.nan, math.inf, -math.inf, -1.0, 2.0]
    for trial in range(60):
        names = [watch.order[int(i)] for i in torch.randint(0, 3, (1 + trial % 7,), generator=gen)]  # some repeat
        outputs = []
        for _ in names:
            values = torch.zeros(5) if torch.rand(1, generator=gen) < 0.4 else torch.randn(5, generator=gen).relu()
            if torch.rand(1, generator=gen) < 0.5:
                values[int(torch.randint(0, 5, (1,), generator=gen))] = specials[trial % len(specials)]
            outputs.append(values)
        for signs in (False, True):
            for name, out in zip(names, outputs, strict=True):
                watch._seen(name, out)
            calls = list(watch._calls)
            now = watch.counts(signs=signs)
            assert now is not None and torch.equal(now, _former_zero_counts(watch, calls, signs)), (names, signs)
    assert len(watch._layouts) <= 8  # many call sequences: the cache does not grow past its bound
