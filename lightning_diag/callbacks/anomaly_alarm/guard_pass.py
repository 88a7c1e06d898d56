"""The non-finite guard's pass over one optimizer's parameters (:class:`OptimizerPass`): their gradients listed,
one fused check of them and the step's losses, one read of its flag, as ``GradScaler`` checks before an update."""

from __future__ import annotations

import operator
from typing import Any, cast

import torch

from lightning_diag.instrument.grad_measure import GradientSquares
from lightning_diag.stats.grad import is_dtensor, local_tensor
from lightning_diag.stats.norms import finite_probe, sums_pay

__all__ = ["OptimizerPass"]

_GRAD = operator.attrgetter("grad")


class OptimizerPass:
    """An optimizer's parameters as the guard reads them each step: the flat list, whether any is a DTensor
    (sharded training: a parameter does not change kind during a fit), and the reused 1-element flag of the pass
    on their device."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        self.lists = [(group["params"], len(group["params"])) for group in groups]
        # The usual single group: its parameter list and length, compared without a loop.
        self.single = self.lists[0] if len(groups) == 1 else None
        self.flat: list[torch.nn.Parameter] = [p for group in groups for p in group["params"]]
        self.sharded = any(is_dtensor(p) for p in self.flat)
        # which CPU pass pays (the step's loss counted): decided once for the list, not counted at every step
        self.sums = sums_pay([local_tensor(p) for p in self.flat], extra=1)
        device = local_tensor(self.flat[0]).device if self.flat else torch.device("cpu")
        self.found = torch.zeros(1, device=device)
        # On the CPU, the flag's memory as a Python buffer: one float read without a dispatched `.item()`
        self._view = _view(self.found)

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (``ddp_spawn`` sends the callbacks to its processes): the buffer is made again from the flag."""
        return {**self.__dict__, "_view": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._view = _view(self.found)

    def gradients(self) -> list[torch.Tensor]:
        """The parameters' gradients, those that have one, in order."""
        return [g for g in map(_GRAD, self.flat) if g is not None]

    def clean(self, losses: list[torch.Tensor]) -> bool:
        """The pass of a quiet step, as ``GradScaler`` makes its own (list the gradients, one fused check, one read
        of its flag), for parameters that are not sharded: whether every gradient and each of ``losses`` is finite.
        ``False`` also when no parameter has a gradient or the pass failed (its flag is then left set): the full
        check finds out which. Large CPU gradients (:attr:`sums`) are decided from their sums on the host when these
        prove them finite (:func:`_sums_prove_finite`), the flag left at 0."""
        grads = self.gradients()
        if not grads:
            return False
        tensors = grads + losses if losses else grads
        if self.sums and self._view is not None and _sums_prove_finite(tensors):
            return True
        return self._read(finite_probe(tensors, self.found, self.sums))

    def clean_measured(self, losses: list[torch.Tensor], known: GradientSquares) -> bool | None:
        """:meth:`clean` on a step whose gradients' squared norms the driver measures for every reader (a measuring
        step of ``GradientFlowMonitor``, which requests them): when ``known`` covers exactly these gradients,
        unchanged, on the flag's device,
        their sum stands for the pass over the gradients (0 times it is 0 only when every gradient is finite; an
        overflow fails it, and the full check decides) and only ``losses`` are read. ``None`` when ``known`` does
        not cover them: :meth:`clean` then makes its own pass.

        When the host total read with them proves their sum finite (:meth:`GradientSquares.proves_finite`) and the
        losses' sums prove them finite (CPU losses, as in :meth:`clean`), the step is clean without an operator on
        the squares (the flag left as it is, as there): the answer the flag would give. Otherwise the flag decides."""
        grads = self.gradients()
        if not grads or known.squares.device != self.found.device or not known.covers(grads):
            return None
        if known.proves_finite() and (not losses or _sums_prove_finite(losses)):
            return True
        flag = torch.sum(known.squares, 0, True, out=self.found).mul_(0)
        if losses:
            flag.add_(finite_probe(losses).to(flag.device))
        return self._read(flag)

    def _read(self, flag: torch.Tensor) -> bool:
        """Whether the pass's ``flag`` says clean: read from the CPU flag's memory when it is the reused flag."""
        view = self._view
        return view[0] == 0 if view is not None and flag is self.found else flag.item() == 0

    def matches(self, groups: list[dict[str, Any]]) -> bool:
        """Whether ``groups`` still hold the same parameter lists, of the same lengths."""
        single = self.single
        if single is not None:
            if len(groups) != 1:
                return False
            params = groups[0]["params"]
            return params is single[0] and len(params) == single[1]
        return len(groups) == len(self.lists) and all(
            group["params"] is params and len(params) == n
            for group, (params, n) in zip(groups, self.lists, strict=True)
        )


#: A sum of float32 values whose magnitudes add up to less than this is finite in float32, in whatever order it is
#: added (the largest float32 is 3.4e38; each rounding of a partial sum adds at most a relative 2**-24).
_NO_OVERFLOW = 1e38


def _sums_prove_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether the CPU ``tensors``' float32 sums (``finite_probe``'s) prove every element finite, decided on the
    host: their magnitudes add up to less than :data:`_NO_OVERFLOW`, so their float32 total, which ``finite_probe``
    multiplies by 0, is finite too. ``False`` (a NaN/Inf, a total that might overflow, tensors a sum refuses):
    ``finite_probe`` decides, as before. The same answer as ``finite_probe`` whenever this says ``True``, without its
    three operators on the sums (stack, total, times 0: a few µs each warm, 20-50 µs in a fit, where the pass over
    the gradients has just pushed the dispatcher's code out of the caches)."""
    total = 0.0
    for t in tensors:
        if not t.is_cpu:  # a model across devices: no host read of another device's sum here
            return False
        try:
            # `tolist` of a 0-d tensor: its float, read without an operator (no stack, no dispatched `item`)
            total += abs(cast(float, t.sum(dtype=torch.float32).tolist()))
        except RuntimeError:  # a sum refuses the tensor (of a dtype it does not take)
            return False
    return total < _NO_OVERFLOW  # NaN and inf compare False


def _view(flag: torch.Tensor) -> memoryview | None:
    """A CPU flag's memory as a Python buffer (reads its value without a dispatched operator); ``None`` elsewhere."""
    return flag.numpy().data if flag.device.type == "cpu" else None
