"""The measuring step's reused buffers and index tensors (issue 43): the same values as fresh ones, never shared
between two uses at once."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_diag.instrument.activation_watch import ActivationWatch
from lightning_diag.instrument.grad_measure import (
    ParamIndex,
    WeightCopies,
    measure_step,
    update_norms,
    update_ratio_values,
)
from lightning_diag.stats.updates import ElementSample


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))


def _index(net: nn.Module) -> ParamIndex:
    named = list(net.named_parameters())
    return ParamIndex([n for n, _ in named], [p for _, p in named], False, dict(net.named_modules()))


def test_weight_copies_refill_the_same_buffers_and_lend_each_once() -> None:
    w = [torch.randn(4, 3), torch.randn(3)]
    copies = WeightCopies()
    first = copies.take("a", w)
    assert all(torch.equal(c, t) for c, t in zip(first, w, strict=True))
    # not released yet: a second take under the same key must not overwrite the lent buffers
    second = copies.take("a", w)
    assert all(s is not f for s, f in zip(second, first, strict=True))
    copies.release()
    w[0].add_(1.0)
    third = copies.take("a", w)
    assert third[0] is first[0] and torch.equal(third[0], w[0])
    copies.release()
    # another layout under the key (a parameter replaced by one of another shape): fresh copies of the new one
    changed = [torch.randn(5, 3), w[1]]
    fourth = copies.take("a", changed)
    assert fourth[0] is not first[0] and torch.equal(fourth[0], changed[0])


def test_weight_copies_are_never_the_weights_themselves() -> None:
    w = [torch.ones(3)]
    copies = WeightCopies()
    taken = copies.take(0, w)
    w[0].add_(1.0)
    assert taken[0].tolist() == [1.0, 1.0, 1.0]


def test_update_ratios_from_reused_buffers_equal_those_from_fresh_copies() -> None:
    net = _net()
    index = _index(net)
    chosen = list(range(len(index.params)))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    copies = WeightCopies()
    for _ in range(3):
        opt.zero_grad()
        net(torch.randn(32, 8)).pow(2).mean().backward()
        m = measure_step(index, chosen, None)
        fresh = [p.detach().clone() for p in index.params]
        reused = copies.take(0, index.params)
        opt.step()
        expected = update_ratio_values(
            index, chosen, update_norms(index, chosen, fresh, None, m.weight_squares).tolist()
        )
        assert (
            update_ratio_values(index, chosen, update_norms(index, chosen, reused, None, m.weight_squares).tolist())
            == expected
        )
        copies.release()


def test_measure_step_reuses_its_index_tensors_with_the_same_results() -> None:
    net = _net()
    index = _index(net)
    net(torch.randn(32, 8)).pow(2).mean().backward()
    chosen = list(range(len(index.params)))
    first = measure_step(index, chosen, torch.tensor(0.5))
    layout = index.layout(chosen, torch.device("cpu"))
    second = measure_step(index, chosen, torch.tensor(0.5))
    assert index.layout(chosen, torch.device("cpu")) is layout
    assert (first.total, first.norms, first.rms, first.relative, first.blocks, first.loss) == (
        second.total, second.norms, second.rms, second.relative, second.blocks, second.loss,
    )  # fmt: skip
    # a subset (a parameter without a gradient this step) has a layout of its own
    part = measure_step(index, chosen[2:], None)
    assert set(part.norms) == {"2", "4"} and part.norms["2"] == first.norms["2"]


def test_element_sample_reads_the_flattened_elements_of_non_contiguous_tensors() -> None:
    base = torch.arange(60.0).reshape(6, 10)
    tensors = [base.t(), base[:, ::2], torch.arange(5, dtype=torch.float16)]
    sample = ElementSample(tensors, size=4)
    expected = torch.cat(
        [t.reshape(-1).index_select(0, pos).float() for t, pos in zip(tensors, sample.positions, strict=True)]
    )
    got = sample.gather(tensors)
    assert got.dtype is torch.float32 and torch.equal(got, expected)
    assert sample.gather([None, tensors[1], None])[:4].tolist() == [0.0] * 4


def test_zero_gradient_shares_equal_the_float_mean_of_the_zero_mask() -> None:
    """``diag/grad_zero/<layer>``: the watch's count of exactly-zero weight-gradient entries gives, bit for bit,
    ``(grad == 0).float().mean()``, with dead units (zero rows), -0.0, NaN and infinities among the entries."""
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(8, 300), nn.ReLU(), nn.Linear(300, 200), nn.ReLU(), nn.Linear(200, 1))
    with torch.no_grad():
        net[0].bias[:120] = -100.0  # 120 dead units: their weight-gradient rows are exactly 0
    watch = ActivationWatch()
    watch.attach(net)
    net(torch.randn(64, 8)).sum().backward()
    watch.detach()
    grad = net[2].weight.grad
    assert grad is not None
    grad[0, :4] = torch.tensor([-0.0, float("nan"), float("inf"), float("-inf")])
    expected = {name: (net.get_submodule(name).weight.grad == 0).float().mean().item() for name in ("0", "2")}
    readings, _ = watch.readings(dict(net.named_modules()))
    shares = {r.layer: r.zero_grad for r in readings if r.zero_grad is not None}
    assert shares == expected
    assert 0.0 < shares["0"] < 1.0 and shares["2"] > 0.4  # the dead rows' zeros are counted, +-0 alike


@pytest.mark.parametrize("threshold", [None, 0], ids=["maxima", "boolean"])
def test_dead_unit_shares_equal_those_of_the_boolean_any(threshold, monkeypatch):
    """``dead_units``' share of units that never respond, read from the input's maxima (or, past the size limit, from
    the boolean tensor), equals ``1 - (x > 0).any(over rows).float().mean()``: linear, sequence and convolution
    layouts, with NaN, infinities and -0.0 in the input."""
    import lightning_diag.instrument.activation_watch as activation_watch

    if threshold is not None:
        monkeypatch.setattr(activation_watch, "ALIVE_MAX_ELEMENTS", threshold)
    torch.manual_seed(1)
    nets = {
        1: nn.Sequential(nn.Linear(8, 40), nn.ReLU(), nn.Linear(40, 1)),  # (N, C): units in the last dimension
        2: nn.Sequential(nn.Linear(8, 40), nn.ReLU(), nn.Linear(40, 1)),  # (N, L, C)
        3: nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU(), nn.Conv2d(6, 1, 1)),  # (N, C, H, W): units in dimension 1
    }
    inputs = {1: torch.randn(32, 8), 2: torch.randn(4, 8, 8), 3: torch.randn(4, 3, 6, 6)}
    for case, net in nets.items():
        with torch.no_grad():
            net[0].bias[:5] = -100.0  # five dead units
        seen: list[torch.Tensor] = []

        def plant(module, args, seen=seen):
            x = args[0].clone()
            x.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0])
            x.view(-1)[-1] = float("nan")  # in a unit that responds elsewhere: still alive
            seen.append(x)
            return (x,)

        net[1].register_forward_pre_hook(plant)  # before the watch's own pre-hook: it sees the planted values
        watch = ActivationWatch()
        watch.attach(net)
        net(inputs[case]).sum().backward()
        watch.detach()
        readings, _ = watch.readings(dict(net.named_modules()))
        x = seen[0]
        dim = 1 if x.ndim >= 4 else x.ndim - 1
        alive = (x > 0).movedim(dim, -1).reshape(-1, x.shape[dim]).any(0)
        assert [r.dead for r in readings if r.dead is not None] == [(1.0 - alive.float().mean()).item()], case
        assert readings[0].dead > 3.5 / x.shape[dim]  # four dead units: the planted +inf revives one
