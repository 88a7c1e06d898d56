"""Which modules returned an all-zero output on one sampled step, measured on the device without changing it.

A transient corruption (a copy between devices or ranks that arrives as zeros) shows as a module whose output is exactly
zero on one step and non-zero on the others. :class:`ZeroOutputWatch` installs a forward hook on every module for one
training batch (after the module's own hooks, so it sees what they return): each call of a module of the model computes
``output.any()`` on the device (one reduction kernel, no host read), and :meth:`ZeroOutputWatch.counts` combines them
per module on the device, ready for one transfer (after a sum over ranks under data parallelism). Nothing is installed
on other steps.

Every module is watched, not only the leaves: a hand-off between two halves of a model (a pipeline stage, a
``.to(device)`` in a parent's ``forward``) is the output of the parent, whose children all returned non-zero tensors.
Loss modules (``nn.modules.loss._Loss``) are left out (a loss that reaches exactly zero has converged), so are outputs
with no element, integer outputs and a module's calls whose output is not a tensor (the first tensor of a tuple or list
output is taken).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.loss import _Loss
from torch.utils.hooks import RemovableHandle

from lightning_diag.stats.grad import local_tensor

__all__ = ["ZeroOutputWatch", "first_tensor"]


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
        self._calls: list[tuple[str, torch.Tensor]] = []
        self._handles: list[RemovableHandle] = []

    @property
    def active(self) -> bool:
        """Whether the hooks are installed."""
        return bool(self._handles)

    def start(self) -> None:
        """Install a forward hook on every watched module, after its own hooks (it sees the output they return)."""
        self._calls = []
        if not self._handles:
            self._handles = [m.register_forward_hook(self._hook(n)) for n, m in self.modules]

    def stop(self) -> None:
        """Remove the hooks; :meth:`counts` reads what they saw."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._seen(name, output)

        return hook

    def _seen(self, name: str, output: Any) -> None:
        out = first_tensor(output)
        if out is None or not out.is_floating_point() or out.numel() == 0:
            return
        with torch.no_grad():
            self._calls.append((name, local_tensor(out).detach().any()))

    def counts(self) -> torch.Tensor | None:
        """Per module of ``root`` (in :attr:`order`): ``[ran, all_zero]`` as a ``(2, modules)`` float tensor on the
        device (1 where it ran, 1 where every call returned zeros), ``None`` if no watched module ran. Summed over
        ranks it says on how many ranks each module ran and returned zeros. Clears what was seen."""
        calls, self._calls = self._calls, []
        if not calls:
            return None
        flags = torch.stack([flag for _, flag in calls]).float()
        index = torch.tensor([self.index[name] for name, _ in calls], device=flags.device)
        n = len(self.order)
        ran = torch.zeros(n, device=flags.device).index_add_(0, index, torch.ones_like(flags))
        nonzero = torch.zeros(n, device=flags.device).index_add_(0, index, flags)
        return torch.stack([(ran > 0).float(), ((ran > 0) & (nonzero == 0)).float()])
