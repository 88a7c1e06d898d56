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
        assert expected is not None and seen is not None and seen[0] == tuple(names)
        (values,) = read_together([seen[1]])  # one stack: the dtypes promoted, each value exact
        assert watch.counts_of(seen[0], values) == expected.tolist(), (trial, names, outputs)
    assert tiny_seen > 5  # float64 values that float32 reads as 0 were among them (their sign is kept)
    assert watch.extremes() is None  # cleared


def test_a_module_that_ran_and_returned_zeros_once_of_two_calls_is_not_zero() -> None:
    net = nn.Sequential(nn.Identity(), nn.ReLU())
    watch = ZeroOutputWatch(net)
    watch._seen("0", torch.zeros(3))
    watch._seen("0", torch.tensor([0.0, -2.0, 0.0]))
    watch._seen("1", torch.zeros(2))
    names, values = watch.extremes()  # type: ignore[misc]
    ran, zero, signed = watch.counts_of(names, torch.stack(values).tolist())
    assert watch.order == ["", "0", "1"]
    assert (ran, zero, signed) == ([0.0, 1.0, 1.0], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0])


def test_read_together_splits_one_transfer_exactly() -> None:
    a, b = [torch.tensor(1.5), torch.tensor(-2.0)], [torch.tensor(1e-300, dtype=torch.float64)]
    c = [torch.tensor(0.1, dtype=torch.bfloat16), torch.tensor(-0.0)]
    tenth = c[0].item()  # 0.1 in bfloat16
    assert read_together([a, [], b, c]) == [[1.5, -2.0], [], [1e-300], [tenth, -0.0]]
    assert math.copysign(1.0, read_together([c])[0][1]) == -1.0
    counts = torch.arange(6, dtype=torch.float32)  # 1-d (the counts summed over ranks) with 0-d ones: concatenated
    assert read_together([[counts], a]) == [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [1.5, -2.0]]
    assert read_together([]) == [] and read_together([[]]) == [[]]


def _former_output_spread(output: torch.Tensor, max_elements: int = 65536) -> torch.Tensor:
    """``output_watch.output_spread`` as main ``83654a2`` had it (frozen): ``[spread, level, batch]``."""
    with torch.no_grad():
        flat = output.detach().reshape(output.shape[0], -1)
        if flat.shape[1] > max_elements:
            flat = flat[:, :: -(-flat.shape[1] // max_elements)]
        flat = flat.float()
        spread = flat.std(0, unbiased=False).mean() if flat.shape[0] > 1 else flat.new_zeros(())
        level = flat.mean(0).abs().mean()
        return torch.stack([spread, level, flat.new_tensor(float(flat.shape[0]))])


def test_the_spread_read_in_the_one_transfer_is_the_former_output_spread_to_the_bit() -> None:
    """The four numbers ``output_collapse`` reads are the former ``output_spread``'s spread and level of the output
    and of its input, as they were read when the watch returned them stacked with the batch size."""
    from lightning_diag.instrument.output_watch import OutputSpreadWatch

    gen = torch.Generator().manual_seed(1)
    for batch, width in ((64, 1), (7, 33), (2, 5), (1, 4)):
        net = nn.Sequential(nn.Linear(width, 3))
        watch = OutputSpreadWatch(net)
        x = torch.randn(batch, width, generator=gen) * 3.0
        watch.start()
        out = net(x)
        watch.stop()
        name, size, stats = watch.take()  # type: ignore[misc]
        (values,) = read_together([stats])
        assert name == "<root>" and size == batch
        want = _former_output_spread(out)[:2].tolist() + _former_output_spread(x)[:2].tolist()
        assert [v.hex() for v in values] == [v.hex() for v in want]
