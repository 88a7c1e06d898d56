"""One forward pre-hook and one forward hook per module for a hooked forward, shared by every watch (issue 43).

The watches that read a forward (``GradientFlowMonitor``'s :class:`~lightning_diag.instrument.activation_watch.
ActivationWatch`: the modules' inputs; ``AnomalyAlarm``'s :class:`~lightning_diag.instrument.output_watch.
ZeroOutputWatch` and :class:`~lightning_diag.instrument.output_watch.OutputSpreadWatch`: the modules' outputs) do not
register hooks of their own: each asks a :class:`ForwardHooks` for the modules it reads, naming the hook point from the
closed set :class:`ModuleHook`. The set registers at most one hook per module and point (``register_forward_pre_hook`` /
``register_forward_hook``: handles of ours, nothing patched), whose call dispatches to the functions of every watch
that asked for that module, in the order they asked. A watch leaves with :meth:`ForwardHooks.leave`; a module's hook
comes off when no watch reads it any more, so a quiet step has none, as before.

The trainer's driver holds one set (:class:`~lightning_diag.callbacks.common.shared.SharedMeasurements`'s ``hooks``):
on a step where several watches read the forward (the activation watch and the alarm's sampled checks, whose steps
are the logging cadence's), each module is called through one hook per point. A watch used without a driver (a
benchmark, a doctest) gets a set of its own.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["ForwardHooks", "ModuleHook"]


class ModuleHook(enum.Enum):
    """The closed set of hook points a watch may ask for on a module."""

    #: The module's positional inputs, before its forward (``fn(module, args)``, a forward pre-hook).
    INPUTS = "inputs"
    #: The module's output, after its forward and its own hooks registered before (``fn(module, args, output)``).
    OUTPUTS = "outputs"


class _ModuleCalls:
    """One module's hook at one point: its handle, and each watch's function with its watch, in the order asked."""

    __slots__ = ("fns", "handle", "owners")

    def __init__(self) -> None:
        self.fns: list[Callable[..., None]] = []
        self.owners: list[object] = []
        self.handle: RemovableHandle | None = None


class ForwardHooks:
    """At most one forward pre-hook and one forward hook per module, each dispatching to the watches that asked.

    Example:
        >>> import torch
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> hooks, seen = ForwardHooks(), []
        >>> a, b = object(), object()
        >>> hooks.ask(a, ModuleHook.OUTPUTS, net[1], lambda m, args, out: seen.append("a"))
        >>> hooks.ask(b, ModuleHook.OUTPUTS, net[1], lambda m, args, out: seen.append("b"))
        >>> len(net[1]._forward_hooks), hooks.hooked(ModuleHook.OUTPUTS)  # one hook serves both
        (1, 1)
        >>> _ = net(torch.ones(1, 2)); seen
        ['a', 'b']
        >>> hooks.leave(a); hooks.leave(b); len(net[1]._forward_hooks), hooks.active
        (0, False)
    """

    def __init__(self) -> None:
        # (point, id(module)) -> the module's calls at that point (the module itself is held by its handle's hook)
        self._calls: dict[tuple[ModuleHook, int], _ModuleCalls] = {}

    @property
    def active(self) -> bool:
        """Whether a hook is registered."""
        return bool(self._calls)

    def hooked(self, point: ModuleHook) -> int:
        """The number of modules with a hook at ``point`` (read by the tests)."""
        return sum(1 for kind, _ in self._calls if kind is point)

    def ask(self, owner: object, point: ModuleHook, module: nn.Module, fn: Callable[..., None]) -> None:
        """Have ``fn`` called at ``point`` of every call of ``module`` until ``owner`` leaves: after the functions
        asked before it on that module, through the module's one hook at that point (registered now if it has
        none). ``fn`` returns ``None``: a watch reads, it never replaces an input or an output."""
        key = (point, id(module))
        calls = self._calls.get(key)
        if calls is None:
            calls = self._calls[key] = _ModuleCalls()
            fns = calls.fns
            if point is ModuleHook.INPUTS:
                calls.handle = module.register_forward_pre_hook(_pre_hook(fns))
            else:
                calls.handle = module.register_forward_hook(_post_hook(fns))
        calls.fns.append(fn)
        calls.owners.append(owner)

    def leave(self, owner: object) -> None:
        """Drop ``owner``'s functions; the hook of a module no other watch reads at that point comes off."""
        for key, calls in list(self._calls.items()):
            if owner not in calls.owners:
                continue
            kept = [(o, f) for o, f in zip(calls.owners, calls.fns, strict=True) if o is not owner]
            calls.owners[:] = [o for o, _ in kept]
            calls.fns[:] = [f for _, f in kept]  # in place: the registered hook reads this list
            if not kept:
                if calls.handle is not None:
                    calls.handle.remove()
                del self._calls[key]

    def holds(self, owner: object) -> bool:
        """Whether ``owner`` reads any module now."""
        return any(owner in calls.owners for calls in self._calls.values())

    def clear(self) -> None:
        """Remove every hook (a new fit: nothing of an earlier one stays)."""
        for calls in self._calls.values():
            if calls.handle is not None:
                calls.handle.remove()
        self._calls = {}


def _pre_hook(fns: list[Callable[..., None]]) -> Callable[[nn.Module, Any], None]:
    """The one forward pre-hook of a module: each watch's function, in order."""

    def pre_hook(module: nn.Module, args: Any) -> None:
        for fn in fns:
            fn(module, args)

    return pre_hook


def _post_hook(fns: list[Callable[..., None]]) -> Callable[[nn.Module, Any, Any], None]:
    """The one forward hook of a module: each watch's function, in order."""

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        for fn in fns:
            fn(module, args, output)

    return hook
