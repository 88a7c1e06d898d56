"""How SystemMonitor times the trainer's own logging: a timer around each logger's ``log_metrics``.

Lightning writes the user's ``self.log`` values every ``log_every_n_steps`` after the last ``on_train_batch_end``
hook, so a slow logger (a synchronous HTTP client, a flushed CSV file) used to land in the next step's data
waiting, and as a slow step on the logging cadence. :func:`time_loggers` passes the seconds of every write made
outside the diagnostics' own hooks (theirs are their overhead, timed by
:class:`~lightning_diag.callbacks._system_hooks.HookTimer`) to the step recorder.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl

__all__ = ["time_loggers", "untime_loggers"]

#: What :func:`time_loggers` returns: each wrapped logger and its timer.
Timers = list[tuple[Any, Callable[..., Any]]]


def time_loggers(
    trainer: pl.Trainer,
    add: Callable[[float], None],
    wall: Callable[[], float] = time.perf_counter,
    busy: Callable[[], bool] = lambda: False,
) -> Timers:
    """Pass the wall seconds of every ``log_metrics`` call of the trainer's loggers to ``add``, except the calls
    made while ``busy()`` (inside a timed diagnostics hook).

    The timer is an instance attribute of each logger; a logger whose ``log_metrics`` someone already replaced
    on the instance is left as it is. Returns the timers, for :func:`untime_loggers`.
    """
    timers: Timers = []
    for logger in getattr(trainer, "loggers", None) or []:
        if "log_metrics" in vars(logger) or not callable(getattr(logger, "log_metrics", None)):
            continue
        original = logger.log_metrics

        def log_metrics(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            if busy():
                return _original(*args, **kwargs)
            start = wall()
            try:
                return _original(*args, **kwargs)
            finally:
                add(wall() - start)

        logger.log_metrics = log_metrics
        timers.append((logger, log_metrics))
    return timers


def untime_loggers(timers: Timers) -> None:
    """Remove the timers :func:`time_loggers` installed, and nothing else."""
    for logger, timer in timers:
        if vars(logger).get("log_metrics") is timer:
            del logger.log_metrics
