"""``dataloader_bound`` (framework-free), fed by :class:`~lightning_diag.SystemMonitor` at its logging steps.

Exact meaning: over one logging interval, the time spent waiting for the next batch is above ``threshold`` of the
step time (without the lightning_diag callbacks' own hooks, whose cost is not the training's) **and** above
``min_wait_s`` per step, on ``patience`` consecutive intervals. Alerts once per fit: a loader too slow for the model
is a property of its settings, and a share that hovers around the threshold is the same condition, not a new one
each time it comes back.

On a contended machine (CPU pressure above :data:`~lightning_diag.rules.contention.CONTENDED_PRESSURE`,
:mod:`lightning_diag.rules.contention`) the alert is an ``info`` (source ``dataloader_contended``); a condition that
persists once the machine is free again is a warning of its own (source ``dataloader``).
"""

from __future__ import annotations

import math
import sys

from lightning_diag.core.record import Alert, Severity
from lightning_diag.core.registry import COUNT, Limit, RuleSpec, default, register
from lightning_diag.rules.base import Latch, Rule, StepContext, excess
from lightning_diag.rules.contention import contended, contention_note, format_seconds, judged_once
from lightning_diag.rules.measures import Measure, Measures

__all__ = [
    "DATALOADER_BOUND",
    "DATALOADER_BOUND_SPEC",
    "DEFAULT_DATALOADER_BOUND_MIN_WAIT_S",
    "DEFAULT_DATALOADER_BOUND_PATIENCE",
    "DEFAULT_DATALOADER_BOUND_THRESHOLD",
    "DataloaderBoundRule",
]


# -- declarations (one per rule id; the docs' thresholds table and the report read them) -----------------------
_SYSTEM = "SystemMonitor"
DATALOADER_BOUND_SPEC = register(RuleSpec(
    "dataloader_bound", _SYSTEM, "warning", 0.25,
    "waiting for data above {threshold:.0%} of the step time on {patience:g} consecutive intervals",
    settings={"patience": 3, "min_wait_s": 0.005},
    limits={"threshold": Limit(low=0.0, high=1.0), "patience": COUNT},
))
DATALOADER_BOUND = DATALOADER_BOUND_SPEC.rule_id


#: ``dataloader_bound``: data waiting above this share of the step time.
DEFAULT_DATALOADER_BOUND_THRESHOLD = default(DATALOADER_BOUND)
#: ``dataloader_bound``: consecutive logging intervals it must hold.
DEFAULT_DATALOADER_BOUND_PATIENCE = int(default(DATALOADER_BOUND_SPEC.key("patience")))
#: ``dataloader_bound``: seconds of waiting per step below which it never fires.
DEFAULT_DATALOADER_BOUND_MIN_WAIT_S = default(DATALOADER_BOUND_SPEC.key("min_wait_s"))


class DataloaderBoundRule(Rule):
    """``dataloader_bound``: fed once per logging interval with the summed waiting and step time."""

    specs = (DATALOADER_BOUND_SPEC,)
    state_keys = ("streak",)
    needs = frozenset({Measure.LOADER_WAIT})
    optional = frozenset({Measure.CPU_PRESSURE})

    def __init__(
        self,
        threshold: float = DEFAULT_DATALOADER_BOUND_THRESHOLD,
        patience: int = DEFAULT_DATALOADER_BOUND_PATIENCE,
        min_wait_s: float = DEFAULT_DATALOADER_BOUND_MIN_WAIT_S,
    ) -> None:
        super().__init__()
        self.threshold = threshold
        self.patience = patience
        self.latch = Latch(clear_after=sys.maxsize)  # once per fit: a new fit builds new rules
        self.min_wait_s = min_wait_s
        self.streak = 0

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one interval, ``m.loader_wait``: ``wait_s`` and ``step_s`` (without the diagnostics' own time)
        summed over its ``steps`` optimizer steps; an ``info`` when the interval's CPU pressure (``m.cpu_pressure``)
        makes the machine contended (a loader starved of CPU by other processes waits too)."""
        assert m.loader_wait is not None  # checked against `needs`
        wait_s, step_s, steps, source = m.loader_wait.wait_s, m.loader_wait.step_s, m.loader_wait.steps, "dataloader"
        if steps <= 0 or not (step_s > 0) or not math.isfinite(wait_s):
            return []
        share = wait_s / step_s
        busy = contended(m.cpu_pressure)
        # the margin: the smallest excess over the latest `patience` intervals (what the streak needs), recorded
        # on a free machine only (where a warning can come)
        latest = min(excess(share, self.threshold), excess(wait_s / steps, self.min_wait_s))
        window = self.held["interval"] = [*self.held.get("interval", []), latest][-self.patience :]
        if not busy:
            self.observe(min(window) if len(window) >= self.patience else 0.0, 1.0)
        active = share > self.threshold and wait_s / steps > self.min_wait_s
        self.streak = self.streak + 1 if active else 0
        persists = self.streak >= self.patience
        if not judged_once(self.latch, source, busy, persists):
            return []
        message = (
            f"the training loop waits for data {share:.0%} of the step time ({format_seconds(wait_s / steps)} per step)"
            f" on {self.streak} consecutive intervals"
        )
        if busy:
            assert m.cpu_pressure is not None  # contended
            return [
                self._alert(
                    ctx, message + contention_note(m.cpu_pressure), f"{source}_contended", share, self.threshold,
                    severity=Severity.INFO,
                )
            ]
        return [
            self._alert(
                ctx,
                message + ": raise the DataLoader's `num_workers`, set `pin_memory=True` and"
                " `persistent_workers=True`, raise `prefetch_factor`, or move preprocessing out of `__getitem__`",
                source,
                share,
                self.threshold,
            )
        ]
