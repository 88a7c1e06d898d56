"""``LossSums.local_totals``: one process's period totals, read in one stacked copy, are the floats the one-process
reduction (``reduce_state``) gives, bit for bit; anything it cannot read that way falls back (``None``)."""

import math
from types import SimpleNamespace

import pytest
import torch

from lightning_diag.callbacks.common.reduction import reduce_state
from lightning_diag.stats.loss_sums import LOSS_PERIODS, LossSums

ONE_PROCESS = SimpleNamespace(world_size=1)


@pytest.mark.parametrize("seed", range(20))
def test_local_totals_equal_the_one_process_reduction(seed):
    gen = torch.Generator().manual_seed(seed)
    sums = LossSums(baseline_steps=3)
    n = int(torch.randint(1, 150, (), generator=gen))  # past one fold of 64 held losses, and within one
    losses = torch.randn(n, generator=gen).exp() * 10.0 ** float(torch.randint(-4, 4, (), generator=gen))
    for i, v in enumerate(losses.tolist()):
        value = math.nan if i % 17 == 5 else (math.inf if i % 29 == 7 else v)
        sums.add(torch.tensor(value, dtype=torch.float32))
        if i == n // 2:
            sums.reset(LossSums.spread_names("window"))  # a period restarted midway
    for prefix in (*LOSS_PERIODS, "initial"):
        names = LossSums.spread_names(prefix) if prefix in LOSS_PERIODS else LossSums.names(prefix)
        local = sums.local_totals(names)
        assert local is not None
        reduced = reduce_state(ONE_PROCESS, sums, names, device=torch.device("cpu"))
        assert list(local) == list(names) and local == reduced  # no NaN: non-finite losses add nothing


def test_local_totals_fall_back_for_what_is_not_a_float64_tensor_of_one_device():
    sums = LossSums(baseline_steps=0)
    names = LossSums.spread_names("epoch")
    assert sums.local_totals(names) is None  # the Python defaults of a period that counted nothing
    sums.add(torch.tensor(1.0))
    assert sums.local_totals(names) == {"epoch_sum": 1.0, "epoch_count": 1.0, "epoch_dsq": 0.0, "epoch_dn": 0.0}
    sums["epoch_sum"] = torch.tensor(1.0, dtype=torch.float32)  # float32 sums (MPS)
    assert sums.local_totals(names) is None
    assert sums.local_totals([]) == {}


def test_a_fold_of_0d_losses_equals_one_of_reshaped_ones():
    """The held losses are stacked as they are when all are 0-d (no reshape each), else reshaped: the same sums."""
    gen = torch.Generator().manual_seed(7)
    losses = (torch.randn(100, generator=gen) * 3).exp().tolist()
    plain, shaped = LossSums(baseline_steps=5), LossSums(baseline_steps=5)
    for i, v in enumerate(losses):
        value = math.nan if i % 13 == 4 else v
        plain.add(torch.tensor(value))
        shaped.add(torch.tensor([value]) if i % 2 else torch.tensor(value))  # some 1-element, not 0-d
    a, b = plain.state_dict(), shaped.state_dict()
    assert a.keys() == b.keys()
    assert all(a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]) for k in a)
