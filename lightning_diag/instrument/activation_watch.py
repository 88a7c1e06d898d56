"""What the activation modules saw in one measured forward: dead ReLU units and saturated bounded activations.

:class:`ActivationWatch` asks for forward pre-hooks for one measured step (GradientFlowMonitor attaches it at the
start of a batch on its cadence and detaches it before the backward), through the trainer's driver's
:class:`~lightning_diag.instrument.forward_hooks.ForwardHooks` (one pre-hook per module, shared with any other watch
of the step): on every activation module it knows
(:data:`RELU_FAMILY`, :data:`LINEAR_RANGES`) and on every module that owns parameters, whose calls say which layer
an activation follows (the layer reported) and whether anything trainable runs after it. Each activation call
reduces its input on the device to one number; after the backward :meth:`ActivationWatch.readings` adds the share
of exactly-zero gradient entries of the layers' weights and copies everything to the host at once. Quiet steps
have no hook attached and cost nothing.

Exact quantities:

* ReLU family (``nn.ReLU``, ``nn.ReLU6``): the share of *units* whose input is ``<= 0`` (output exactly 0) for
  every row of the batch. A unit is a channel (dimension 1) of a 4-D or 5-D input, and of a 3-D one after a
  convolution or a norm over channels (``BatchNorm``, ``GroupNorm``, ``InstanceNorm``); otherwise an output
  feature (the last dimension). The rows are all other positions of all samples. With fewer than
  :data:`MIN_ROWS` rows (batch size 1 on a plain MLP) the share is not measured: a unit inactive for one sample is
  not dead.
* Bounded activations: the share of input elements beyond the linear range of :data:`LINEAR_RANGES` (``nn.Tanh``
  ``|x| > 5``: slope below 1.8e-4; ``nn.Sigmoid`` ``|x| > 10``, the same point as ``tanh(x) = 2 sigmoid(2x) - 1``;
  ``nn.Hardsigmoid`` ``|x| >= 3`` and ``nn.Hardtanh`` outside ``[min_val, max_val]``: slope exactly 0). Measured
  only where a trainable layer runs after the activation: an output head's sigmoid saturates when the model is
  confident, which is not a fault.

A dead share also says whether a frozen layer ran before the activation's own layer in the forward (the layer
reads a frozen part's fixed features; ``dead_units`` then needs nearly every unit dead).

Activations after a frozen layer (no parameter requiring a gradient), with no layer before them, or on distributed
tensors (``DTensor``) are not measured; nor is a model that runs through ``torch.compile`` (the callback does not
attach the watch: hooks added and removed every measured step would recompile it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_diag.instrument.forward_hooks import ForwardHooks, ModuleHook
from lightning_diag.rules.records import ActivationReading
from lightning_diag.stats.grad import is_dtensor

__all__ = [
    "ALIVE_MAX_ELEMENTS",
    "LINEAR_RANGES",
    "MIN_ROWS",
    "RELU_FAMILY",
    "ActivationWatch",
    "WatchCall",
    "WatchStats",
]

#: Activations whose dead units are counted (output exactly 0 below 0).
RELU_FAMILY: tuple[type[nn.Module], ...] = (nn.ReLU, nn.ReLU6)
#: Bounded activations and ``|x|`` beyond which the input is saturated (``nn.Hardtanh`` uses its own range).
LINEAR_RANGES: dict[type[nn.Module], float] = {nn.Tanh: 5.0, nn.Sigmoid: 10.0, nn.Hardsigmoid: 3.0}
#: Rows (samples times positions) per unit below which dead units are not counted.
MIN_ROWS = 16
#: Elements of an activation's input up to which its units' activity is read from a copy's maxima rather than from a
#: boolean tensor (see ``_alive``).
ALIVE_MAX_ELEMENTS = 1 << 20

#: Layers whose outputs hold channels in dimension 1 (a 3-D output after them is ``(N, C, L)``, not ``(N, L, C)``).
_CHANNELS_FIRST = (
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm,
)  # fmt: skip


@dataclasses.dataclass
class WatchCall:
    """One activation call of the measured forward (its statistic still on the device)."""

    name: str
    layer: str
    activation: str
    dead: bool  # True: ``stat`` is a dead share; False: a saturated share
    stat: torch.Tensor
    order: int
    limit: float | None
    first: bool
    after_frozen: bool = False  # a frozen layer ran before this activation's layer in the forward


def _bounds(module: nn.Module) -> tuple[float, float] | None:
    """The linear range ``(low, high)`` of a bounded activation module, ``None`` for any other module."""
    if type(module) is nn.Hardtanh:  # not ReLU6 (a Hardtanh subclass): its lower side is the ReLU family's
        return float(module.min_val), float(module.max_val)
    for kind, bound in LINEAR_RANGES.items():
        if type(module) is kind:
            return -bound, bound
    return None


class ActivationWatch:
    """The hooks and device statistics of one measured forward.

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
        >>> with torch.no_grad():
        ...     _ = net[0].bias.fill_(-100.0)
        >>> watch = ActivationWatch()
        >>> watch.attach(net)
        >>> net(torch.randn(32, 4)).sum().backward()
        >>> watch.detach()
        >>> readings, rms = watch.readings(dict(net.named_modules()))
        >>> [(r.layer, r.activation, r.dead, r.saturated) for r in readings]
        [('0', 'ReLU', 1.0, None), ('2', 'Tanh', None, 0.0)]
    """

    def __init__(self) -> None:
        self._hooks: ForwardHooks | None = None  # the set this watch asked, while attached
        self._own: ForwardHooks | None = None  # the set of a watch attached without one (built when first needed)
        self._calls: list[WatchCall] = []
        self._layers: list[tuple[str, bool]] = []  # (module name, trainable) of each parameter-owning call
        self._input_sq: torch.Tensor | None = None
        self._modules: dict[str, nn.Module] = {}  # {name: module} of the model the hooks were attached to
        #: Whether a ReLU-family call of the last forward had too few rows to count dead units.
        self.too_few_rows = False

    @property
    def attached(self) -> bool:
        """Whether hooks are attached (a measured forward is under way)."""
        return self._hooks is not None

    @property
    def pending(self) -> bool:
        """Whether a measured forward left statistics that :meth:`readings` has not read."""
        return bool(self._calls)

    def attach(self, module: nn.Module, hooks: ForwardHooks | None = None) -> None:
        """Attach the pre-hooks for the next forward (nothing when the model has no activation module watched).

        Args:
            module: The model.
            hooks: The set whose one pre-hook per module calls this watch's (the driver's); ``None``: one of its own.
        """
        self.detach()
        self._calls, self._layers, self._input_sq, self.too_few_rows = [], [], None, False
        named = list(module.named_modules())  # one walk of the model per measured step
        self._modules = dict(named)
        watched = [(name, sub) for name, sub in named if isinstance(sub, RELU_FAMILY) or _bounds(sub)]
        if not watched:
            return
        if hooks is None:
            hooks = self._own = self._own or ForwardHooks()
        self._hooks = hooks
        for name, sub in named:
            params = list(sub.parameters(recurse=False))
            if params:
                trainable = any(p.requires_grad for p in params)
                hooks.ask(self, ModuleHook.INPUTS, sub, self._layer_hook(name, trainable))
        convs = frozenset(name for name, sub in named if isinstance(sub, _CHANNELS_FIRST))
        for name, sub in watched:
            hooks.ask(self, ModuleHook.INPUTS, sub, self._activation_hook(name, convs))

    def detach(self) -> None:
        """Remove the hooks (the statistics stay until :meth:`readings`)."""
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.leave(self)

    def _layer_hook(self, name: str, trainable: bool) -> Callable[..., None]:
        def pre_hook(module: nn.Module, inputs: Any) -> None:
            if not self._layers:
                x = inputs[0] if isinstance(inputs, tuple) and inputs else None
                if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel() and not is_dtensor(x):
                    with torch.no_grad():  # outside autograd, not detach()-ed: one operator fewer
                        self._input_sq = x.float().pow(2).mean()
            self._layers.append((name, trainable))

        return pre_hook

    def _activation_hook(self, name: str, convs: frozenset[str]) -> Callable[..., None]:
        def pre_hook(module: nn.Module, inputs: Any) -> None:
            x = inputs[0] if isinstance(inputs, tuple) and inputs else None
            if not self._layers or not isinstance(x, torch.Tensor) or not x.is_floating_point():
                return
            layer, trainable = self._layers[-1]
            if not trainable or is_dtensor(x) or x.ndim < 2 or x.numel() == 0:
                return
            first = not self._calls and len(self._layers) == 1
            with torch.no_grad():  # the statistics read x outside autograd (not from a detach()-ed view)
                self._measure(module, name, layer, x, first, convs)

        return pre_hook

    def _measure(
        self, module: nn.Module, name: str, layer: str, x: torch.Tensor, first: bool, convs: frozenset[str]
    ) -> None:
        """One activation call's statistic (on the device), kept for :meth:`readings`."""
        bounds = _bounds(module)
        if bounds is None:
            # images and volumes (N, C, H, W...) hold channels in dimension 1; a 3-D tensor does after a
            # convolution or a norm over channels, else it is (N, L, C) (a sequence through a linear layer)
            dim = 1 if x.ndim >= 4 or (x.ndim == 3 and layer in convs) else x.ndim - 1
            units = x.shape[dim]
            if x.numel() // units < MIN_ROWS:
                self.too_few_rows = True
                return
            stat = 1.0 - _alive(x, dim).float().mean()
            kind = type(module).__name__
            after_frozen = not all(t for _, t in self._layers)
            self._calls.append(
                WatchCall(name, layer, kind, True, stat, len(self._layers), None, first, after_frozen)
            )
            return
        low, high = bounds
        stat = ((x < low) | (x > high)).float().mean()
        limit = high if -low == high else None
        self._calls.append(
            WatchCall(name, layer, type(module).__name__, False, stat, len(self._layers), limit, first)
        )

    def readings(self, modules: dict[str, nn.Module] | None = None) -> tuple[list[ActivationReading], float | None]:
        """The readings of the measured forward (after its backward: the layers' weight gradients are read too)
        and the RMS of the model's inputs, with one host copy; the statistics are consumed.

        :meth:`take` and :meth:`finish` in one: a caller with a host copy of its own reads ``take().values`` in it.

        Args:
            modules: ``{name: module}`` of the model (``named_modules()``), to find each layer's weight; ``None``:
                those of the model :meth:`attach` walked (the same forward's).
        """
        taken = self.take(modules)
        return self.finish(taken, taken.values.tolist() if taken.values is not None else [])

    def take(self, modules: dict[str, nn.Module] | None = None) -> WatchStats:
        """The measured forward's statistics on the device, with the layers' zero-gradient shares (after the
        backward), as one float32 vector to read on the host with the caller's other values; consumed here.

        Args:
            modules: As for :meth:`readings`.
        """
        calls, self._calls = self._calls, []
        layers, self._layers = self._layers, []
        input_sq, self._input_sq = self._input_sq, None
        if modules is None:
            modules = self._modules
        self._modules = {}
        if not calls:
            return WatchStats(calls, layers, [], False, None)
        # each statistic is a float32 0-d tensor already (a mean): no reshape or conversion dispatched for it
        stats = [c.stat if c.stat.ndim == 0 and c.stat.dtype is torch.float32 else c.stat.reshape(()).float()
                 for c in calls]
        grad_layers = sorted({c.layer for c in calls if c.dead})
        zero: list[str] = []
        with torch.no_grad():  # the gradients read outside autograd (not from detach()-ed views)
            for layer in grad_layers:
                weight = getattr(modules.get(layer), "weight", None)
                if isinstance(weight, torch.Tensor) and weight.grad is not None and not is_dtensor(weight.grad):
                    zero.append(layer)
                    stats.append(_zero_share(weight.grad).to(stats[0].device))
        if input_sq is not None:
            stats.append(input_sq.to(stats[0].device))
        return WatchStats(calls, layers, zero, input_sq is not None, torch.stack(stats))

    @staticmethod
    def finish(taken: WatchStats, host: list[float]) -> tuple[list[ActivationReading], float | None]:
        """The readings and the inputs' RMS from :meth:`take`'s statistics and their host values ``host`` (of
        ``taken.values``, in order)."""
        calls, layers, zero = taken.calls, taken.layers, taken.zero
        if not calls:
            return [], None
        zero_shares = dict(zip(zero, host[len(calls) : len(calls) + len(zero)], strict=True))
        input_rms = host[-1] ** 0.5 if taken.has_input else None
        out = []
        for c, value in zip(calls, host[: len(calls)], strict=True):
            if c.dead:
                out.append(ActivationReading(c.layer, c.activation, dead=value, zero_grad=zero_shares.get(c.layer),
                                             first=c.first, after_frozen=c.after_frozen))
            elif any(trainable for _, trainable in layers[c.order :]):  # a trainable layer runs after it
                out.append(ActivationReading(c.layer, c.activation, saturated=value, limit=c.limit, first=c.first))
        return out, input_rms


@dataclasses.dataclass
class WatchStats:
    """What :meth:`ActivationWatch.take` consumed: the calls and layers of the measured forward, the layers whose
    zero-gradient share was measured, and all statistics as one float32 vector on the device (``None`` when the
    forward left none): each call's, then the zero shares, then the inputs' mean square when ``has_input``."""

    calls: list[WatchCall]
    layers: list[tuple[str, bool]]
    zero: list[str]
    has_input: bool
    values: torch.Tensor | None


def _alive(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Per unit (index of dimension ``dim``) whether any of its values is ``> 0``: ``(x > 0)`` reduced with ``any``
    over the other dimensions.

    Up to :data:`ALIVE_MAX_ELEMENTS` elements from the maximum over the other dimensions of ``x`` with NaN read as 0
    (not ``> 0``, as in ``x > 0``; an infinity becomes the dtype's largest finite value of its sign): one fused pass
    (17 against 56 µs for a 64 x 600 float32 input on one CPU thread: ``any`` reduces slowly). Larger inputs (a
    convolution's feature maps): the boolean tensor, whose temporary is one byte per element instead of the copy's.

    Example:
        >>> x = torch.tensor([[0.0, float("nan"), -1.0], [float("nan"), 2.0, -0.0]])
        >>> _alive(x, 1).tolist() == (x > 0).any(0).tolist() == [False, True, False]
        True
    """
    if x.numel() <= ALIVE_MAX_ELEMENTS:
        return torch.nan_to_num(x, nan=0.0).amax([d for d in range(x.ndim) if d != dim]) > 0
    return (x > 0).movedim(dim, -1).reshape(-1, x.shape[dim]).any(0)


def _zero_share(grad: torch.Tensor) -> torch.Tensor:
    """The share of exactly-zero entries of ``grad``, as a float32 0-d tensor: ``(grad == 0).float().mean()``,
    whose float32 sum of ones is exact below 2**24 elements, counted there without the float32 copy (5x faster on
    the CPU: 0.11 against 0.52 ms for a 600 x 600 gradient, one thread), the same value.

    The nonzero entries are counted with ``count_nonzero`` of the boolean tensor, not its ``sum()``: the sum of a
    boolean tensor first converts it to a fresh int64 tensor (2.9 MB for a 600 x 600 gradient), whose new pages the
    kernel zero-fills on the CPU (1.7 against 0.4 ms for the MLP's four 600-wide gradients when that memory was handed
    back to the system in between, as it is between two measuring steps); the count is the same integer.

    Example:
        >>> g = torch.tensor([[0.0, 1.0, -0.0], [float("nan"), 2.0, 0.0]])
        >>> _zero_share(g).item() == (g == 0).float().mean().item()
        True
    """
    n = grad.numel()
    if n == 0 or n >= 1 << 24:
        return (grad == 0).float().mean()
    return (n - _count_true(grad.bool().reshape(-1))).float().div_(n)  # bool(): False for +-0 only (NaN is True)


#: Words of 8 flags added together in one group by :func:`_count_true`: each byte of their sum stays at most 255.
_WORDS_PER_GROUP = 255


def _count_true(flags: torch.Tensor) -> torch.Tensor:
    """The number of ``True`` entries of a 1-D contiguous bool tensor, as an int64 0-d tensor: ``count_nonzero``'s
    integer, counted 8 flags at a time.

    A bool is one byte, 0 or 1: the flags' bytes are read as int64 words, and the words are added in groups of
    :data:`_WORDS_PER_GROUP` (255: each byte of a group's sum counts at most 255 flags, so no byte carries into the
    next), then the bytes of the groups' sums are added; the few flags left over are summed plainly. Integer sums,
    so exactly ``count_nonzero``'s count, with no copy of the flags (on the CPU 20-30 µs instead of about 100 for a
    600 x 600 gradient's flags; ``sum()`` of a bool tensor first converts it to int64). Flags that cannot be read as
    whole words (not contiguous, or starting inside a word) are counted by ``count_nonzero``.

    Example:
        >>> flags = torch.rand(100_000, generator=torch.Generator().manual_seed(0)) < 0.3
        >>> _count_true(flags).item() == torch.count_nonzero(flags).item()
        True
    """
    groups = flags.numel() // (8 * _WORDS_PER_GROUP)
    if groups == 0 or not flags.is_contiguous() or flags.storage_offset() % 8:  # not readable as whole words
        return torch.count_nonzero(flags)
    grouped = groups * 8 * _WORDS_PER_GROUP
    words = flags[:grouped].view(torch.uint8).view(torch.int64).view(_WORDS_PER_GROUP, groups)
    total = words.sum(0).view(torch.uint8).sum()
    if grouped < flags.numel():
        total += torch.count_nonzero(flags[grouped:])
    return total
