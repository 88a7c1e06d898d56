"""Localisation replay: which module, the input, the loss, or backward; and that the replay changes nothing."""

from __future__ import annotations

import torch
from torch import nn

from lightning_diag.instrument.nonfinite_locate import find_nonfinite_in_batch, locate
from lightning_diag.instrument.rng import RngState


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class _NanBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def, override]
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        return grad * float("nan")


class NanBackward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NanBackward.apply(x)


class Net(nn.Module):
    def __init__(self, middle: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.3), middle, nn.Linear(4, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


X = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))


def test_forward_source_is_the_first_module_with_finite_inputs():
    net = Net(Log())
    found = locate(net, lambda: net(X).mean())
    assert (found.source, found.phase) == ("body.3", "forward")
    assert "Log" in found.detail and "NaN from finite values" in found.detail


def test_replay_changes_no_state():
    net = Net(Log())
    net.train()
    buffers = {k: v.clone() for k, v in net.named_buffers()}
    params = {k: v.clone() for k, v in net.named_parameters()}
    rng = RngState.capture()
    locate(net, lambda: net(X).mean(), rng_state=RngState.capture())
    assert all(torch.equal(buffers[k], v) for k, v in net.named_buffers())
    assert all(torch.equal(params[k], v) and v.grad is None for k, v in net.named_parameters())
    after = torch.rand(3)
    rng.restore()
    assert torch.equal(after, torch.rand(3))  # the RNG stream goes on as if no replay happened


def test_replay_uses_the_steps_rng_state():
    net = Net(nn.Identity())
    seen: list[torch.Tensor] = []
    start = RngState.capture()
    reference = net(X)
    torch.rand(5)  # training moved the generator on
    locate(net, lambda: seen.append(net(X)) or seen[-1].mean(), rng_state=start)
    assert torch.equal(seen[0], reference)  # same dropout mask


def test_backward_source():
    net = Net(NanBackward())
    found = locate(net, lambda: net(X).mean())
    assert (found.source, found.phase) == ("body.3", "backward")
    assert "in backward" in found.detail
    assert all(p.grad is None for p in net.parameters())


def test_loss_sources():
    net = Net(nn.Identity())
    assert locate(net, lambda: torch.log(net(X) - 100).mean()).source == "loss"  # log of a negative
    found = locate(net, lambda: torch.sqrt(net(X) * 0).mean())  # finite loss, infinite gradient of sqrt(0)
    assert (found.source, found.phase) == ("loss", "backward")
    found = locate(net, lambda: nn.MSELoss()(net(X), torch.full((8, 1), float("inf"))))
    assert found.source == "loss"
    assert not locate(net, lambda: net(X).mean()).found


def test_fp16_overflow_reads_as_overflow():
    lin = nn.Linear(4, 4).half()
    with torch.no_grad():
        lin.weight.fill_(300.0)
    found = locate(lin, lambda: lin(torch.full((2, 4), 300.0, dtype=torch.float16)).float().mean())
    assert found.phase == "forward"
    assert "float16" in found.detail and "overflow" in found.detail and "max |x| 300" in found.detail


def test_batch_check_names_the_key():
    batch = {"ids": torch.arange(3), "x": torch.ones(2), "y": torch.tensor([1.0, float("inf")])}
    found = find_nonfinite_in_batch(batch)
    assert found is not None and found.source == "input" and "['y']" in found.detail and "1 Inf" in found.detail
    assert find_nonfinite_in_batch((torch.ones(2), [torch.zeros(1)])) is None
