"""Models, datasets and callbacks for the SystemMonitor scenario tests (real ``Trainer.fit`` runs)."""

from __future__ import annotations

import time
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn

FAST: dict[str, Any] = dict(
    accelerator="cpu",
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
    num_sanity_val_steps=0,
    logger=False,
)


class FakeTime:
    """A ``TimeSource`` for ``SystemMonitor.time_source`` whose readings move only when a test says so: timings
    become exact whatever the machine's load.

    ``advance(seconds)`` moves the wall clock and the process CPU time together (work done by this process);
    ``advance(seconds, cpu=False)`` moves the wall clock only (sleeping, waiting).
    """

    def __init__(self, pressure: float | None = None, others: float | None = None) -> None:
        self.now = self.start = 1000.0
        self.cpu_now = 10.0
        #: The machine's CPU pressure: the share of the wall time with some task waiting for a CPU (``None``: the
        #: machine keeps none).
        self.share = pressure
        #: The CPUs the machine's other processes use (``None``: the machine keeps no count).
        self.others = others
        self._other_total, self._other_at = 0.0, self.now

    def wall(self) -> float:
        return self.now

    def cpu(self) -> float:
        return self.cpu_now

    def pressure(self) -> float | None:
        return None if self.share is None else self.share * (self.now - self.start)

    def other_cpu(self) -> float | None:
        if self.others is None:
            return None
        self._other_total += self.others * (self.now - self._other_at)  # at the rate set since the last read
        self._other_at = self.now
        return self._other_total

    def advance(self, seconds: float, cpu: bool = True) -> None:
        self.now += seconds
        if cpu:
            self.cpu_now += seconds


class Tick(pl.Callback):
    """Every training batch costs ``seconds`` of (fake) compute: the step's own time, outside the diagnostics."""

    def __init__(self, clock: FakeTime, seconds: float) -> None:
        self.clock = clock
        self.seconds = seconds

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.clock.advance(self.seconds)


class SleepyData(torch.utils.data.Dataset):
    """Random features; ``__getitem__`` sleeps ``sleep_s`` (a slow dataset, with ``num_workers=0``), or moves
    ``clock`` (a :class:`FakeTime`) on by as much."""

    def __init__(
        self, n: int, features: int, sleep_s: float = 0.0, seq: int = 0, vocab: int = 32, clock: FakeTime | None = None
    ) -> None:
        g = torch.Generator().manual_seed(0)
        if seq:  # token ids; the target (their mean) is learnable, so a healthy run's loss falls
            self.x = torch.randint(0, vocab, (n, seq), generator=g)
            self.y = self.x.float().mean(dim=1, keepdim=True) / vocab
        else:
            self.x = torch.randn(n, features, generator=g)
            self.y = self.x[:, :1] * 0.5 + 0.1 * torch.randn(n, 1, generator=g)
        self.sleep_s = sleep_s
        self.clock = clock

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sleep_s and self.clock is not None:
            self.clock.advance(self.sleep_s, cpu=False)
        elif self.sleep_s:
            time.sleep(self.sleep_s)
        return self.x[i], self.y[i]


def leak_batch() -> int:
    """The batch size at which :class:`MLP`'s ``leak=True`` keeps ~1.2% of the process's RSS every step (two saved
    activations of 256 floats per sample; 15% growth measured at half this size), so the RSS grows ~30% over
    ``SystemMonitor``'s default 8-interval window whatever its base."""
    from lightning_diag.instrument.memory import host_rss_bytes

    return int(min(max(host_rss_bytes() * 0.024 / (4 * 256 * 4), 512), 16384))


class MLP(pl.LightningModule):
    """An MLP regression whose step takes milliseconds; ``leak=True`` keeps every loss with its graph."""

    def __init__(
        self, features: int = 64, hidden: int = 256, batch: int = 16, sleep_s: float = 0.0, leak: bool = False,
        samples: int = 4096, clock: FakeTime | None = None,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 1))
        self.data = SleepyData(samples, features, sleep_s, clock=clock)
        self.batch = batch
        self.leak = leak
        self.kept: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = (self.net(x) - y).pow(2).mean()
        if self.leak:
            # the classic leak: a loss kept for later with its whole graph (never backpropagated, so every
            # activation it saved stays alive); `.item()` or `.detach()` is the fix
            self.kept.append((self.net(x) - y).abs().mean())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", (self.net(x) - y).pow(2).mean())

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch, shuffle=True)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class Encoder(pl.LightningModule):
    """A small transformer encoder on token ids: a step of some milliseconds, attention the monitors can see."""

    def __init__(self, width: int = 64, seq: int = 32, batch: int = 16, samples: int = 2048) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, width)
        self.layers = nn.ModuleList(
            [nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True) for _ in range(2)]
        )
        self.head = nn.Linear(width, 1)
        self.data = SleepyData(samples, 0, seq=seq)
        self.batch = batch

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(dim=1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, y = batch
        return (self(ids) - y).pow(2).mean()

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch, shuffle=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StallEvery(pl.Callback):
    """Sleeps ``stall_s`` (or moves ``clock`` on by as much) at the end of every ``period``-th training batch (a
    periodic stall)."""

    def __init__(self, period: int, stall_s: float, clock: FakeTime | None = None) -> None:
        self.period = period
        self.stall_s = stall_s
        self.clock = clock

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step % self.period == 0:
            if self.clock is not None:
                self.clock.advance(self.stall_s, cpu=False)
            else:
                time.sleep(self.stall_s)


class Recorder:
    """A stand-in writer that keeps every scalar: ``values[tag] -> [(step, value), ...]``."""

    def __init__(self) -> None:
        self.values: dict[str, list[tuple[int, float]]] = {}

    def scalars(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.values.setdefault(k, []).append((step, float(v)))


class BusyBlocks(pl.Callback):
    """Burns a random amount of CPU time (0–40 ms, seeded) on every step of each block of ``block`` steps:
    sustained changes of the step's compute, measured in CPU time whatever the machine's load (or moves
    ``clock`` on by as much)."""

    def __init__(self, block: int = 10, seed: int = 0, clock: FakeTime | None = None) -> None:
        self.block = block
        choice = torch.randint(0, 5, (1000,), generator=torch.Generator().manual_seed(seed))
        self.levels = torch.tensor([0.0, 0.005, 0.01, 0.02, 0.04])[choice]
        self.clock = clock

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.clock is not None:  # the same CPU time, on the fake clock: exact
            self.clock.advance(float(self.levels[trainer.global_step // self.block]))
            return
        target = time.process_time() + float(self.levels[trainer.global_step // self.block])
        while time.process_time() < target:
            pass
