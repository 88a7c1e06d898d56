"""State with declared cross-process reductions, in the manner of torchmetrics' ``add_state(dist_reduce_fx=...)``.

A :class:`ReducedState` holds named values (Python numbers, 0-d tensors kept on the device, or lists for
``CAT``), each declared with the :class:`Reduction` that merges the values of several processes. Everything that
has to agree over ranks derives from the declaration: :meth:`ReducedState.merge` (two ranks' states into the
state over their union), :meth:`ReducedState.share` (a restored all-rank state split so that merging the
shares gives it back, whatever the world size) and the DDP adapter in ``lightning_diag.callbacks.common.reduction``.
Never imports Lightning.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["ReducedState", "Reduction", "StateSpec", "combine", "host_values"]


class Reduction(str, enum.Enum):
    """How the values of several processes merge into one."""

    SUM = "sum"
    MIN = "min"
    MAX = "max"
    #: Concatenation of lists (or 1-d tensors), in rank order.
    CAT = "cat"


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """One declared value: its name, its default (the identity of its reduction) and its reduction."""

    name: str
    default: Any
    reduction: Reduction


def _is_identity(value: Any, reduction: Reduction) -> bool:
    if reduction is Reduction.SUM:
        return isinstance(value, (int, float)) and value == 0
    if reduction is Reduction.CAT:
        return isinstance(value, (list, tuple)) and len(value) == 0
    if not isinstance(value, (int, float)):
        return False
    return value >= 2**52 if reduction is Reduction.MIN else value <= -(2**52)


def combine(reduction: Reduction, a: Any, b: Any) -> Any:
    """Merge two values by ``reduction`` (numbers, tensors, or lists/1-d tensors for ``CAT``).

    Example:
        >>> combine(Reduction.SUM, 1.5, 2.0), combine(Reduction.MIN, 3, 7), combine(Reduction.CAT, [1], [2, 3])
        (3.5, 3, [1, 2, 3])
    """
    if reduction is Reduction.CAT:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return torch.cat([torch.as_tensor(a).reshape(-1), torch.as_tensor(b).reshape(-1)])
        return [*a, *b]
    tensors = isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor)
    if reduction is Reduction.SUM:
        return a + b
    if tensors:
        pair = torch.broadcast_tensors(torch.as_tensor(a), torch.as_tensor(b))
        return torch.minimum(*pair) if reduction is Reduction.MIN else torch.maximum(*pair)
    return min(a, b) if reduction is Reduction.MIN else max(a, b)


class ReducedState:
    """Named values with declared reductions.

    Declare each value once with :meth:`add_state`; read and write it with ``state[name]``. Tensors may stay on
    the device (nothing here reads them back except :meth:`state_dict`).

    Example:
        >>> a, b = ReducedState(), ReducedState()
        >>> for s in (a, b):
        ...     s.add_state("loss_sum", 0.0, Reduction.SUM)
        ...     s.add_state("first_bad_step", float("inf"), Reduction.MIN)
        >>> a["loss_sum"], b["loss_sum"], b["first_bad_step"] = 1.0, 2.5, 7
        >>> a.merge(b).state_dict()
        {'loss_sum': 3.5, 'first_bad_step': 7.0}
    """

    def __init__(self) -> None:
        self._specs: dict[str, StateSpec] = {}
        self._values: dict[str, Any] = {}

    def add_state(self, name: str, default: Any, reduction: Reduction | str) -> None:
        """Declare ``name`` with its ``default`` and the reduction that merges it over processes.

        Raises:
            ValueError: If ``name`` is declared twice, ``reduction`` is unknown or ``default`` is not the
                identity of the reduction (0 for ``SUM``, an empty list for ``CAT``, a number at least
                ``2**52`` for ``MIN``, at most ``-2**52`` for ``MAX``): merging a fresh state must change nothing.
        """
        if name in self._specs:
            raise ValueError(f"state `{name}` is declared twice")
        reduction = Reduction(reduction)
        if not _is_identity(default, reduction):
            raise ValueError(
                f"the default of state `{name}` must be the identity of {reduction.value}, got {default!r}"
            )
        self._specs[name] = StateSpec(name, default, reduction)
        self._values[name] = _fresh(default)

    @property
    def specs(self) -> Mapping[str, StateSpec]:
        """The declarations, by name, in declaration order."""
        return dict(self._specs)

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __setitem__(self, name: str, value: Any) -> None:
        if name not in self._specs:
            raise KeyError(f"state `{name}` is not declared; declared: {list(self._specs)}")
        self._values[name] = value

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def reset(self, names: Iterable[str] | None = None) -> None:
        """Put the named values (all by default) back to their defaults."""
        for name in self._specs if names is None else names:
            self._values[name] = _fresh(self._specs[name].default)

    def merge(self, other: ReducedState) -> ReducedState:
        """A new state: each value of ``self`` combined with ``other``'s by its declared reduction.

        Raises:
            ValueError: If the two states do not declare the same names and reductions.
        """
        if self._specs != other._specs:
            raise ValueError("cannot merge states with different declarations")
        merged = self._empty_copy()
        for name, spec in self._specs.items():
            merged._values[name] = combine(spec.reduction, self._values[name], other._values[name])
        return merged

    def share(self, world_size: int, rank: int) -> ReducedState:
        """This rank's share of a state that already holds the merged values of every rank.

        Merging the shares of ranks ``0 .. world_size - 1`` gives the state back: ``SUM`` values are divided
        evenly, ``MIN``/``MAX`` values are kept by every rank, ``CAT`` values by rank 0 only.
        """
        shared = self._empty_copy()
        for name, spec in self._specs.items():
            value = self._values[name]
            if spec.reduction is Reduction.SUM:
                value = value / world_size
            elif spec.reduction is Reduction.CAT and rank != 0:
                value = _fresh(spec.default)
            shared._values[name] = value
        return shared

    def state_dict(self) -> dict[str, Any]:
        """Host copies of the values: ``float`` for scalars, ``list[float]`` for ``CAT``.

        The 0-d tensors of one device come back in one read (:func:`host_values`).
        """
        return host_values({name: self._values[name] for name in self._specs})

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Restore :meth:`state_dict` output (as host values).

        Args:
            state: Values by name; names that are not declared are ignored.
            strict: Whether every declared name must be present (otherwise a missing one keeps its default).

        Raises:
            KeyError: With ``strict``, naming every declared value missing from ``state``.
        """
        missing = [name for name in self._specs if name not in state]
        if missing and strict:
            raise KeyError(f"{type(self).__name__}.load_state_dict: missing state keys {missing}")
        for name, spec in self._specs.items():
            value = state.get(name, spec.default)
            self._values[name] = list(value) if spec.reduction is Reduction.CAT else float(value)

    def _empty_copy(self) -> ReducedState:
        # A plain ReducedState: subclasses add behaviour, the declaration and values are all a merge needs.
        copy = ReducedState()
        copy._specs = dict(self._specs)
        copy._values = {name: _fresh(spec.default) for name, spec in self._specs.items()}
        return copy


def _fresh(default: Any) -> Any:
    return list(default) if isinstance(default, (list, tuple)) else default


def host_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """Host copies of ``values``: ``float`` for numbers and 0-d tensors, ``list[float]`` for lists and tensors.

    The 0-d tensors of each device are stacked and read back together: one host read per device, not one per
    value.

    Example:
        >>> host_values({"a": torch.tensor(1.5), "b": 2, "c": torch.tensor([1.0, 2.0])})
        {'a': 1.5, 'b': 2.0, 'c': [1.0, 2.0]}
    """
    out = {name: None if _is_scalar_tensor(v) else _to_host(v) for name, v in values.items()}
    by_device: dict[torch.device, list[str]] = {}
    for name, value in values.items():
        if _is_scalar_tensor(value):
            by_device.setdefault(value.device, []).append(name)
    for device, names in by_device.items():
        dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
        stacked = torch.stack([values[n].detach().to(dtype) for n in names])
        out.update(zip(names, stacked.tolist(), strict=True))
    return out


def _is_scalar_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0


def _to_host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().double().reshape(-1).tolist() if value.dim() > 0 else float(value)
    if isinstance(value, (list, tuple)):
        return [float(v) for v in value]
    return float(value)
