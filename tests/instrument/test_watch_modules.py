"""The activation watch reads its layers' weight gradients from the modules its ``attach`` walked: the same readings
as with ``named_modules()`` passed in."""

import torch
from torch import nn

from lightning_diag.instrument.activation_watch import ActivationWatch


def test_readings_without_modules_equal_those_with_them():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 1))
    with torch.no_grad():
        net[0].bias[:20] = -100.0  # dead units, so that the weight gradients' zero shares are read
    own, given = ActivationWatch(), ActivationWatch()
    own.attach(net)
    given.attach(net)
    net(torch.randn(64, 8)).sum().backward()
    own.detach()
    given.detach()
    readings, rms = own.readings()
    expected, expected_rms = given.readings(dict(net.named_modules()))
    assert readings == expected and rms == expected_rms
    assert any(r.zero_grad is not None and r.zero_grad > 0 for r in readings)
    assert own.readings() == ([], None)  # consumed
