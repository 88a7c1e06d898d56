"""Where the library's output goes: every logger of the trainer for scalars, a TensorBoard writer for the rest.

:class:`DiagWriter` is what callbacks write through (``self.writer`` of a
:class:`~lightning_diag.callbacks.common.base.DiagCallback`). For a trainer (:meth:`DiagWriter.for_trainer`):

* **Scalars** reach every logger the user configured. The TensorBoard writer gets them with ``add_scalar``
  under their exact ``diag/...`` tags (the dashboard layout and ``lightning-diag report`` select by them);
  every other logger (``CSVLogger``, ``WandbLogger``, ``MLFlowLogger``, a second ``TensorBoardLogger``, a
  custom one) through ``logger.log_metrics(metrics, step)``, as Lightning's ``LearningRateMonitor`` does, with
  the user's step as ``step``. Each point is written once per logger.
  A ``SummaryWriter`` gets all the scalars written at one step as one event, sent when another step is written,
  anything else is written (text, histograms), or on :meth:`DiagWriter.flush` (an alert, the end of the fit):
  every callback's series of a measuring step cost one hand-over to TensorBoard's writer thread.
* **Which series**: the TensorBoard writer (and any ``TensorBoardLogger``) gets every series; every other logger
  keeps the user's own history, so by default it gets the summary (:data:`SUMMARY_SERIES`: the global gradient
  norm per optimizer, the loss series, the learning rates, the mean attention entropy over modules, the step
  time, the alert count), not the per-layer and per-head detail. :func:`set_logger_series` chooses otherwise,
  per logger or for all (``"all"``, ``"none"``, glob patterns).
* **Text, images, histograms and the custom-scalars layout** go to the TensorBoard writer only: that of the
  first ``TensorBoardLogger`` (of ``pytorch_lightning``, or of ``lightning`` once it is imported), or else one
  the library opens at ``<log_dir>/diag`` (which also gets the scalars: the report reads it).
* **Steps** are on the user's axis: a trainer's writer maps the ``trainer.global_step`` a callback writes at to
  the number of batches that stepped (:class:`~lightning_diag.callbacks.common.step_axis.StepAxis`), the step Lightning
  logs ``self.log`` values at, so diag series and the user's metrics share one x-axis in every logger, also under
  manual optimization with several optimizers (where ``global_step`` counts every ``optimizer.step()``).
* :meth:`DiagWriter.flush` flushes the TensorBoard writer and calls every other logger's ``save()``, so
  buffering loggers (``CSVLogger`` writes ``metrics.csv`` on ``save``) hold nothing of ours past an alert or
  the end of the fit; what they buffered for the user is written with it.

Only global rank zero writes; elsewhere :meth:`DiagWriter.for_trainer` returns a writer that writes nothing.

**A failure never ends the fit** (:mod:`lightning_diag.core.files`): a TensorBoard writer that cannot be opened
(a read-only or full folder) or that fails later is reported once, naming its folder or event file and the
error, and the writer goes on without it (the other loggers keep getting the scalars); a logger whose
``log_metrics`` or ``save`` raises is reported once and dropped. The event file of the library's own writer is
guarded inside TensorBoard's writer thread too, so a full disk ends that file with one warning, not with a
thread traceback and an ``OSError`` at the next write.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import logging
import os
import re
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger

from lightning_diag.core.files import report_write_failure

__all__ = [
    "ALERT_COUNT_TAG",
    "ATTN_ENTROPY_MEAN_TAG",
    "SUMMARY_SERIES",
    "DiagWriter",
    "logger_series",
    "per_version_logger_types",
    "set_logger_series",
    "tensorboard_logger_types",
]

log = logging.getLogger("lightning_diag")

#: The mean over attention modules of their mean entropy over heads (the summary's one attention series).
ATTN_ENTROPY_MEAN_TAG = "diag/attn_entropy/mean"
#: The number of alerts recorded so far in the fit (every severity), beside each summary row.
ALERT_COUNT_TAG = "diag/alerts/count"
#: What a logger that keeps its own metric history (CSV, W&B, MLflow, ...) gets by default ("summary"): a few
#: series per run, whatever the model's size, as glob patterns (:func:`fnmatch.fnmatchcase`).
SUMMARY_SERIES: tuple[str, ...] = (
    "diag/grad_norm/total",  # the global gradient norm (the first optimizer's)
    "diag/grad_norm/total/optimizer_*",  # the other optimizers'
    "diag/loss/*",  # train_step, train_epoch, train_window, swing, val, train_fluctuation, val_fluctuation
    "diag/lr/*",  # one per optimizer and parameter group
    ATTN_ENTROPY_MEAN_TAG,
    "diag/system/step_time_s",
    "diag/system/data_wait_s",
    ALERT_COUNT_TAG,
)
_SERIES_WORDS = ("summary", "all", "none")
_ATTN_MODULE_MEAN = re.compile(r"diag/attn_entropy/.+/mean$")

_default_series: str | tuple[str, ...] = "summary"
_logger_series: weakref.WeakKeyDictionary[Any, str | tuple[str, ...]] = weakref.WeakKeyDictionary()


def _check_series(series: str | Sequence[str]) -> str | tuple[str, ...]:
    if isinstance(series, str):
        if series not in _SERIES_WORDS:
            raise ValueError(
                f"Expected argument `series` to be one of {list(_SERIES_WORDS)} or a list of glob patterns of "
                f"`diag/` tags, but got {series!r}"
            )
        return series
    patterns = tuple(series)
    if not all(isinstance(p, str) and p for p in patterns):
        raise TypeError(f"Expected argument `series` to hold non-empty strings (glob patterns), but got {series!r}")
    return patterns


def set_logger_series(series: str | Sequence[str], logger: Any | None = None) -> None:
    """Choose which ``diag/`` series a logger that is not the TensorBoard writer gets.

    Args:
        series: ``"summary"`` (the default: :data:`SUMMARY_SERIES`, a handful of series whatever the model's
            size), ``"all"`` (every series, per layer and per head too), ``"none"``, or glob patterns of tags
            (``["diag/grad_norm/*", "diag/loss/*"]``: the summary is not added to them).
        logger: One logger of the trainer (the setting follows that object); ``None``: the default of every
            logger that has no setting of its own, except a ``TensorBoardLogger``, which gets every series
            unless set one by one.

    Raises:
        ValueError: ``series`` is a word other than those three.
        TypeError: ``series`` holds something other than non-empty strings, or ``logger`` cannot be keyed
            (unhashable).

    Example:
        >>> from unittest.mock import MagicMock
        >>> csv = MagicMock()
        >>> set_logger_series("all", csv)
        >>> logger_series(csv)
        'all'
    """
    global _default_series
    checked = _check_series(series)
    if logger is None:
        _default_series = checked
    else:
        _logger_series[logger] = checked


def logger_series(logger: Any) -> str | tuple[str, ...]:
    """The series ``logger`` gets (:func:`set_logger_series`): its own setting, else ``"all"`` for a
    ``TensorBoardLogger``, else the default (``"summary"``)."""
    try:
        own = _logger_series.get(logger)
    except TypeError:  # an unhashable logger has no setting of its own
        own = None
    if own is not None:
        return own
    return "all" if isinstance(logger, tensorboard_logger_types()) else _default_series


def tensorboard_logger_types() -> tuple[type, ...]:
    """``TensorBoardLogger`` of ``pytorch_lightning``, and of the unified ``lightning`` package once it is in use."""
    types: list[type] = [TensorBoardLogger]
    if "lightning.pytorch" in sys.modules:  # never import the unified package for a user who does not use it
        from lightning.pytorch.loggers import TensorBoardLogger as UnifiedTensorBoardLogger

        types.append(UnifiedTensorBoardLogger)
    return tuple(types)


def per_version_logger_types() -> tuple[type, ...]:
    """The loggers whose ``log_dir`` is a per-run folder (``version_N``): TensorBoard's and CSV's, of
    ``pytorch_lightning`` and of ``lightning`` once it is in use."""
    types: list[type] = [*tensorboard_logger_types(), CSVLogger]
    if "lightning.pytorch" in sys.modules:
        from lightning.pytorch.loggers import CSVLogger as UnifiedCSVLogger

        types.append(UnifiedCSVLogger)
    return tuple(types)


class DiagWriter:
    """A thin, rank-aware writer: scalars to a ``SummaryWriter`` and to loggers, the rest to the ``SummaryWriter``.

    Args:
        experiment: The TensorBoard writer (a ``SummaryWriter`` or anything with its methods), or ``None``.
        owned: Whether this object opened ``experiment`` and must close it.
        loggers: Lightning loggers (anything with ``log_metrics(metrics, step)``) that get the scalars too.
        step_axis: Maps the step a caller writes at to the step written (a trainer's writer: the user's axis);
            ``None`` writes it as given.

    Example:
        >>> from unittest.mock import MagicMock
        >>> csv = MagicMock()
        >>> writer = DiagWriter(None, loggers=[csv])
        >>> writer.scalars({"diag/loss/train_step": 0.5}, step=10)
        >>> csv.log_metrics.call_args
        call({'diag/loss/train_step': 0.5}, step=10)
    """

    def __init__(
        self,
        experiment: Any | None,
        owned: bool = False,
        loggers: Sequence[Any] = (),
        step_axis: Callable[[int], int] | None = None,
    ) -> None:
        self.experiment = experiment
        self.owned = owned
        self.loggers = list(loggers)
        self.step_axis = step_axis
        #: Returns the number of alerts recorded so far (the session's), written beside each summary row.
        self.alert_count: Callable[[], int] | None = None
        # (id(logger), its patterns) -> tag -> whether that logger gets it
        self._selected: dict[tuple[int, tuple[str, ...]], dict[str, bool]] = {}
        # The library's own event file, guarded inside TensorBoard's writer thread (None: not ours, or not found).
        self._event_file = _guard_event_file(experiment) if owned else None
        # A SummaryWriter's scalars of the step being written, held until another step or any other write: one
        # event per step for every callback's scalars (each event is a hand-over to TensorBoard's writer thread).
        # The step's `Summary` itself, its values added in place (no list of values copied into it at the send).
        self._pending: Any | None = None
        self._pending_step = 0
        # Whether `experiment` is a SummaryWriter (its scalars join the pending event), decided at the first write.
        self._summary_writer: bool | None = None

    @classmethod
    def for_trainer(
        cls, trainer: pl.Trainer, log_dir: str, step_axis: Callable[[int], int] | None = None
    ) -> DiagWriter:
        """The writer for a trainer's run (see the module docstring); a no-op off global rank zero.

        Args:
            trainer: Its ``loggers`` get the scalars; its first ``TensorBoardLogger`` writer gets the rest.
            log_dir: Where the library's own ``SummaryWriter`` goes (``<log_dir>/diag``) without such a logger.
            step_axis: See the class.
        """
        if not trainer.is_global_zero:
            return cls(None)
        loggers = list(trainer.loggers)
        tensorboard_loggers = tensorboard_logger_types()
        for i, lg in enumerate(loggers):
            if isinstance(lg, tensorboard_loggers):
                try:
                    experiment = getattr(lg, "experiment", None)  # opens the logger's writer (its folder, its file)
                except Exception as err:  # the user's logger reports this too; our series go to our own writer
                    report_write_failure(getattr(lg, "log_dir", None) or repr(lg), err)
                    experiment = None
                if experiment is not None:
                    return cls(experiment, loggers=loggers[:i] + loggers[i + 1 :], step_axis=step_axis)
        from torch.utils.tensorboard import SummaryWriter

        path = os.path.join(log_dir, "diag")
        try:
            os.makedirs(path, exist_ok=True)
            experiment = SummaryWriter(log_dir=path)
        except Exception as err:  # a read-only or full folder (OSError), or a remote file system's own error
            report_write_failure(path, err)
            return cls(None, loggers=loggers, step_axis=step_axis)
        return cls(experiment, owned=True, loggers=loggers, step_axis=step_axis)

    def _step(self, step: int) -> int:
        return self.step_axis(step) if self.step_axis is not None else step

    @property
    def active(self) -> bool:
        """Whether anything is written."""
        return self.experiment is not None or bool(self.loggers)

    def scalar(self, name: str, value: float, step: int) -> None:
        """Write one scalar."""
        self.scalars({name: value}, step)

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        """Write several scalars, each under its own tag (one ``log_metrics`` call per logger; one TensorBoard event
        holding them all)."""
        if not values:
            return
        step = self._step(step)
        if self.experiment is not None:
            try:
                self._tensorboard(values, step)
            except Exception as err:
                self._drop_experiment(err)
        if not self.loggers:
            return
        extended = self._with_summary(values)
        for lg in list(self.loggers):  # a failing one is dropped mid-loop
            chosen = self._select(lg, extended)
            if not chosen:
                continue
            try:
                lg.log_metrics(chosen, step=step)
            except Exception as err:  # a broken third-party logger must not end the user's run
                self._drop(lg, err)

    def _tensorboard(self, values: Mapping[str, float], step: int) -> None:
        """Scalars to the TensorBoard writer: a ``SummaryWriter``'s join the step's pending event (sent when
        another step is written, anything else is, or on :meth:`flush`); any other writer's are written now."""
        summary_writer = self._summary_writer
        if summary_writer is None:
            from torch.utils.tensorboard import SummaryWriter

            summary_writer = self._summary_writer = isinstance(self.experiment, SummaryWriter)
        if not summary_writer:
            _tensorboard_scalars(self.experiment, values, step)
            return
        pending = self._pending
        if pending is not None and step != self._pending_step:
            self._send_pending()
            pending = None
        if pending is None:
            from tensorboard.compat.proto.summary_pb2 import Summary

            pending = self._pending = Summary()
        self._pending_step = step
        add = pending.value.add
        for name, v in values.items():
            add(tag=name, simple_value=float(v))

    def _send_pending(self) -> None:
        """Write the pending scalars as one event (what ``add_scalar`` writes, one summary value per tag)."""
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        if self.experiment is None or not pending.value:
            return
        try:
            self.experiment._get_file_writer().add_summary(pending, self._pending_step)
        except Exception as err:
            self._drop_experiment(err)

    def _with_summary(self, values: Mapping[str, float]) -> dict[str, float]:
        """``values`` with the derived summary series: the mean attention entropy over modules and the alert
        count (the latter beside rows that hold a summary series)."""
        out = dict(values)
        means = [float(v) for k, v in values.items() if _ATTN_MODULE_MEAN.match(k)]
        if means:
            out[ATTN_ENTROPY_MEAN_TAG] = sum(means) / len(means)
        if self.alert_count is not None and any(_in_summary(k) for k in out):
            out[ALERT_COUNT_TAG] = float(self.alert_count())
        return out

    def _select(self, logger: Any, values: dict[str, float]) -> dict[str, float]:
        """The part of ``values`` that ``logger`` gets (:func:`logger_series`); decisions are kept per tag."""
        series = logger_series(logger)
        if series == "all":
            return {k: v for k, v in values.items() if k not in (ATTN_ENTROPY_MEAN_TAG, ALERT_COUNT_TAG)}
        if series == "none":
            return {}
        patterns: tuple[str, ...] = SUMMARY_SERIES if isinstance(series, str) else series
        cache = self._selected.setdefault((id(logger), patterns), {})
        out = {}
        for k, v in values.items():
            keep = cache.get(k)
            if keep is None:
                keep = cache[k] = any(fnmatch.fnmatchcase(k, p) for p in patterns)
            if keep:
                out[k] = v
        return out

    def _tensorboard_call(self, method: str, *args: Any, step: int, **kwargs: Any) -> None:
        """Send the pending scalars, then ``experiment.<method>(*args, **kwargs)`` with ``global_step`` from
        ``step`` (TensorBoard only); a failure drops the writer (:meth:`_drop_experiment`)."""
        self._send_pending()
        if self.experiment is None:
            return
        try:
            kwargs["global_step"] = self._step(step)
            getattr(self.experiment, method)(*args, **kwargs)
        except Exception as err:
            self._drop_experiment(err)

    def text(self, name: str, text: str, step: int) -> None:
        """Write markdown text (TensorBoard only)."""
        self._tensorboard_call("add_text", name, text, step=step)

    def custom_scalars(self, layout: dict[str, dict[str, list[Any]]]) -> None:
        """Write a custom-scalars layout (TensorBoard only; see
        :func:`lightning_diag.output.dashboard.dashboard_layout`)."""
        self._send_pending()
        if self.experiment is not None and layout:
            try:
                self.experiment.add_custom_scalars(layout)
            except Exception as err:
                self._drop_experiment(err)

    def histogram(self, name: str, values: Any, step: int) -> None:
        """Write a histogram of a tensor or array (TensorBoard only)."""
        self._tensorboard_call("add_histogram", name, values, step=step)

    def histogram_raw(self, name: str, data: Any, step: int) -> None:
        """Write a histogram computed elsewhere (TensorBoard only): ``data`` has the fields of
        :class:`~lightning_diag.stats.histogram.HistogramData`."""
        fields = ("min", "max", "num", "sum", "sum_squares", "bucket_limits", "bucket_counts")
        self._tensorboard_call("add_histogram_raw", name, step=step, **{f: getattr(data, f) for f in fields})

    def image(self, name: str, image: Any, step: int, dataformats: str = "HWC") -> None:
        """Write an image, uint8 or float array (TensorBoard only)."""
        self._tensorboard_call("add_image", name, image, step=step, dataformats=dataformats)

    def flush(self) -> None:
        """Flush the TensorBoard writer and ``save()`` the other loggers (``CSVLogger`` writes its file)."""
        self._send_pending()
        if self._event_file is not None and self._event_file.error is not None:
            self._drop_experiment(self._event_file.error)  # reported by the writer thread; stop feeding it
        if self.experiment is not None and hasattr(self.experiment, "flush"):
            try:
                self.experiment.flush()
            except Exception as err:
                self._drop_experiment(err)
        for lg in list(self.loggers):  # a failing one is dropped mid-loop
            save = getattr(lg, "save", None)
            if callable(save):
                try:
                    save()
                except Exception as err:
                    self._drop(lg, err)

    def close(self) -> None:
        """Flush, and close the TensorBoard writer if this object opened it (the loggers are the trainer's)."""
        self.flush()
        self.loggers = []
        if self.experiment is None:
            return
        experiment, self.experiment = self.experiment, None
        if self.owned:
            try:
                experiment.close()
            except Exception as err:  # the last buffered events could not be written
                report_write_failure(_event_path(experiment), err)

    def _drop_experiment(self, err: BaseException) -> None:
        """Stop writing to the TensorBoard writer after a failure: reported once (naming its event file or folder),
        closed if the library opened it, never raised."""
        self._pending = None
        experiment, self.experiment = self.experiment, None
        if experiment is None:
            return
        report_write_failure(_event_path(experiment), err)
        if self.owned:
            with contextlib.suppress(Exception):  # the failure was reported; what the writer held is lost with it
                experiment.close()

    def _drop(self, logger: Any, err: Exception) -> None:
        if logger in self.loggers:
            self.loggers.remove(logger)
        log.warning(
            "%s failed (%s: %s): lightning_diag stops writing to it for this run",
            type(logger).__name__,
            type(err).__name__,
            err,
        )


@functools.lru_cache(maxsize=4096)
def _in_summary(tag: str) -> bool:
    return tag != ALERT_COUNT_TAG and any(fnmatch.fnmatchcase(tag, p) for p in SUMMARY_SERIES)


def _event_path(experiment: Any) -> str:
    """The event file a ``SummaryWriter`` writes (its folder, or the object, when that is not known)."""
    event_writer = getattr(getattr(experiment, "file_writer", None), "event_writer", None)
    name = getattr(event_writer, "_file_name", None)
    if isinstance(name, str):
        return name
    get_logdir = getattr(experiment, "get_logdir", None)
    return str(get_logdir()) if callable(get_logdir) else repr(experiment)


class _GuardedEventFile:
    """The file object under a ``SummaryWriter``'s record writer, whose writes TensorBoard's writer thread makes.

    TensorBoard's thread dies on the first failed write (printing a traceback) and every later call of the writer
    raises that error. Guarded, the first failure is reported once (:func:`report_write_failure`, from the thread),
    kept in :attr:`error`, and later writes are dropped: the file ends there, the thread lives, nothing raises.
    """

    def __init__(self, inner: Any, path: str) -> None:
        self._inner = inner
        self.path = path
        self.error: BaseException | None = None

    def _fail(self, err: BaseException) -> None:
        self.error = err
        report_write_failure(self.path, err)

    def write(self, data: bytes) -> None:
        """Write through unless a write failed before."""
        if self.error is None:
            try:
                self._inner.write(data)
            except Exception as err:
                self._fail(err)

    def flush(self) -> None:
        """Flush through unless a write failed before."""
        if self.error is None:
            try:
                self._inner.flush()
            except Exception as err:
                self._fail(err)

    def close(self) -> None:
        """Close the file (a failure to write what it still buffered is reported, not raised)."""
        try:
            self._inner.close()
        except Exception as err:
            if self.error is None:
                self._fail(err)

    @property
    def closed(self) -> bool:
        """Whether the file is closed."""
        return bool(getattr(self._inner, "closed", False))


def _guard_event_file(experiment: Any) -> _GuardedEventFile | None:
    """Guard the event file of a ``SummaryWriter`` the library opened (see :class:`_GuardedEventFile`); ``None``
    when the writer is not laid out as ``torch.utils.tensorboard`` lays it out (its calls are still guarded)."""
    event_writer = getattr(getattr(experiment, "file_writer", None), "event_writer", None)
    record_writer = getattr(getattr(event_writer, "_async_writer", None), "_writer", None)
    inner = getattr(record_writer, "_writer", None)
    methods = ("write", "flush", "close")
    if record_writer is None or inner is None or not all(callable(getattr(inner, m, None)) for m in methods):
        return None
    guarded = _GuardedEventFile(inner, _event_path(experiment))
    record_writer._writer = guarded
    return guarded


def _tensorboard_scalars(experiment: Any, values: Mapping[str, float], step: int) -> None:
    """Write ``values`` to a TensorBoard writer that is not a ``SummaryWriter`` (whose scalars
    :meth:`DiagWriter._tensorboard` gathers into one event a step): ``add_scalar`` per tag."""
    for name, value in values.items():
        experiment.add_scalar(name, value, global_step=step)
