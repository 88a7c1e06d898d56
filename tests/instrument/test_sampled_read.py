"""The sampled checks' one host read: ``ZeroOutputWatch.extremes`` read and combined on the host
(``counts_of``) says what the device combination ``counts(signs=True)`` says, and ``read_together`` splits one
transfer back into each tensor's numbers."""

from __future__ import annotations

import math

import torch
from torch import nn

from lightning_diag.callbacks.anomaly_alarm.sampled_check import read_together
from lightning_diag.instrument.output_watch import ZeroOutputWatch

_SPECIALS = [0.0, -0.0, math.nan, math.inf, -math.inf, -1.0, 2.0, 1e-300, -1e-300]


def _random_outputs(gen: torch.Generator, trial: int) -> torch.Tensor:
    dtype = (torch.float32, torch.float64, torch.bfloat16, torch.float16)[trial % 4]
    values = torch.zeros(5) if torch.rand(1, generator=gen) < 0.4 else torch.randn(5, generator=gen).relu()
    values = values.to(dtype)
    if torch.rand(1, generator=gen) < 0.6:
        values[int(torch.randint(0, 5, (1,), generator=gen))] = _SPECIALS[int(torch.randint(0, 9, (1,), generator=gen))]
    return values


def test_counts_read_on_the_host_equal_the_device_counts() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4), nn.Tanh())
    watch = ZeroOutputWatch(net)
    gen = torch.Generator().manual_seed(5)
    tiny_seen = 0
    for trial in range(200):
        names = [watch.order[int(i)] for i in torch.randint(0, 5, (1 + trial % 9,), generator=gen)]
        outputs = [_random_outputs(gen, trial) for _ in names]
        tiny_seen += any(bool((o.abs() == 1e-300).any()) for o in outputs)
        for name, out in zip(names, outputs, strict=True):
            watch._seen(name, out)
        expected = watch.counts(signs=True)
        for name, out in zip(names, outputs, strict=True):
            watch._seen(name, out)
        seen = watch.extremes()
        assert expected is not None and seen is not None
        assert seen[0] == tuple(names) and seen[1].dtype == torch.float32 and seen[1].dim() == 1
        assert watch.counts_of(seen[0], seen[1].tolist()) == expected.tolist(), (trial, names, outputs)
    assert tiny_seen > 5  # float64 values that float32 reads as 0 were among them (their sign is kept)
    assert watch.extremes() is None  # cleared


def test_a_module_that_ran_and_returned_zeros_once_of_two_calls_is_not_zero() -> None:
    net = nn.Sequential(nn.Identity(), nn.ReLU())
    watch = ZeroOutputWatch(net)
    watch._seen("0", torch.zeros(3))
    watch._seen("0", torch.tensor([0.0, -2.0, 0.0]))
    watch._seen("1", torch.zeros(2))
    names, values = watch.extremes()  # type: ignore[misc]
    ran, zero, signed = watch.counts_of(names, values.tolist())
    assert watch.order == ["", "0", "1"]
    assert (ran, zero, signed) == ([0.0, 1.0, 1.0], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0])


def test_read_together_splits_one_transfer_and_reads_apart_what_differs() -> None:
    a, b, c = torch.tensor([1.5, -2.0]), torch.tensor([3.0]), torch.arange(4, dtype=torch.float32)
    assert read_together([a, b, c]) == [[1.5, -2.0], [3.0], [0.0, 1.0, 2.0, 3.0]]
    assert read_together([a, torch.tensor([7.0], dtype=torch.float64)]) == [[1.5, -2.0], [7.0]]
    assert read_together([b]) == [[3.0]] and read_together([]) == []
