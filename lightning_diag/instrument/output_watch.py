"""Which modules returned an all-zero output on one sampled step, measured on the device without changing it.

A transient corruption (a copy between devices or ranks that arrives as zeros) shows as a module whose output is exactly
zero on one step and non-zero on the others. :class:`ZeroOutputWatch` asks for a forward hook on every module for one
training batch (after the module's own hooks, so it sees what they return), through the trainer's driver's
:class:`~lightning_diag.instrument.forward_hooks.ForwardHooks` (one hook per module, shared with the other watches of
the step): each call of a module of the model takes
the minimum and maximum of its output on the device (NaN read as 1: one fused pass, no host read), which say whether it
is all zero (``not output.any()``) and whether it holds a negative value (``(output < 0).any()``), and
:meth:`ZeroOutputWatch.counts` combines them per module on the device, ready for one transfer (after a sum over ranks
under data parallelism). Nothing is installed on other steps.

Every module is watched, not only the leaves: a hand-off between two halves of a model (a pipeline stage, a
``.to(device)`` in a parent's ``forward``) is the output of the parent, whose children all returned non-zero tensors.
Loss modules (``nn.modules.loss._Loss``) are left out (a loss that reaches exactly zero has converged), so are outputs
with no element, integer outputs and a module's calls whose output is not a tensor (the first tensor of a tuple or list
output is taken).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.loss import _Loss

from lightning_diag.instrument.forward_hooks import ForwardHooks, ModuleHook
from lightning_diag.stats.grad import local_tensor

__all__ = [
    "EXTREMES_MAX_ELEMENTS",
    "MAX_SPREAD_ELEMENTS",
    "OutputSpreadWatch",
    "ZeroOutputWatch",
    "first_tensor",
    "prediction_tensor",
    "spread_level",
]

#: Elements of one sample's output read by :func:`spread_level` at most (an evenly strided subset beyond).
MAX_SPREAD_ELEMENTS = 65536
#: Elements of a module's output up to which :class:`ZeroOutputWatch` reads its extremes (a copy of the output)
#: rather than two boolean reductions (a temporary of one byte per element).
EXTREMES_MAX_ELEMENTS = 1 << 20
#: Keys of a mapping output that hold the predictions, in the order they are looked for.
_PREDICTION_KEYS = ("logits", "preds", "predictions")


def first_tensor(output: Any) -> torch.Tensor | None:
    """The output itself if it is a tensor, else the first tensor of a tuple, list or HF ``ModelOutput``-like
    mapping (``None`` if there is none).

    Example:
        >>> first_tensor((None, torch.ones(2))).tolist()
        [1.0, 1.0]
        >>> first_tensor("text") is None
        True
    """
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        for item in output:
            if isinstance(item, torch.Tensor):
                return item
    return None


class ZeroOutputWatch:
    """Per module of ``root``, whether each of its calls while active returned a non-zero floating-point output.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> with torch.no_grad():
        ...     _ = net[0].bias.fill_(-10.0)
        >>> watch = ZeroOutputWatch(net)
        >>> watch.start(); _ = net(torch.ones(1, 2)); watch.stop()
        >>> watch.order, watch.counts().tolist()  # the ReLU and the Sequential returned zeros
        (['', '0', '1'], [[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    """

    def __init__(self, root: nn.Module) -> None:
        self.modules = [(n, m) for n, m in root.named_modules() if not isinstance(m, _Loss)]
        #: The watched modules' names, in module order, and their positions in :meth:`counts`.
        self.order = [n for n, _ in self.modules]
        self.index = {name: i for i, name in enumerate(self.order)}
        self._calls: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (module, low, high): see `_extremes`
        self._hooks: ForwardHooks | None = None  # the set this watch asked, while active
        # by the modules' calls in order (the same every sampled step of a fit): their positions, and which ran
        self._layouts: dict[tuple[str, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @property
    def active(self) -> bool:
        """Whether the hooks are installed."""
        return self._hooks is not None

    def start(self, hooks: ForwardHooks | None = None) -> None:
        """Watch every watched module's output, after its own hooks (it sees the output they return).

        Args:
            hooks: The set whose one forward hook per module calls this watch's (the driver's); ``None``: one of its
                own.
        """
        self._calls = []
        if self._hooks is None:
            self._hooks = hooks = ForwardHooks() if hooks is None else hooks
            for n, m in self.modules:
                hooks.ask(self, ModuleHook.OUTPUTS, m, self._hook(n))

    def stop(self) -> None:
        """Remove the hooks; :meth:`counts` or :meth:`extremes` reads what they saw."""
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.leave(self)

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._seen(name, output)

        return hook

    def _seen(self, name: str, output: Any) -> None:
        out = first_tensor(output)
        if out is None or not out.is_floating_point() or out.numel() == 0:
            return
        with torch.no_grad():  # outside autograd: no detach() needed (one operator fewer a call)
            self._calls.append((name, *_extremes(local_tensor(out))))

    def counts(self, signs: bool = False) -> torch.Tensor | None:
        """Per module of ``root`` (in :attr:`order`): ``[ran, all_zero]`` as a ``(2, modules)`` float tensor on the
        device (1 where it ran, 1 where every call returned zeros), ``None`` if no watched module ran. Summed over
        ranks it says on how many ranks each module ran and returned zeros. With ``signs``, a third row ``signed``:
        1 where a call returned a negative value (a rectifier's output never does). Clears what was seen."""
        calls, self._calls = self._calls, []
        if not calls:
            return None
        lows = torch.stack([low for _, low, _ in calls])
        flags = ((lows != 0) | (torch.stack([high for _, _, high in calls]) != 0)).float()  # a nonzero value (or NaN)
        index, ran, ran_row = self._layout(tuple(name for name, _, _ in calls), flags.device)
        n = len(self.order)
        if not signs:
            nonzero = torch.zeros(n, device=flags.device).index_add_(0, index, flags)
            return torch.stack([ran_row, (ran & (nonzero == 0)).float()])
        # both per-module sums in one index_add over the stacked flags (sums of ones: exact in any order)
        sums = torch.zeros(2, n, device=flags.device).index_add_(1, index, torch.stack([flags, (lows < 0).float()]))
        nonzero, negative = sums.unbind()
        return torch.stack([ran_row, (ran & (nonzero == 0)).float(), (negative > 0).float()])

    def extremes(self) -> tuple[tuple[str, ...], list[torch.Tensor]] | None:
        """What the calls seen returned, for :meth:`counts_of` once read to the host: the calls' module names (in
        call order) and their 0-d device extremes, the lows then the highs (see :func:`_extremes`), to be read with
        other numbers in one transfer (no operator here). ``None`` if no watched module ran. Clears what was seen.

        Example:
            >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
            >>> with torch.no_grad():
            ...     _ = net[0].bias.fill_(-10.0)
            >>> watch = ZeroOutputWatch(net)
            >>> watch.start(); _ = net(torch.ones(1, 2)); watch.stop()
            >>> names, values = watch.extremes()
            >>> watch.counts_of(names, torch.stack(values).tolist())  # ran, all zero, signed: ``counts(signs=True)``
            [[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]
        """
        calls, self._calls = self._calls, []
        if not calls:
            return None
        return tuple(name for name, _, _ in calls), [low for _, low, _ in calls] + [high for _, _, high in calls]

    def counts_of(self, names: Sequence[str], values: Sequence[float]) -> list[list[float]]:
        """:meth:`counts` with ``signs`` from :meth:`extremes`'s ``names`` and its values read to the host exactly
        (the lows, then the highs, of each call: a stack of them promotes to a dtype that holds each): the rows
        ``[ran, all_zero, signed]`` per module of :attr:`order`, as host lists (the same numbers)."""
        n = len(self.order)
        ran, nonzero, negative = [0.0] * n, [0.0] * n, [0.0] * n
        calls = len(names)
        for name, low, high in zip(names, values[:calls], values[calls:], strict=True):
            i = self.index[name]
            ran[i] = 1.0
            if low != 0 or high != 0:  # a nonzero value (or NaN, read as 1)
                nonzero[i] = 1.0
            if low < 0:
                negative[i] = 1.0
        return [ran, [r if not z else 0.0 for r, z in zip(ran, nonzero, strict=True)], negative]

    def _layout(self, names: tuple[str, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The modules' positions of the calls ``names``, whether each module ran (bool) and that as a float row:
        built once per sequence of calls and device, not at every sampled step."""
        layout = self._layouts.get(names)
        if layout is None or layout[0].device != device:
            if len(self._layouts) >= _MAX_LAYOUTS:  # a model whose calls vary from step to step: no growing cache
                self._layouts.clear()
            index = torch.tensor([self.index[name] for name in names], device=device)
            ran = torch.zeros(len(self.order), dtype=torch.bool, device=device)
            ran[index] = True
            layout = self._layouts[names] = (index, ran, ran.float())
        return layout


#: Sequences of module calls whose layout :class:`ZeroOutputWatch` keeps (a fit has one, or a few).
_MAX_LAYOUTS = 8


def _extremes(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """0-d device tensors ``(low, high)`` of a floating-point output, no host read: ``low < 0`` exactly when a value
    is negative (``(values < 0).any()``), and ``low`` or ``high`` nonzero exactly when a value is nonzero or NaN
    (``values.any()``).

    Up to :data:`EXTREMES_MAX_ELEMENTS` elements: the minimum and maximum of the values with NaN read as 1 (nonzero,
    not negative; an infinity becomes the dtype's largest finite value of its sign), one fused pass over a copy
    (13 against 80 µs for a 64 x 600 float32 output on one CPU thread: ``any`` reads a float tensor slowly). Larger
    outputs (a language model's logits): ``-(values < 0).any()`` and ``values.any()`` as floats, whose temporary is
    one byte per element instead of the copy's.

    Example:
        >>> low, high = _extremes(torch.tensor([0.0, -0.0, float("nan")]))
        >>> bool(low < 0), bool((low != 0) | (high != 0))
        (False, True)
    """
    if values.numel() <= EXTREMES_MAX_ELEMENTS:
        low, high = torch.aminmax(torch.nan_to_num(values, nan=1.0))
        return low, high
    return -(values < 0).any().float(), values.any().float()


def prediction_tensor(output: Any) -> torch.Tensor | None:
    """The predictions in a module's output: a ``logits`` / ``preds`` / ``predictions`` entry of a mapping (a Hugging
    Face ``ModelOutput``), else the first tensor with a batch dimension (a 0-d loss is skipped); ``None`` if none.

    Example:
        >>> prediction_tensor({"loss": torch.tensor(1.0), "logits": torch.ones(2, 3)}).shape
        torch.Size([2, 3])
        >>> prediction_tensor((torch.tensor(0.5), torch.zeros(4))).shape
        torch.Size([4])
    """
    if isinstance(output, torch.Tensor):
        return output if output.dim() else None
    if isinstance(output, Mapping):
        for key in _PREDICTION_KEYS:
            value = output.get(key)
            if isinstance(value, torch.Tensor) and value.dim():
                return value
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        for item in output:
            if isinstance(item, torch.Tensor) and item.dim():
                return item
    return None


def spread_level(output: torch.Tensor, max_elements: int = MAX_SPREAD_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """``(spread, level)`` of one output ``[B, ...]``, 0-d float32 tensors on its device (no host read): ``spread``
    is the standard deviation across the batch of each output element, averaged over the elements, ``level`` the
    mean absolute value across the batch of each element, averaged likewise. Of a sample with more than
    ``max_elements`` elements (a language model's logits) an evenly strided subset of about that many is read, so
    the float32 copy stays small.

    Example:
        >>> [t.item() for t in spread_level(torch.tensor([[1.0, 2.0], [3.0, 2.0]]))]
        [0.5, 2.0]
    """
    with torch.no_grad():  # no graph: no detach() needed (one operator fewer)
        flat = local_tensor(output).reshape(output.shape[0], -1)
        if flat.shape[1] > max_elements:
            flat = flat[:, :: -(-flat.shape[1] // max_elements)]
        flat = flat.float()
        spread = flat.std(0, unbiased=False).mean() if flat.shape[0] > 1 else flat.new_zeros(())
        return spread, flat.mean(0).abs().mean()


class OutputSpreadWatch:
    """The model's output on one sampled training batch: the ``LightningModule``'s own forward output, or, when
    the step does not call the ``LightningModule`` itself (``self.model(x)`` in ``training_step``), the output of
    the last of its direct children that ran (loss modules left out).

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 3))
        >>> watch = OutputSpreadWatch(net)
        >>> watch.start(); _ = net(torch.ones(4, 2)); watch.stop()
        >>> name, batch, stats = watch.take()
        >>> name, batch, stats[0].item(), [v.item() for v in stats[2:]]  # equal inputs: no spread; the input's stats
        ('<root>', 4, 0.0, [0.0, 1.0])
    """

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.children = [(n, m) for n, m in root.named_children() if not isinstance(m, _Loss)]
        self._root_output: torch.Tensor | None = None
        self._child_output: tuple[str, torch.Tensor] | None = None
        self._root_input: torch.Tensor | None = None
        self._child_input: torch.Tensor | None = None
        self._hooks: ForwardHooks | None = None  # the set this watch asked, while active

    @property
    def active(self) -> bool:
        """Whether the hooks are installed."""
        return self._hooks is not None

    def start(self, hooks: ForwardHooks | None = None) -> None:
        """Hook the root and its direct children for one batch.

        Args:
            hooks: The set whose one forward hook per module calls this watch's (the driver's); ``None``: one of its
                own.
        """
        self._root_output = self._child_output = self._root_input = self._child_input = None
        if self._hooks is None:
            self._hooks = hooks = ForwardHooks() if hooks is None else hooks
            hooks.ask(self, ModuleHook.OUTPUTS, self.root, self._seen_root)
            for n, m in self.children:
                hooks.ask(self, ModuleHook.OUTPUTS, m, self._child_hook(n))

    def stop(self) -> None:
        """Remove the hooks."""
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.leave(self)

    def _seen_root(self, module: nn.Module, args: Any, output: Any) -> None:
        out = prediction_tensor(output)
        if out is not None:
            self._root_output = out.detach()  # a view: no kernel, and the graph is not held
            self._root_input = _float_input(args, out)

    def _child_hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            out = prediction_tensor(output)
            if out is not None:
                self._child_output = (name, out.detach())
                self._child_input = _float_input(args, out)

        return hook

    def take(self) -> tuple[str, int, list[torch.Tensor]] | None:
        """``(module name, batch, stats)`` of the output seen (``"<root>"`` for the ``LightningModule``), ``None``
        if no watched module returned predictions: ``batch`` is the output's batch size and ``stats`` 0-d float32
        device tensors, the output's spread and level (:func:`spread_level`), followed by the spread and level of
        the module's floating-point input of the same batch where its first argument is such a tensor (not token
        ids, not a mapping): two or four numbers, to be read with others in one transfer. Forgets what it saw."""
        root, child = self._root_output, self._child_output
        inputs = (self._root_input, self._child_input)
        self._root_output = self._child_output = self._root_input = self._child_input = None
        if root is not None:
            return "<root>", int(root.shape[0]), _with_input(root, inputs[0])
        if child is not None:
            return child[0], int(child[1].shape[0]), _with_input(child[1], inputs[1])
        return None


def _float_input(args: Any, output: torch.Tensor) -> torch.Tensor | None:
    """The module call's first argument when it is a floating-point tensor with the output's batch size."""
    first = args[0] if isinstance(args, tuple) and args else None
    usable = isinstance(first, torch.Tensor) and first.is_floating_point() and first.dim() and output.dim()
    return first.detach() if usable and first.shape[0] == output.shape[0] else None  # type: ignore[union-attr]


def _with_input(output: torch.Tensor, inputs: torch.Tensor | None) -> list[torch.Tensor]:
    """The spread and level of ``output`` and, with ``inputs``, of ``inputs`` (moved to the output's device): 0-d
    float32 tensors on the output's device."""
    parts = list(spread_level(output))
    if inputs is not None:
        parts += [part.to(parts[0].device) for part in spread_level(inputs)]
    return parts
