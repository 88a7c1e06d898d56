"""Memory and device-utilisation readings: host RSS, CUDA allocator statistics and NVML counters.

Each reader takes its dependency as an argument, so the CUDA and NVML paths are unit-tested with fakes on a
machine that has neither.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["NvmlProbe", "cuda_memory", "host_rss_bytes"]


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
