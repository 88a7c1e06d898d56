"""The base of AnomalyAlarm's checks that watch the model on sampled training steps only (``zero_output``,
``output_collapse``).

A sampled step is the first batch of an optimizer step on the owner's logging cadence (``on_cadence``, decided by the
trainer's driver: the same steps ``GradientFlowMonitor``'s activation watch reads at the same interval, global steps
9, 19, 29, ... at ``log_every_n_steps=10``, so that one hooked forward serves both). There such a check starts its
watch (:mod:`lightning_diag.instrument.output_watch`), which asks the driver's forward hooks
(:class:`~lightning_diag.instrument.forward_hooks.ForwardHooks`: one hook per module for every watch of the step) for
the modules it reads; at that batch's end it stops the watch (its hooks come off), reads what the watch saw once, and
feeds it to the owner's preset (whose detector of the rule judges it). The owner says which rule switches it off (its
id, at construction); a subclass says how to build its watch and how to turn what the watch saw into
:class:`Measures` (:meth:`SampledCheck.gather` on the device, :meth:`SampledCheck.measure` once read); the sampling,
the switch-off, the hooks' removal and the host read are here: :func:`end_sampled_batch` reads what several checks
saw on one batch in one transfer. Other steps cost nothing: the owner calls :meth:`SampledCheck.on_batch_start` on
its cadence batches only.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import pytorch_lightning as pl
import torch

from lightning_diag.callbacks.common.driver import forward_hooks_of
from lightning_diag.instrument.forward_hooks import ForwardHooks
from lightning_diag.rules.base import StepContext
from lightning_diag.rules.measures import Measures

if TYPE_CHECKING:  # pragma: no cover
    from lightning_diag.callbacks.common.base import DiagCallback

__all__ = ["SampledCheck", "Watch", "end_sampled_batch", "read_together"]


class Watch(Protocol):
    """What a sampled check needs of its watch: forward hooks it installs and removes."""

    @property
    def active(self) -> bool:
        """Whether the hooks are installed."""

    def start(self, hooks: ForwardHooks | None = None) -> None:
        """Install the hooks (through ``hooks``, the driver's, when given)."""

    def stop(self) -> None:
        """Remove the hooks."""


WatchT = TypeVar("WatchT", bound=Watch)


class SampledCheck(abc.ABC, Generic[WatchT]):
    """Installs a watch on sampled steps and feeds what it saw to the owner's preset.

    Subclasses implement :meth:`new_watch`, :meth:`gather` and :meth:`measure`.

    Args:
        owner: The callback whose preset judges what the check measures, and that records and writes.
        rule_id: The rule that reads what the check measures, handed in by the owner's preset module (switched off
            by the owner's ``rules=``, the check watches nothing; its notices name it).
    """

    def __init__(self, owner: DiagCallback, rule_id: str) -> None:
        self.owner = owner
        self.rule_id = rule_id
        self.reset()

    def reset(self) -> None:
        """The start of a fit: nothing watched yet."""
        self.stop()
        self._watch: WatchT | None = None
        #: The global step measured last (the one the alerts of its batch's end name).
        self.step = -1

    @abc.abstractmethod
    def new_watch(self, pl_module: pl.LightningModule) -> WatchT:
        """The watch of ``pl_module`` (built once a fit, on the first sampled step)."""

    @abc.abstractmethod
    def gather(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, watch: WatchT
    ) -> tuple[list[torch.Tensor], Any] | None:
        """What the stopped ``watch`` saw on the sampled batch, before the host read: the floating-point device
        tensors (0-d or 1-d) of the numbers to read (:func:`read_together`) and what :meth:`measure` needs with
        them; ``None``: nothing to judge. A collective (a sum over ranks) goes here: every rank calls it on the
        same steps."""

    @abc.abstractmethod
    def measure(self, trainer: pl.Trainer, watch: WatchT, seen: Any, values: list[float]) -> Measures | None:
        """What :meth:`gather` gave (``seen``, and its tensors' numbers read to the host, in order: ``values``) as
        measures; ``None``: nothing to judge."""

    def on_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """On the first batch of an optimizer step on the owner's logging cadence: start the watch, through the
        driver's forward hooks (shared with the other watches of the step)."""
        if not self.owner.on_cadence:
            return
        step = trainer.global_step
        if step == self.step or self.rule_id in self.owner.rule_choices.off:  # a later micro-batch, or switched off
            return
        self.step = step
        if self._watch is None:
            self._watch = self.new_watch(pl_module)
        self._watch.start(forward_hooks_of(trainer))

    def take(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> tuple[list[torch.Tensor], Any] | None:
        """Remove the watch of a sampled batch and :meth:`gather` what it saw; ``None`` on other batches."""
        watch = self._watch
        if watch is None or not watch.active:
            return None
        watch.stop()
        return self.gather(trainer, pl_module, watch)

    def judge(self, trainer: pl.Trainer, seen: Any, values: list[float]) -> None:
        """Feed :meth:`measure` of what :meth:`take` gave (its tensors read: ``values``) to the owner's preset."""
        assert self._watch is not None  # take() gave something
        measures = self.measure(trainer, self._watch, seen, values)
        if measures is not None:
            ctx = StepContext(trainer.current_epoch, self.step)  # the measured step (global_step has moved on)
            self.owner.record(self.owner.feed(ctx, measures))

    def stop(self) -> None:
        """Remove any hook (the end of a fit, or an exception in the middle of a batch)."""
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.stop()


def end_sampled_batch(checks: Sequence[SampledCheck[Any]], trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """At a training batch's end: remove the watches of ``checks`` that sampled it, read what they saw in one host
    transfer (:func:`read_together`), and feed it to the owner's preset, check by check in the order given."""
    taken = [(check, seen) for check in checks if (seen := check.take(trainer, pl_module)) is not None]
    if not taken:
        return
    values = read_together([tensors for _, (tensors, _) in taken])
    for (check, (_, seen)), read in zip(taken, values, strict=True):
        check.judge(trainer, seen, read)


def read_together(groups: Sequence[Sequence[torch.Tensor]]) -> list[list[float]]:
    """The numbers of each group of floating-point tensors (0-d or 1-d) as one host list per group, exactly, in one
    transfer where they share a device: one stack of 0-d tensors (or one concatenation), whose dtype promotion
    holds each value exactly (bfloat16 and float16 in float32, float32 in float64); one read each otherwise.

    Example:
        >>> read_together([[torch.tensor(1.5), torch.tensor(-2.0)], [], [torch.tensor(3.0, dtype=torch.bfloat16)]])
        [[1.5, -2.0], [], [3.0]]
    """
    flat = [t for group in groups for t in group]
    if not flat:
        values: list[float] = []
    elif any(t.device != flat[0].device for t in flat):  # outputs on several devices: one read each
        values = [v for t in flat for v in t.reshape(-1).tolist()]
    elif all(t.dim() == 0 for t in flat):
        values = torch.stack(flat).tolist()
    else:
        values = torch.cat([t.reshape(-1) for t in flat]).tolist()
    out, start = [], 0
    for group in groups:
        n = sum(t.numel() for t in group)
        out.append(values[start : start + n])
        start += n
    return out
