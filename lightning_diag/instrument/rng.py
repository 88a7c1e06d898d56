"""Saving and restoring every random-number generator a training step can draw from.

Two tools, one notion of "every generator": torch's CPU generator, the generator of each device of the
accelerator (through :func:`torch.random.fork_rng`), and, unless told otherwise, Python's :mod:`random` and
numpy's global state.

- :func:`preserved_rng`: a context manager; whatever runs inside (a probe's extra forward passes, a replayed
  step, a dataset's random augmentation) leaves the generators exactly as they were.
- :class:`RngState`: a copy taken now and put back later (the replay of a failing step rewinds to the state the
  step started with).
- :class:`HeldGenerators`: the generators an object holds (a dataset's own ``numpy`` ``Generator``, a
  ``random.Random``, a ``torch.Generator``, found by walking its attributes), their states copied and put back;
  which of them drew in between.

Device generators are read only on devices already initialised: saving never initialises CUDA (a CPU run on a
GPU machine stays off the GPU). CUDA paths are written from torch's documented APIs; not run here (no GPU).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import itertools
import random
import types
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

__all__ = [
    "HeldGenerators",
    "RngState",
    "device_generators",
    "is_global_generator",
    "preserved_rng",
]


def device_generators() -> tuple[str, list[int]]:
    """The accelerator's device type and the indices of its devices whose generators exist already.

    The type is :func:`torch.accelerator.current_accelerator`'s (``"cuda"`` when there is none, as
    :func:`torch.random.fork_rng` does); the list is empty when that accelerator is absent or not initialised.

    Example:
        >>> device_type, devices = device_generators()
        >>> isinstance(device_type, str) and isinstance(devices, list)
        True
    """
    accelerator = torch.accelerator.current_accelerator()
    device_type = accelerator.type if accelerator is not None else "cuda"
    module = torch.get_device_module(device_type)
    initialised = getattr(module, "is_initialized", None)
    if not module.is_available() or (initialised is not None and not initialised()):
        return device_type, []
    return device_type, list(range(module.device_count()))


@contextlib.contextmanager
def preserved_rng(*, python: bool = True) -> Iterator[None]:
    """Run the block, then put every generator back as it was before (also when the block raises).

    Args:
        python: Also save and restore :mod:`random`'s and numpy's global states (a dataset's ``__getitem__`` or
            a user's ``training_step`` may draw from them).

    Example:
        >>> torch_state, python_state = torch.get_rng_state(), random.getstate()
        >>> with preserved_rng():
        ...     _ = torch.rand(3), random.random(), np.random.rand()
        >>> torch.equal(torch_state, torch.get_rng_state()), python_state == random.getstate()
        (True, True)
    """
    device_type, devices = device_generators()
    py_state = random.getstate() if python else None
    np_state = np.random.get_state() if python else None
    with torch.random.fork_rng(devices=devices, device_type=device_type):
        try:
            yield
        finally:
            if py_state is not None:
                random.setstate(py_state)
            if np_state is not None:
                np.random.set_state(np_state)


@dataclasses.dataclass
class RngState:
    """A copy of the generators: torch CPU, the accelerator's initialised devices, ``random``, numpy.

    Example:
        >>> state = RngState.capture()
        >>> a = torch.rand(2)
        >>> state.restore()
        >>> torch.equal(a, torch.rand(2))
        True
    """

    cpu: torch.Tensor
    device_type: str
    devices: dict[int, torch.Tensor]
    python: Any = None
    numpy: Any = None

    @classmethod
    def capture(cls, python: bool = True, generators: tuple[str, list[int]] | None = None) -> RngState:
        """Copy the current state (a few kilobytes; no device synchronisation).

        Args:
            python: Also copy the ``random`` and numpy states. The per-step copy leaves them out (numpy's takes
                ~0.2 ms, torch's ~1 us): dropout and torch's samplers draw from torch's generators.
            generators: :func:`device_generators`' answer when the caller already has it (a per-step caller looks
                once per fit: the model is on its device by then); looked up now when ``None``.
        """
        device_type, indices = generators if generators is not None else device_generators()
        module = torch.get_device_module(device_type)
        devices = {i: module.get_rng_state(i) for i in indices}
        py_state = random.getstate() if python else None
        np_state = np.random.get_state() if python else None
        return cls(torch.get_rng_state(), device_type, devices, py_state, np_state)

    def restore(self) -> None:
        """Make this the current state (the parts that were captured)."""
        torch.set_rng_state(self.cpu)
        module = torch.get_device_module(self.device_type)
        for index, state in self.devices.items():
            module.set_rng_state(state, index)
        if self.python is not None:
            random.setstate(self.python)
        if self.numpy is not None:
            np.random.set_state(self.numpy)


#: Objects :func:`_walk` visits at most per root (a dataset holding a million Python samples is not
#: walked whole: generators live in attributes and transforms, not among the samples).
_MAX_VISITED = 20_000
#: Items of one list, tuple, set or mapping :func:`_walk` looks into.
_MAX_ITEMS = 256
_MISSING = object()
_LEAVES = (
    str,
    bytes,
    bytearray,
    int,
    float,
    complex,
    bool,
    type(None),
    torch.Tensor,
    np.ndarray,
    type,
    types.ModuleType,
)


def _is_generator(obj: Any) -> bool:
    if isinstance(obj, random.SystemRandom):  # no state to copy: os.urandom
        return False
    return isinstance(
        obj, (random.Random, np.random.Generator, np.random.RandomState, np.random.BitGenerator, torch.Generator)
    )


def is_global_generator(obj: Any) -> bool:
    """Whether ``obj`` is one of the process-wide generators (``random``'s, numpy's legacy global, torch's CPU
    default): those a ``DataLoader`` worker reseeds itself (``torch.utils.data`` seeds them per worker)."""
    globals_ = (getattr(random, "_inst", None), getattr(np.random.mtrand, "_rand", None), torch.default_generator)
    return any(obj is g for g in globals_)


def _children(obj: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, Mapping):
        for key, value in itertools.islice(obj.items(), _MAX_ITEMS):
            yield f"{path}[{key!r}]", value
        return
    if isinstance(obj, (list, tuple, collections.deque)):
        for i, value in enumerate(itertools.islice(obj, _MAX_ITEMS)):
            yield f"{path}[{i}]", value
        return
    if isinstance(obj, (set, frozenset)):
        for value in itertools.islice(obj, _MAX_ITEMS):
            yield f"{path}{{}}", value
        return
    if isinstance(obj, functools.partial):
        yield f"{path}.func", obj.func
        yield from _children(obj.args, f"{path}.args")
        yield from _children(obj.keywords, f"{path}.keywords")
        return
    if isinstance(obj, types.MethodType):
        yield f"{path}.__self__", obj.__self__
        yield f"{path}.__func__", obj.__func__
        return
    if isinstance(obj, types.FunctionType):
        cells = obj.__closure__ or ()
        for name, cell in zip(obj.__code__.co_freevars, cells, strict=False):
            with contextlib.suppress(ValueError):  # an empty cell
                yield f"{path}.<{name}>", cell.cell_contents
        return
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict):
        for key, value in itertools.islice(attrs.items(), _MAX_ITEMS):
            yield f"{path}.{key}", value
    for cls in type(obj).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if isinstance(slot, str) and slot not in ("__dict__", "__weakref__") and hasattr(obj, slot):
                yield f"{path}.{slot}", getattr(obj, slot)


def _walk(roots: tuple[tuple[str, Any], ...]) -> tuple[dict[str, Any], list[Any]]:
    """The random generators an object graph holds, by the path that reaches each first, and the objects visited
    that have a ``__dict__``.

    Walks attributes (``__dict__``, ``__slots__``), mappings, lists, tuples, sets, ``functools.partial`` objects,
    bound methods and closures from each ``(name, root)``, breadth first, each object once, at most
    :data:`_MAX_VISITED` objects and :data:`_MAX_ITEMS` items per container. Generators: :class:`random.Random`
    (not :class:`random.SystemRandom`), numpy's ``Generator``, ``RandomState`` and ``BitGenerator``,
    :class:`torch.Generator`. Modules, classes, tensors and arrays are not entered.
    """
    found: dict[str, Any] = {}
    holders: list[Any] = []
    seen: set[int] = set()
    queue: collections.deque[tuple[str, Any]] = collections.deque(roots)
    while queue and len(seen) < _MAX_VISITED:
        path, obj = queue.popleft()
        if id(obj) in seen or isinstance(obj, _LEAVES):
            continue
        seen.add(id(obj))
        if _is_generator(obj):
            found.setdefault(path, obj)
            continue
        try:
            queue.extend(_children(obj, path))
            if isinstance(getattr(obj, "__dict__", None), dict):
                holders.append(obj)
        except Exception:  # an exotic object whose attributes cannot be read is left out
            continue
    return found, holders


def _get_state(g: Any) -> Any:
    if isinstance(g, random.Random):
        return g.getstate()
    if isinstance(g, np.random.Generator):
        return copy.deepcopy(g.bit_generator.state)
    if isinstance(g, (np.random.RandomState,)):
        return g.get_state(legacy=False)
    if isinstance(g, np.random.BitGenerator):
        return copy.deepcopy(g.state)
    return g.get_state()


def _set_state(g: Any, state: Any) -> None:
    if isinstance(g, random.Random):
        g.setstate(state)
    elif isinstance(g, np.random.Generator):
        g.bit_generator.state = state
    elif isinstance(g, np.random.RandomState):
        g.set_state(state)
    elif isinstance(g, np.random.BitGenerator):
        g.state = state
    else:
        g.set_state(state)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@dataclasses.dataclass
class HeldGenerators:
    """The generators an object graph holds (see :meth:`capture`) and a copy of their states.

    Example:
        >>> rng = np.random.default_rng(0)
        >>> held = HeldGenerators.capture(("rng", rng))
        >>> _ = rng.random()
        >>> held.advanced()
        ['rng']
        >>> held.restore()
        >>> held.advanced()
        []
    """

    generators: dict[str, Any]
    states: dict[str, Any]
    bindings: list[tuple[Any, dict[str, Any]]] = dataclasses.field(default_factory=list)

    @classmethod
    def capture(cls, *roots: tuple[str, Any]) -> HeldGenerators:
        """Find the generators under ``roots`` and copy their states, and the attribute bindings of the objects
        visited (a generator or a file handle created lazily while reading is dropped again by :meth:`restore`)."""
        generators, holders = _walk(roots)
        return cls(
            generators,
            {path: _get_state(g) for path, g in generators.items()},
            [(obj, dict(vars(obj))) for obj in holders],
        )

    def advanced(self) -> list[str]:
        """Paths of the generators that drew since the capture."""
        return [path for path, g in self.generators.items() if not _same(_get_state(g), self.states[path])]

    def current(self, paths: list[str]) -> dict[str, Any]:
        """The present states of the generators at ``paths``."""
        return {path: _get_state(self.generators[path]) for path in paths}

    def nudge(self, paths: list[str]) -> None:
        """Draw one number from each generator at ``paths`` (a state other than the captured one)."""
        for path in paths:
            g = self.generators[path]
            if isinstance(g, (random.Random, np.random.Generator)):
                g.random()
            elif isinstance(g, np.random.RandomState):
                g.random_sample()
            elif isinstance(g, np.random.BitGenerator):
                g.random_raw()
            else:
                torch.rand((), generator=g, device=g.device)

    @staticmethod
    def same(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
        """The paths whose states are equal in ``a`` and ``b``."""
        return [path for path in a if path in b and _same(a[path], b[path])]

    def restore(self) -> None:
        """Put every captured generator back to its captured state, and every attribute rebound or added since
        the capture back to what it was (the objects the attributes held are not deep-restored)."""
        for obj, saved in self.bindings:
            attrs = vars(obj)
            for key in [k for k in attrs if k not in saved]:
                with contextlib.suppress(Exception):
                    delattr(obj, key)
            for key, value in saved.items():
                if attrs.get(key, _MISSING) is not value:
                    with contextlib.suppress(Exception):
                        setattr(obj, key, value)
        for path, g in self.generators.items():
            _set_state(g, self.states[path])
