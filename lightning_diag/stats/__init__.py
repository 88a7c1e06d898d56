"""Pure functions on tensors and series: fused gradient norms, entropy, trend tests. Never imports Lightning.

Lazy (PEP 562): the torch-free modules (``stats.trend``) load without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY: dict[str, str] = {
    "all_finite": "lightning_diag.stats.norms",
    "max_abs": "lightning_diag.stats.norms",
    "total_norm": "lightning_diag.stats.norms",
    "fluctuation": "lightning_diag.stats.trend",
    "relative_change": "lightning_diag.stats.trend",
}

__all__ = ["all_finite", "fluctuation", "max_abs", "relative_change", "total_norm"]

if TYPE_CHECKING:  # pragma: no cover
    from lightning_diag.stats.norms import all_finite, max_abs, total_norm
    from lightning_diag.stats.trend import fluctuation, relative_change


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_diag.stats' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
