"""Switching a callback's per-batch hooks off on the batches it has nothing to do in.

Lightning calls a callback's hook only when ``getattr(callback, hook)`` is callable (its ``_call_callback_hooks``):
a hook set to ``None`` on the instance is skipped, and so is Lightning's dispatch of it (the profiler label and
context it opens around every call). :class:`~lightning_diag.callbacks.DiagCallback` uses this for the hooks a
subclass declares in ``batch_hooks``: on a quiet batch they do not run from its ``on_train_batch_start`` until the
next batch that needs them. During a fit the trainer's driver skips them
(:meth:`Driver.switch <lightning_diag.callbacks.common.driver.Driver.switch>`); outside one they are ``None`` on the
instance, and the next batch gets back what the instance held (the class's method, or a callable set on it).

The per-batch hooks a callback inherits from Lightning's ``Callback`` (no-ops: ``on_before_zero_grad`` for every
callback of the library, ``on_after_backward`` for most) are ``None`` on the instance for the whole fit
(:func:`inherited_batch_hooks`): Lightning's dispatch of a no-op costs about 4 µs warm, more on a step's cold
caches, and three callbacks left six of them on every quiet step.

Only lightning_diag's own callback instances are switched (their hooks are theirs); nothing of another callback's
is touched. Code that forwards hooks to these callbacks itself must skip a hook that is ``None``, as Lightning does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytorch_lightning as pl

__all__ = [
    "DISPATCHED_HOOKS",
    "TRAIN_BATCH_HOOKS",
    "TRAIN_EPOCH_HOOKS",
    "inherited_batch_hooks",
    "switch_off",
    "switch_on",
]

#: The callback hooks Lightning calls on every training batch.
TRAIN_BATCH_HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
)

#: The callback hooks Lightning calls at a training epoch's start and end.
TRAIN_EPOCH_HOOKS = ("on_train_epoch_start", "on_train_epoch_end")

#: The hooks the trainer's driver dispatches during a fit (:meth:`Driver.host
#: <lightning_diag.callbacks.common.driver.Driver.host>`): Lightning calls them on the first attached callback only,
#: which runs every attached callback's own, in ``trainer.callbacks`` order. The lifecycle and state hooks
#: (``setup``, ``teardown``, ``on_fit_start``, ``on_train_start``, checkpoint hooks, ``on_exception``) stay each
#: callback's.
DISPATCHED_HOOKS = (
    *TRAIN_BATCH_HOOKS,
    *TRAIN_EPOCH_HOOKS,
    "on_validation_start",
    "on_validation_end",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
    "on_validation_batch_start",
    "on_validation_batch_end",
)


def inherited_batch_hooks(callback: object) -> list[str]:
    """The :data:`TRAIN_BATCH_HOOKS` that ``callback``'s class inherits from Lightning's ``Callback`` (no-ops) and
    that its instance does not hold (a wrapper, a hook assigned on it): those it can leave ``None`` for a fit.

    Example:
        >>> class Start(pl.Callback):
        ...     def on_train_batch_start(self, *args): ...
        >>> hooks = inherited_batch_hooks(Start())
        >>> "on_train_batch_start" in hooks, "on_before_zero_grad" in hooks, len(hooks)
        (False, True, 5)
    """
    cls, state = type(callback), vars(callback)
    return [
        hook
        for hook in TRAIN_BATCH_HOOKS
        if getattr(cls, hook, None) is getattr(pl.Callback, hook) and state.get(hook) is None
    ]


def switch_off(callback: object, hooks: Iterable[str]) -> dict[str, Any]:
    """Set each of ``hooks`` to ``None`` on ``callback``.

    Returns:
        What the instance held for the hooks switched off (wrappers), for :func:`switch_on`.
    """
    state = vars(callback)
    switched = list(hooks)
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
