"""Switching a callback's per-batch hooks off on the batches it has nothing to do in.

Lightning calls a callback's hook only when ``getattr(callback, hook)`` is callable (its ``_call_callback_hooks``):
a hook set to ``None`` on the instance is skipped, and so is Lightning's dispatch of it (the profiler label and
context it opens around every call). :class:`~lightning_diag.callbacks.base.DiagCallback` uses this for the hooks a
subclass declares in ``batch_hooks``: on a quiet batch they are ``None`` from its ``on_train_batch_start`` until the
next batch that needs them, which gets back what the instance held (the class's method, or another piece's wrapper
of it, such as ``SystemMonitor``'s timers).

A wrapper that must run on every batch (``SystemMonitor``'s end of the batch, put on the last callback's
``on_train_batch_end``) carries :data:`EVERY_BATCH` and is left on. Code that forwards hooks to these callbacks
itself must skip a hook that is ``None``, as Lightning does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["EVERY_BATCH", "switch_off", "switch_on"]

#: Set to ``True`` on a wrapper put on a callback's hook that must run on every batch: :func:`switch_off` leaves
#: that hook on.
EVERY_BATCH = "lightning_diag_every_batch"


def switch_off(callback: object, hooks: Iterable[str]) -> dict[str, Any]:
    """Set each of ``hooks`` to ``None`` on ``callback`` (but one whose wrapper carries :data:`EVERY_BATCH`).

    Returns:
        What the instance held for the hooks switched off (wrappers), for :func:`switch_on`.
    """
    state = vars(callback)
    switched = [hook for hook in hooks if not getattr(state.get(hook), EVERY_BATCH, False)]
    held = {hook: state[hook] for hook in switched if hook in state}
    for hook in switched:
        state[hook] = None
    return held


def switch_on(callback: object, hooks: Iterable[str], held: dict[str, Any]) -> None:
    """Undo :func:`switch_off`: put back what the instance ``held``, or the class's method. A hook no longer
    ``None`` (another piece removed or replaced it since) is left as it is."""
    state = vars(callback)
    for hook in hooks:
        if hook in state and state[hook] is None:
            if hook in held:
                state[hook] = held[hook]
            else:
                del state[hook]
