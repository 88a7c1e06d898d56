"""A dispatch mode that counts the aten operators run inside it, by name (tests of what a hook costs)."""

from __future__ import annotations

import collections
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class OpNames(TorchDispatchMode):
    """Counts each aten operator dispatched while it is entered (``names``: ``{"sum.default": 2, ...}``)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names[str(func).removeprefix("aten.")] += 1
        return func(*args, **(kwargs or {}))
