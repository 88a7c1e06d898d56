"""The library's callbacks for the unified ``lightning`` package (``import lightning.pytorch as L``).

``pytorch_lightning`` and ``lightning.pytorch`` are two copies of the same framework with distinct classes: a
``pytorch_lightning.Callback`` handed to a ``lightning.pytorch.Trainer`` is not one of its callbacks (its type
checks, ``LightningCLI``'s ``trainer.callbacks`` and the mixed-import check reject it). This module offers every
callback of the library as a class that is both: the same class, with ``lightning.pytorch.Callback`` added as a
second base. No code is duplicated; the classes are made on first access and cached, so any
:class:`~lightning_diag.callbacks.DiagCallback` exported by :mod:`lightning_diag`, now or later, is here too.

Example:
    >>> import lightning.pytorch as L
    >>> from lightning_diag.lightning import AnomalyAlarm
    >>> isinstance(AnomalyAlarm(), L.Callback)
    True
    >>> AnomalyAlarm().state_key == __import__("lightning_diag").AnomalyAlarm().state_key
    True

Thresholds are plain mappings (``rules={"loss_swing": {"threshold": 0.2}}``), the same for both packages.

Your own subclass of a library callback: ``for_lightning(MyMonitor)``, or list ``lightning.pytorch.Callback``
as a second base yourself (``class MyMonitor(GradientFlowMonitor, L.Callback)``), which is all this does.
"""

from __future__ import annotations

from typing import Any, TypeVar

try:
    import lightning.pytorch as unified
except ModuleNotFoundError as err:  # pragma: no cover - depends on the environment
    raise ModuleNotFoundError(
        "lightning_diag.lightning is for the unified `lightning` package, which is not installed: "
        "`pip install lightning`, or import the callbacks from `lightning_diag` with `pytorch_lightning`"
    ) from err

import lightning_diag
from lightning_diag.callbacks.common.base import DiagCallback

__all__ = ["for_lightning"]

_C = TypeVar("_C", bound=DiagCallback)
_MADE: dict[type, type] = {}


def for_lightning(callback_class: type[_C]) -> type[_C]:
    """``callback_class`` with ``lightning.pytorch.Callback`` as a second base, made once and cached.

    The new class keeps the original's name, so its checkpoint ``state_key`` is the same: a checkpoint written
    with one package resumes with the other.

    Args:
        callback_class: A subclass of :class:`~lightning_diag.callbacks.common.base.DiagCallback`.

    Raises:
        TypeError: If ``callback_class`` is not a ``DiagCallback`` subclass.
    """
    if not (isinstance(callback_class, type) and issubclass(callback_class, DiagCallback)):
        raise TypeError(f"Expected argument `callback_class` to be a DiagCallback subclass, but got {callback_class!r}")
    if issubclass(callback_class, unified.Callback):
        return callback_class
    made = _MADE.get(callback_class)
    if made is None:
        made = type(
            callback_class.__name__,
            (callback_class, unified.Callback),
            {"__module__": callback_class.__module__, "__doc__": callback_class.__doc__},
        )
        if callback_class.__module__.startswith("lightning_diag.") and _library_class(callback_class.__name__):
            # Importable (pickle, ddp_spawn, LightningCLI's class_path) as lightning_diag.lightning.<Name>.
            made.__module__ = __name__
            made.__qualname__ = callback_class.__name__
        _MADE[callback_class] = made
    return made


def _library_class(name: str) -> type[DiagCallback] | None:
    value = getattr(lightning_diag, name, None) if name in lightning_diag.__all__ else None
    return value if isinstance(value, type) and issubclass(value, DiagCallback) else None


def __getattr__(name: str) -> Any:
    callback_class = _library_class(name)
    if callback_class is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return for_lightning(callback_class)


def __dir__() -> list[str]:
    return sorted([*__all__, *(n for n in lightning_diag.__all__ if _library_class(n) is not None)])
