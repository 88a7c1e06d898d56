"""The base of AnomalyAlarm's checks that watch the model on sampled training steps only (``zero_output``,
``output_collapse``).

On the first batch of a sampled optimizer step (the owner's logging interval) such a check installs its watch (forward
hooks, :mod:`lightning_diag.instrument.output_watch`); at that batch's end it removes the watch, reads what the watch
saw once, and feeds it to the owner's preset (whose detector of the rule judges it). The owner says which rule
switches it off (its id, at construction); a subclass says how to build its watch and how to turn what the watch
saw into :class:`Measures`; the sampling, the switch-off and the hooks' removal are here. Other steps cost one
integer comparison: the owner calls :meth:`SampledCheck.on_batch_start` from :attr:`SampledCheck.next_step` on.
"""

from __future__ import annotations

import abc
import math
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import pytorch_lightning as pl

from lightning_diag.rules.base import StepContext
from lightning_diag.rules.measures import Measures

if TYPE_CHECKING:  # pragma: no cover
    from lightning_diag.callbacks.common.base import DiagCallback

__all__ = ["SampledCheck", "Watch"]


class Watch(Protocol):
    """What a sampled check needs of its watch: forward hooks it installs and removes."""

    @property
    def active(self) -> bool:
        """Whether the hooks are installed."""

    def start(self) -> None:
        """Install the hooks."""

    def stop(self) -> None:
        """Remove the hooks."""


WatchT = TypeVar("WatchT", bound=Watch)


class SampledCheck(abc.ABC, Generic[WatchT]):
    """Installs a watch on sampled steps and feeds what it saw to the owner's preset.

    Subclasses implement :meth:`new_watch` and :meth:`measure`.

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
        #: The global step from which :meth:`on_batch_start` may have something to do (the next sampled one).
        self.next_step: float = 0

    @abc.abstractmethod
    def new_watch(self, pl_module: pl.LightningModule) -> WatchT:
        """The watch of ``pl_module`` (built once a fit, on the first sampled step)."""

    @abc.abstractmethod
    def measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule, watch: WatchT) -> Measures | None:
        """What the stopped ``watch`` saw on the sampled batch, as measures (one host read); ``None``: nothing to
        judge."""

    def on_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """On the first batch of a sampled optimizer step: install the watch."""
        step = trainer.global_step
        if step < self.next_step:
            return
        if self.rule_id in self.owner.rule_choices.off:
            self.next_step = math.inf
            return
        every = self.owner.every_n_steps(trainer)
        if step == self.step or step % every:
            self.next_step = step - step % every + every
            return
        self.step = step
        self.next_step = step + every
        if self._watch is None:
            self._watch = self.new_watch(pl_module)
        self._watch.start()

    def on_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Remove the watch and feed what it saw to the owner's preset."""
        watch = self._watch
        if watch is None or not watch.active:
            return
        watch.stop()
        measures = self.measure(trainer, pl_module, watch)
        if measures is not None:
            ctx = StepContext(trainer.current_epoch, self.step)  # the measured step (global_step has moved on)
            self.owner.record(self.owner.feed(ctx, measures))

    def stop(self) -> None:
        """Remove any hook (the end of a fit, or an exception in the middle of a batch)."""
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.stop()
