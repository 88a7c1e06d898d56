"""GradientFlowMonitor's opt-in activation-gradient norms: forward hooks, attached only for a measured step,
that sum the squared gradient of each chosen module's output over the step's micro-batches on the device.

Tensor parallelism: a module with DTensor parameters gets its hook first (``prepend``), so it sees the output
while it is still a DTensor (before ``ColwiseParallel`` turns it into this rank's slice of the channels); the
gradient's local squares are summed, and :meth:`ActivationGradients.flush` all-reduces them over the mesh
dimensions that shard the gradient (every rank flushes on the same step), so the norm is that of the full
activation gradient, not of one rank's slice. Under FSDP2 (plain outputs) and DDP each rank measures its own
batch's activations, as before."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_diag.stats.grad import is_dtensor

__all__ = ["ActivationGradients"]


class ActivationGradients:
    """The hooks and running sums of one measured step.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
        >>> acts = ActivationGradients()
        >>> acts.attach(net, True, lambda key, message: None)
        >>> net(torch.ones(4, 3)).sum().backward()
        >>> sorted(acts.flush()), acts.attached
        (['0', '2'], False)
    """

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self._sq: dict[str, torch.Tensor] = {}
        self._sharded: dict[str, tuple[Any, tuple[int, ...]]] = {}  # name -> (mesh, dims sharding its gradient)

    @property
    def attached(self) -> bool:
        """Whether hooks are attached (a measured step is under way)."""
        return bool(self._handles)

    @staticmethod
    def modules(module: torch.nn.Module, which: bool | Sequence[str]) -> list[tuple[str, torch.nn.Module]]:
        """The submodules measured: with ``True`` every one that owns parameters, else those whose names match
        one of the ``fnmatch`` patterns ``which``."""
        out = []
        for name, sub in module.named_modules():
            if not name:
                continue
            if which is True:
                if any(True for _ in sub.parameters(recurse=False)):
                    out.append((name, sub))
            elif any(fnmatch.fnmatchcase(name, pat) for pat in which):  # type: ignore[union-attr]
                out.append((name, sub))
        return out

    def attach(self, module: torch.nn.Module, which: bool | Sequence[str], notice: Callable[[str, str], None]) -> None:
        """Attach a forward hook to each measured submodule; ``notice(key, message)`` reports an output whose
        gradient cannot be hooked."""
        for name, sub in self.modules(module, which):
            first = any(is_dtensor(p) for p in sub.parameters(recurse=False))
            self._handles.append(sub.register_forward_hook(self._forward_hook(name, notice), prepend=first))

    def _forward_hook(self, name: str, notice: Callable[[str, str], None]) -> Callable[..., None]:
        def forward_hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) and output else output
            if not isinstance(out, torch.Tensor) or not out.requires_grad:
                return
            try:
                out.register_hook(lambda grad: self._add(name, grad))
            except RuntimeError as err:
                notice(f"act:{name}", f"no activation gradient for `{name}`: {err}")

        return forward_hook

    def _add(self, name: str, grad: torch.Tensor) -> None:
        if is_dtensor(grad):
            dims = tuple(i for i, p in enumerate(grad.placements) if p.is_shard())  # type: ignore[attr-defined]
            if dims:
                self._sharded[name] = (grad.device_mesh, dims)  # type: ignore[attr-defined]
            grad = grad.to_local()  # type: ignore[attr-defined]
        sq = grad.detach().float().pow(2).sum()
        self._sq[name] = self._sq[name] + sq if name in self._sq else sq

    def detach(self) -> None:
        """Remove the hooks and drop what they summed, without reading it (a fit that ended mid-step)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._sq = {}
        self._sharded = {}

    def flush(self) -> dict[str, float]:
        """Remove the hooks; return ``{module: L2 norm of its output's gradient}`` (one host copy; empty when no
        gradient arrived)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if not self._sq:
            return {}
        names = list(self._sq)
        squares = torch.stack([self._sq[n] for n in names])
        if self._sharded:
            import torch.distributed as dist

            groups: dict[tuple[int, tuple[int, ...]], list[int]] = {}
            for i, n in enumerate(names):
                if n in self._sharded:
                    mesh, dims = self._sharded[n]
                    groups.setdefault((id(mesh), dims), []).append(i)
            for (_, dims), idx in groups.items():
                mesh = self._sharded[names[idx[0]]][0]
                part = squares[idx].clone()
                for d in dims:
                    dist.all_reduce(part, group=mesh.get_group(d))
                squares[idx] = part
        values = squares.sqrt().tolist()
        self._sq = {}
        self._sharded = {}
        return dict(zip(names, values, strict=True))
