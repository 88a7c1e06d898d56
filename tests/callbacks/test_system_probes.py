"""The CUDA and NVML paths of SystemMonitor, with fakes (this machine has neither)."""

from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch

from lightning_diag.callbacks.system_monitor.hooks import HookTimer
from lightning_diag.instrument.batches import batch_size_and_tokens
from lightning_diag.instrument.clocks import CudaClock
from lightning_diag.instrument.memory import NvmlProbe, cuda_memory, host_rss_bytes


class FakeTimeline:
    """The device of one test: its clock (ms) and how often the host waited for it."""

    def __init__(self) -> None:
        self.clock = 0.0
        self.synced = 0

    def event(self) -> "FakeEvent":
        return FakeEvent(self)


class FakeEvent:
    """A ``torch.cuda.Event`` stand-in; its counts live on the test's own :class:`FakeTimeline`."""

    def __init__(self, timeline: FakeTimeline) -> None:
        self.timeline = timeline

    def record(self):
        self.timeline.clock += 5.0
        self.t = self.timeline.clock

    def synchronize(self):
        self.timeline.synced += 1

    def elapsed_time(self, other):
        return other.t - self.t  # milliseconds, like torch.cuda.Event


def test_cuda_clock_synchronises_once_when_read():
    timeline = FakeTimeline()
    clock = CudaClock(timeline.event)
    marks = [clock.mark() for _ in range(4)]
    assert timeline.synced == 0  # recording never waits for the device
    assert clock.durations([(marks[0], marks[1]), (marks[1], marks[3])]) == [0.005, 0.010]
    assert timeline.synced == 1


def test_cuda_memory_reads_and_resets_the_peak():
    calls = []
    fake = SimpleNamespace(
        memory_allocated=lambda d: 1.0,
        memory_reserved=lambda d: 2.0,
        max_memory_allocated=lambda d: 3.0,
        reset_peak_memory_stats=lambda d: calls.append(d),
    )
    device = torch.device("cuda", 0)
    assert cuda_memory(device, fake) == {"cuda_allocated": 1.0, "cuda_reserved": 2.0, "cuda_peak": 3.0}
    assert calls == [device]
    assert cuda_memory(torch.device("cpu"), fake) == {}


def test_nvml_probe_with_a_fake_module_and_without_one():
    fake = SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: f"gpu{i}",
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=87),
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=3 * 2**20),
        nvmlDeviceGetTemperature=lambda h, kind: 61,
        nvmlDeviceGetPowerUsage=lambda h: 250_000,
        nvmlDeviceGetClockInfo=lambda h, kind: (_ for _ in ()).throw(RuntimeError("not supported")),
        NVML_TEMPERATURE_GPU=0,
        NVML_CLOCK_SM=1,
    )
    probe = NvmlProbe(0, fake)
    assert probe.active and probe.utilization() == 87.0
    # what the driver does not support is left out
    assert probe.snapshot() == {"gpu_memory_mib": 3.0, "gpu_temperature_c": 61.0, "gpu_power_w": 250.0}
    broken = NvmlProbe(0, SimpleNamespace(nvmlInit=lambda: (_ for _ in ()).throw(OSError("no driver"))))
    assert not broken.active and broken.snapshot() == {}


def test_host_rss_is_a_plausible_number_of_bytes():
    assert 10 * 2**20 < host_rss_bytes() < 1 << 40


def test_batch_size_and_tokens_never_read_the_device():
    ids = torch.zeros(4, 7, dtype=torch.long)
    assert batch_size_and_tokens((ids, torch.zeros(4))) == (4, 28)
    size, tokens = batch_size_and_tokens({"input_ids": ids, "attention_mask": torch.ones(4, 7)})
    assert size == 4 and isinstance(tokens, torch.Tensor) and float(tokens) == 28.0
    assert batch_size_and_tokens((torch.randn(8, 3), torch.randn(8))) == (8, None)
    assert batch_size_and_tokens("text") == (0, None)


class Slow(pl.Callback):
    def on_train_batch_start(self, *args):
        return "done"


def test_hook_timer_times_the_parts_the_driver_calls_and_touches_no_instance():
    cb, second = Slow(), Slow()
    timer = HookTimer()
    wrap = timer.part_wrap([cb, second], skip=[(second, "on_train_batch_end")])
    assert set(timer.seconds) == {"Slow", "Slow_2"}
    part = cb.on_train_batch_start
    timed = wrap(cb, "on_train_batch_start", part)
    assert timed is not part and timed(None, None, None, 0) == "done"
    assert wrap(second, "on_train_batch_end", part) is part  # skipped
    assert wrap(Slow(), "on_train_batch_start", part) is part  # not named: not timed
    assert wrap(cb, "on_fit_start", part) is part  # not a timed hook
    assert timer.take().seconds["Slow"] > 0 and timer.take().seconds["Slow"] == 0.0
    assert "on_train_batch_start" not in vars(cb) and "on_train_batch_start" not in vars(second)


class _Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, float]] = []

    def batch_hooks_done(self) -> None:
        self.seen.append(("end", 0.0))

    def fetched(self, seconds: float) -> None:
        self.seen.append(("fetch", seconds))

    def checkpoint_saved(self, seconds: float) -> None:
        self.seen.append(("checkpoint", seconds))


def test_system_profiler_tells_its_listener_and_forwards_to_the_inner_profiler():
    from pytorch_lightning.profilers import SimpleProfiler

    from lightning_diag import SystemProfiler

    now = [0.0]
    inner = SimpleProfiler()
    profiler, events = SystemProfiler(inner, clock=lambda: now[0]), _Events()
    profiler.start("save_checkpoint")  # nobody listens yet: nothing told
    profiler.stop("save_checkpoint")
    profiler.listen(events)
    for action, seconds in [
        ("[_TrainingEpochLoop].train_dataloader_next", 0.25),
        ("save_checkpoint", 1.5),
        ("[Callback]Other.on_train_batch_end", 9.0),  # another callback's hook: not the trainer's own work
    ]:
        profiler.start(action)
        now[0] += seconds
        profiler.stop(action)
    profiler.start("[LightningModule]Net.on_train_batch_end")
    profiler.stop("[LightningModule]Net.on_train_batch_end")
    assert events.seen == [("fetch", 0.25), ("checkpoint", 1.5), ("end", 0.0)]
    assert "save_checkpoint" in inner.recorded_durations and "save_checkpoint" in profiler.summary()
    profiler.listen(None)
    profiler.start("save_checkpoint")
    profiler.stop("save_checkpoint")
    assert len(events.seen) == 3
    with pytest.raises(TypeError, match="inner"):
        SystemProfiler(inner="simple")  # type: ignore[arg-type]
