"""Saving and restoring every random-number generator a training step can draw from.

Two tools, one notion of "every generator": torch's CPU generator, the generator of each device of the
accelerator (through :func:`torch.random.fork_rng`), and, unless told otherwise, Python's :mod:`random` and
numpy's global state.

- :func:`preserved_rng`: a context manager; whatever runs inside (a probe's extra forward passes, a replayed
  step, a dataset's random augmentation) leaves the generators exactly as they were.
- :class:`RngState`: a copy taken now and put back later (the replay of a failing step rewinds to the state the
  step started with).

Device generators are read only on devices already initialised: saving never initialises CUDA (a CPU run on a
GPU machine stays off the GPU). CUDA paths are written from torch's documented APIs; not run here (no GPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

__all__ = ["RngState", "device_generators", "preserved_rng"]


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
