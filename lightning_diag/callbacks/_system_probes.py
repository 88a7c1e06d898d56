"""What SystemMonitor reads the machine with: clocks, hook timers, trainer patches, memory and NVML probes.

Each probe is a small class with its dependency injectable, so the CUDA and NVML paths are unit-tested with
fakes on a machine that has neither.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import pytorch_lightning as pl
import torch

__all__ = [
    "CudaClock",
    "HookTimer",
    "HostClock",
    "NvmlProbe",
    "batch_size_and_tokens",
    "cuda_memory",
    "host_rss_bytes",
    "time_save_checkpoint",
    "unwrap_batch_end",
    "wrap_batch_end",
]


# -- clocks --------------------------------------------------------------------------------------------------
class HostClock:
    """Marks are ``time.perf_counter()`` readings; durations are ready at once."""

    def mark(self) -> Any:
        """A point in time."""
        return time.perf_counter()

    def durations(self, pairs: list[tuple[Any, Any]]) -> list[float]:
        """Seconds between each ``(start, end)`` pair."""
        return [float(end - start) for start, end in pairs]


class CudaClock:
    """Marks are CUDA events recorded on the current stream: nothing waits for the device until
    :meth:`durations`, called on logging steps only, synchronises on the last event.

    Args:
        event_factory: Makes a timing event (``torch.cuda.Event(enable_timing=True)`` by default; tests pass a
            fake with ``record()``, ``synchronize()`` and ``elapsed_time(other)`` in milliseconds).
    """

    def __init__(self, event_factory: Callable[[], Any] | None = None) -> None:
        self.event_factory = event_factory or functools.partial(torch.cuda.Event, enable_timing=True)

    def mark(self) -> Any:
        """Record an event on the current stream."""
        event = self.event_factory()
        event.record()
        return event

    def durations(self, pairs: list[tuple[Any, Any]]) -> list[float]:
        """Seconds between each ``(start, end)`` pair of events (one host synchronisation)."""
        if not pairs:
            return []
        pairs[-1][1].synchronize()
        return [float(start.elapsed_time(end)) / 1e3 for start, end in pairs]


# -- the diagnostics' own cost ------------------------------------------------------------------------------
#: Hooks whose time is counted: every per-step, per-epoch and validation hook a callback may override.
TIMED_HOOKS = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_validation_start",
    "on_validation_end",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_save_checkpoint",
)

_RECORDER_METHODS = ("add", "add_probabilities", "mha_pre_hook")


class HookTimer:
    """Wall time spent inside the hooks of given callbacks, and in the attention recorder, by name.

    :meth:`attach` puts a timing wrapper on each instance (an instance attribute shadowing the class's hook, so
    Lightning's ``getattr(callback, hook)`` finds it) and on the methods of
    :class:`~lightning_diag.attention.AttentionRecorder`; :meth:`detach` removes them all. Nested calls (a
    recorder call inside a callback's hook) count once, for the innermost owner only.

    Wall time on the host: with CUDA, kernels the hooks launch run asynchronously and are not counted.
    """

    RECORDER = "AttentionRecorder"

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._wrapped: list[tuple[Any, str]] = []
        self._recorder_patch: dict[str, Any] = {}
        self._stack: list[list[float]] = []

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` wrapped so that its wall time (less nested timed calls) is counted under ``name``."""
        seconds = self.seconds
        stack = self._stack

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            inner = [0.0]
            stack.append(inner)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                stack.pop()
                seconds[name] = seconds.get(name, 0.0) + elapsed - inner[0]
                if stack:
                    stack[-1][0] += elapsed

        return wrapper

    def attach(self, callbacks: Iterable[pl.Callback], recorder: bool = True) -> list[str]:
        """Wrap the overridden hooks of ``callbacks``; returns the names they are counted under."""
        names: list[str] = []
        for cb in callbacks:
            base = type(cb).__name__
            name, n = base, 2
            while name in names:
                name, n = f"{base}_{n}", n + 1
            names.append(name)
            self.seconds.setdefault(name, 0.0)
            for hook in TIMED_HOOKS:
                impl = getattr(type(cb), hook, None)
                if impl is None or impl is getattr(pl.Callback, hook) or hook in vars(cb):
                    continue
                setattr(cb, hook, self.timed(name, getattr(cb, hook)))
                self._wrapped.append((cb, hook))
        if recorder:
            self._patch_recorder()
        return names

    def _patch_recorder(self) -> None:
        from lightning_diag.attention import AttentionRecorder

        self.seconds.setdefault(self.RECORDER, 0.0)
        for method in _RECORDER_METHODS:
            original = vars(AttentionRecorder).get(method)
            if original is None or getattr(original, "_diag_timed", False):
                continue
            self._recorder_patch[method] = original
            if method == "mha_pre_hook":
                def make_hook(rec: Any, name: str, _orig: Any = original, _timed: Any = self.timed) -> Any:
                    return _timed(HookTimer.RECORDER, _orig(rec, name))

                patched: Any = make_hook
            else:
                patched = self.timed(self.RECORDER, original)
            patched._diag_timed = True
            setattr(AttentionRecorder, method, patched)

    def detach(self) -> None:
        """Remove every wrapper."""
        for cb, hook in self._wrapped:
            vars(cb).pop(hook, None)
        self._wrapped = []
        if self._recorder_patch:
            from lightning_diag.attention import AttentionRecorder

            for method, original in self._recorder_patch.items():
                setattr(AttentionRecorder, method, original)
            self._recorder_patch = {}

    def take(self) -> dict[str, float]:
        """The seconds counted since the last call, by name (then reset to zero)."""
        taken = dict(self.seconds)
        for key in self.seconds:
            self.seconds[key] = 0.0
        return taken


# -- the trainer's step boundary and checkpoint saving --------------------------------------------------------
def wrap_batch_end(trainer: pl.Trainer, close: Callable[[pl.Trainer], None]) -> tuple[Any, Any]:
    """Call ``close(trainer)`` after the last callback's ``on_train_batch_end``; returns the handle for
    :func:`unwrap_batch_end`.

    Lightning runs the callbacks' hooks in list order, so the time other callbacks spend there is the step's,
    not data waiting.
    """
    last = trainer.callbacks[-1]  # type: ignore[attr-defined]
    previous = vars(last).get("on_train_batch_end")
    inner = last.on_train_batch_end

    def on_train_batch_end(trainer: pl.Trainer, *args: Any, **kwargs: Any) -> Any:
        try:
            return inner(trainer, *args, **kwargs)
        finally:
            close(trainer)

    last.on_train_batch_end = on_train_batch_end
    return last, previous


def unwrap_batch_end(boundary: tuple[Any, Any] | None) -> None:
    """Undo :func:`wrap_batch_end` (``None``: nothing to undo)."""
    if boundary is not None:
        last, previous = boundary
        if previous is None:
            vars(last).pop("on_train_batch_end", None)
        else:
            last.on_train_batch_end = previous


def time_save_checkpoint(trainer: pl.Trainer, add: Callable[[float], None]) -> Callable[..., Any] | None:
    """Pass the seconds of every ``trainer.save_checkpoint`` call to ``add``.

    The timer is an instance attribute of the trainer; it returns it (for :func:`untime_save_checkpoint`), or
    ``None`` when the trainer's ``save_checkpoint`` is already replaced on the instance by someone else, which is
    then left as it is.
    """
    if "save_checkpoint" in vars(trainer):
        return None
    original = trainer.save_checkpoint

    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            add(time.perf_counter() - start)

    trainer.save_checkpoint = save_checkpoint  # type: ignore[method-assign]
    return save_checkpoint


def untime_save_checkpoint(trainer: pl.Trainer, timer: Callable[..., Any] | None) -> None:
    """Remove the timer :func:`time_save_checkpoint` installed, and nothing else."""
    if timer is not None and vars(trainer).get("save_checkpoint") is timer:
        del vars(trainer)["save_checkpoint"]


# -- memory --------------------------------------------------------------------------------------------------
def host_rss_bytes() -> float:
    """The process's resident set size in bytes: ``psutil`` when installed, else ``/proc/self/statm``, else the
    peak RSS from ``resource`` (``nan`` when none works)."""
    try:
        import psutil

        return float(psutil.Process().memory_info().rss)
    except Exception:
        pass
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return float(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except Exception:
        pass
    try:
        import resource
        import sys

        peak = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        return peak if sys.platform == "darwin" else peak * 1024
    except Exception:
        return float("nan")


def cuda_memory(device: torch.device, cuda: Any = None) -> dict[str, float]:
    """Allocated, reserved and peak-allocated bytes of a CUDA device since the last call (the peak is reset).

    Args:
        device: The device; anything but CUDA gives ``{}``.
        cuda: The ``torch.cuda`` module (tests pass a fake).
    """
    if device.type != "cuda":
        return {}
    cuda = cuda or torch.cuda
    values = {
        "cuda_allocated": float(cuda.memory_allocated(device)),
        "cuda_reserved": float(cuda.memory_reserved(device)),
        "cuda_peak": float(cuda.max_memory_allocated(device)),
    }
    cuda.reset_peak_memory_stats(device)
    return values


class NvmlProbe:
    """GPU utilisation, memory, temperature, power and clocks through NVML (``nvidia-ml-py``), when present.

    Args:
        index: The CUDA device index.
        module: The ``pynvml`` module (tests pass a fake); ``None`` imports it, and the probe is inactive when
            that fails or NVML cannot start.
    """

    def __init__(self, index: int, module: Any = None) -> None:
        self.nvml: Any = None
        self.handle: Any = None
        try:
            if module is None:
                import pynvml as module  # type: ignore[no-redef]
            module.nvmlInit()
            self.handle = module.nvmlDeviceGetHandleByIndex(index)
            self.nvml = module
        except Exception:
            self.nvml = None

    @property
    def active(self) -> bool:
        """Whether NVML answered."""
        return self.nvml is not None

    def utilization(self) -> float:
        """GPU utilisation in percent over NVML's last sample period (``nan`` on failure)."""
        if self.nvml is None:
            return float("nan")
        try:
            return float(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
        except Exception:
            return float("nan")

    def snapshot(self) -> dict[str, float]:
        """Memory used (MiB), temperature (C), power (W) and SM clock (MHz); what fails is left out."""
        if self.nvml is None:
            return {}
        nv, h = self.nvml, self.handle
        readers: dict[str, Callable[[], float]] = {
            "gpu_memory_mib": lambda: nv.nvmlDeviceGetMemoryInfo(h).used / 2**20,
            "gpu_temperature_c": lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
            "gpu_power_w": lambda: nv.nvmlDeviceGetPowerUsage(h) / 1e3,
            "gpu_sm_clock_mhz": lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
        }
        values = {}
        for key, read in readers.items():
            try:
                values[key] = float(read())
            except Exception:
                continue
        return values


# -- throughput ------------------------------------------------------------------------------------------------
_TOKEN_KEYS = ("attention_mask", "input_ids")


def batch_size_and_tokens(batch: Any) -> tuple[int, int | torch.Tensor | None]:
    """Samples in a batch and its tokens, without a host synchronisation.

    The batch size is the first dimension of the first tensor found (a tensor, a mapping's values, a sequence).
    Tokens: an ``attention_mask`` entry's sum (a device tensor, read later), else an ``input_ids`` entry's
    number of elements, else the first tensor's when it is a 2-D integer tensor (token ids); ``None`` otherwise.
    """
    first = _first_tensor(batch)
    size = int(first.shape[0]) if first is not None and first.dim() > 0 else 0
    tokens: int | torch.Tensor | None = None
    if isinstance(batch, dict):
        mask, ids = batch.get("attention_mask"), batch.get("input_ids")
        if isinstance(mask, torch.Tensor):
            tokens = mask.detach().sum()
        elif isinstance(ids, torch.Tensor):
            tokens = ids.numel()
    elif first is not None and first.dim() == 2 and not first.is_floating_point() and first.dtype != torch.bool:
        tokens = first.numel()
    return size, tokens


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None
