"""Issue 43's eleventh pass: a measuring step reads its gradient measurement and the activation watch's statistics
(the dead and saturated shares, the zero-gradient shares, the inputs' RMS) in one host copy, and its batch end the
update ratios with the update rules' counts in one, with every value the same as when each was read on its own."""

from __future__ import annotations

import math
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_diag import GradientFlowMonitor
from lightning_diag.callbacks.gradient_flow.writes import update_values_from, update_vector
from lightning_diag.core.tags import update_ratio_tag, weight_norm_tag
from lightning_diag.demo import build_fault
from lightning_diag.instrument.activation_watch import ActivationReading, ActivationWatch
from lightning_diag.instrument.grad_measure import ParamIndex, measure_step
from lightning_diag.stats.grad import grouped_squares, is_dtensor, local_tensor, per_tensor_norms


def _watched_net(seed: int) -> tuple[nn.Sequential, ActivationWatch, torch.Tensor]:
    """A watched forward and backward: dead units, a saturated tanh before a trainable layer, zero gradients."""
    torch.manual_seed(seed)
    first, second = nn.Linear(6, 16), nn.Linear(16, 16)
    net = nn.Sequential(first, nn.ReLU(), second, nn.Tanh(), nn.Linear(16, 1))
    with torch.no_grad():
        first.bias[:5] = -100.0  # five of sixteen units dead: zero rows in the first weight gradient
        second.weight.mul_(20.0)  # the tanh saturates
    watch = ActivationWatch()
    watch.attach(net)
    loss = net(torch.randn(32, 6)).square().mean()
    watch.detach()
    loss.backward()
    return net, watch, loss.detach()


def _fields(m: Any) -> tuple[Any, ...]:
    return (m.total, m.norms, m.rms, m.relative, m.blocks, m.has_matrices, m.loss)


def test_measurement_and_watch_in_one_copy_the_same_values() -> None:
    for seed, special in ((0, False), (1, True)):
        net, watch, loss = _watched_net(seed)
        _, reference, _ = _watched_net(seed)
        if special:  # a NaN gradient, an infinite weight and a NaN loss: carried through the same copy
            params = list(net.parameters())
            with torch.no_grad():
                grad = params[4].grad
                assert grad is not None
                grad[0, 0] = math.nan
                params[3][0] = math.inf
            loss = torch.tensor(math.nan)
        named = list(net.named_parameters())
        index = ParamIndex([n for n, _ in named], [p for _, p in named], False, dict(net.named_modules()))
        chosen = list(range(len(named)))
        alone = measure_step(index, chosen, loss)
        taken = watch.take()
        assert taken.values is not None and taken.values.ndim == 1
        together = measure_step(index, chosen, loss, None, taken.values)
        got = ActivationWatch.finish(taken, together.extra)
        expected = reference.readings(dict(net.named_modules()))
        # a twin net's watch read on its own (the changes above come after the forward and do not touch the first
        # layer's gradient): the same readings
        assert together.extra == taken.values.tolist()
        assert got == expected
        assert [r.layer for r in got[0]] == ["0", "2"] and got[1] is not None
        assert got[0][0].dead == 5 / 16 and got[0][0].zero_grad is not None and got[0][0].zero_grad > 0
        same = [a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(_flat(together), _flat(alone), strict=True)]
        assert all(same)
        assert alone.extra == []


def _flat(m: Any) -> list[float]:
    values = [m.total, m.blocks, math.nan if m.loss is None else m.loss]
    for d in (m.norms, m.rms, m.relative):
        values += [d[k] for k in sorted(d)]
    return values


def _former_zero_share(grad: torch.Tensor) -> torch.Tensor:
    """``activation_watch._zero_share`` as main ``83654a2`` had it (frozen)."""
    n = grad.numel()
    if n == 0 or n >= 1 << 24:
        return (grad == 0).float().mean()
    return (n - torch.count_nonzero(grad.bool())).float().div_(n)


def _former_readings(
    watch: ActivationWatch, modules: dict[str, nn.Module] | None = None
) -> tuple[list[ActivationReading], float | None]:
    """``ActivationWatch.readings`` as main ``83654a2`` had it (frozen): one stack, one ``tolist``."""
    calls, watch._calls = watch._calls, []
    layers, watch._layers = watch._layers, []
    input_sq, watch._input_sq = watch._input_sq, None
    if modules is None:
        modules = watch._modules
    watch._modules = {}
    if not calls:
        return [], None
    stats = [c.stat if c.stat.ndim == 0 and c.stat.dtype is torch.float32 else c.stat.reshape(()).float()
             for c in calls]  # fmt: skip
    grad_layers = sorted({c.layer for c in calls if c.dead})
    zero: list[str] = []
    with torch.no_grad():
        for layer in grad_layers:
            weight = getattr(modules.get(layer), "weight", None)
            if isinstance(weight, torch.Tensor) and weight.grad is not None and not is_dtensor(weight.grad):
                zero.append(layer)
                stats.append(_former_zero_share(weight.grad).to(stats[0].device))
    if input_sq is not None:
        stats.append(input_sq.to(stats[0].device))
    host = torch.stack(stats).tolist()
    zero_shares = dict(zip(zero, host[len(calls) : len(calls) + len(zero)], strict=True))
    input_rms = host[-1] ** 0.5 if input_sq is not None else None
    out = []
    for c, value in zip(calls, host[: len(calls)], strict=True):
        if c.dead:
            out.append(ActivationReading(c.layer, c.activation, dead=value, zero_grad=zero_shares.get(c.layer),
                                         first=c.first, after_frozen=c.after_frozen))  # fmt: skip
        elif any(trainable for _, trainable in layers[c.order :]):
            out.append(ActivationReading(c.layer, c.activation, saturated=value, limit=c.limit, first=c.first))
    return out, input_rms


def test_readings_are_take_then_finish() -> None:
    """``take`` then ``finish`` give what the former one-call ``readings`` gave, bit for bit."""
    for seed in (2, 4):
        net, watch, _ = _watched_net(seed)
        _, twin, _ = _watched_net(seed)
        taken = watch.take(dict(net.named_modules()))
        assert taken.values is not None
        got = ActivationWatch.finish(taken, taken.values.tolist())
        assert got == _former_readings(twin) and got[0]
    assert watch.take().values is None and watch.readings() == ([], None)  # consumed


#: The tensor methods that copy values to the host (``float(t)``, ``bool(t)``, ``int(t)`` included).
_READS = (torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__float__,
          torch.Tensor.__bool__, torch.Tensor.__int__)  # fmt: skip


class _HostReads(TorchFunctionMode):
    """Counts host reads: ``tolist``, ``item``, ``cpu``, ``numpy``, ``float(t)``, ``bool(t)``, ``int(t)``."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_host_reads_counts_every_kind_of_read() -> None:
    t = torch.tensor([1.5])
    with _HostReads() as reads:
        t.tolist(), t.item(), t.cpu(), t.numpy(), float(t), bool(t), int(t)
        _ = t + 1  # not a read
    assert reads.count == 7


class _CountingMonitor(GradientFlowMonitor):
    """Counts the host copies of each measuring step's ``on_before_optimizer_step``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.copies: list[int] = []
        self.end_copies: list[int] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        with _HostReads() as reads:
            super().on_before_optimizer_step(trainer, pl_module, optimizer)
        if self.on_cadence:
            self.copies.append(reads.count)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        measured = self.on_cadence
        with _HostReads() as reads:
            super().on_train_batch_end(trainer, pl_module, *args)
        if measured:
            self.end_copies.append(reads.count)


def test_a_measuring_step_reads_the_host_once_before_the_step(tmp_path: Any) -> None:
    model, data, _ = build_fault("none")
    monitor = _CountingMonitor(histogram_every_n_steps=0)
    trainer = pl.Trainer(
        max_steps=15, default_root_dir=tmp_path, callbacks=[monitor], enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", log_every_n_steps=5, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    assert monitor.copies == [1, 1, 1]  # the norms and the activation watch's statistics together
    assert monitor.end_copies == [1, 1, 1]  # the update ratios and the update rules' counts together


def test_update_values_in_the_batch_end_copy_as_read_alone() -> None:
    """``update_vector`` read with other values gives what the former ``update_values`` gave, bit for bit."""
    net, _, _ = _watched_net(3)
    named = list(net.named_parameters())
    params = [p for _, p in named]
    index = ParamIndex([n for n, _ in named], params, False, dict(net.named_modules()))
    pending_sets = []
    for chosen in ([0, 1, 2, 3, 4, 5], [0, 2, 4]):
        before = [params[i].detach().clone() for i in chosen]
        pending_sets.append((chosen, before))
    with torch.no_grad():
        params[0].add_(1e-3)
        params[3][0] = math.nan  # a NaN update
        params[4].mul_(1.0 + 2.0**-20)  # a tiny one
    copies: list[tuple[list[int], list[torch.Tensor], torch.Tensor | None]]
    copies = [(chosen, [b.clone() for b in before], None) for chosen, before in pending_sets]
    alone: dict[str, float] = {}
    for chosen, before, weight_squares in copies:
        alone.update(_former_update_ratios(index, chosen, before, weight_squares))
    copies = [(chosen, [b.clone() for b in before], None) for chosen, before in pending_sets]
    positions, vector = update_vector(index, copies, None)
    assert vector is not None
    counts = torch.tensor([3.0, 1.0])  # what the update rules read in the same copy
    host = torch.cat([counts, vector]).tolist()[2:]
    together = update_values_from(index, positions, host)
    assert together.keys() == alone.keys() and len(alone) == 6
    for key, value in alone.items():
        assert together[key] == value or (math.isnan(value) and math.isnan(together[key])), key


def _former_update_ratios(
    index: ParamIndex, chosen: list[int], before: list[torch.Tensor], weight_squares: torch.Tensor | None
) -> dict[str, float]:
    """``grad_measure.update_ratios`` as main ``83654a2`` had it (frozen; unsharded), read on its own."""
    layout = index.layout(chosen, before[0].device)
    after = [local_tensor(index.params[i]) for i in chosen]
    n = len(index.layers)
    with torch.no_grad():
        weight_sq = weight_squares if weight_squares is not None else per_tensor_norms(before).pow(2)
        torch._foreach_sub_(before, after)
        update_sq = per_tensor_norms(before).pow(2)
    both = torch.cat([grouped_squares(weight_sq, layout.group_of, n), grouped_squares(update_sq, layout.group_of, n)])
    weight, update = both.sqrt().split(n)
    ratio = update / weight.clamp_min(1e-12)
    w_host, r_host = torch.stack([weight, ratio]).tolist()
    values = {}
    for g in layout.present:
        values[weight_norm_tag(index.layers[g])] = w_host[g]
        values[update_ratio_tag(index.layers[g])] = r_host[g]
    return values
