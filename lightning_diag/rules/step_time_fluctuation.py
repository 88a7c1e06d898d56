"""``step_time_fluctuation`` (framework-free), fed by :class:`~lightning_diag.SystemMonitor` at its logging steps.

Exact meaning: the step times of the window (after ``warmup_steps``, without the step after a
validation run, an epoch's first step, a step that saved a checkpoint and without the steps of a periodic
pattern) are cut into blocks of ``block_steps``; the median change between consecutive block medians beyond ``z``
standard errors of the difference (the noise of the steps inside the two blocks), over ``sqrt(2)`` times their
median (:func:`~lightning_diag.stats.timing.block_fluctuation`: a level that moves once or drifts slowly is no
fluctuation, and neither is the chance difference of two blocks of jittering steps), is above ``threshold`` on
``patience`` consecutive evaluations a block apart (at least :data:`MIN_BLOCKS` blocks).

On a contended machine (CPU pressure above :data:`~lightning_diag.rules.contention.CONTENDED_PRESSURE`,
:mod:`lightning_diag.rules.contention`) the alert is an ``info`` (source ``step_time_contended``); a condition that
persists once the machine is free again is a warning of its own (source ``step_time``).
"""

from __future__ import annotations

import math

from lightning_diag.core.record import Alert, Severity
from lightning_diag.core.registry import (
    ANY_NON_NEGATIVE,
    COUNT,
    POSITIVE,
    STEPS,
    CheckSpec,
    RuleSpec,
    default,
    register,
)
from lightning_diag.core.tags import family_tag
from lightning_diag.rules.base import Latch, Rule, StepContext, excess
from lightning_diag.rules.contention import contended, contention_note, judged_once
from lightning_diag.rules.measures import Measure, Measures
from lightning_diag.rules.rows import Check, LoggedRun, finite_values, fmt, measure, run_threshold
from lightning_diag.stats.timing import block_fluctuation

__all__ = [
    "DEFAULT_STEP_TIME_FLUCTUATION_BLOCK_STEPS",
    "DEFAULT_STEP_TIME_FLUCTUATION_PATIENCE",
    "DEFAULT_STEP_TIME_FLUCTUATION_THRESHOLD",
    "DEFAULT_STEP_TIME_FLUCTUATION_Z",
    "DEFAULT_STEP_TIME_WARMUP_STEPS",
    "LATENCY_FLUCTUATION_CHECK",
    "MIN_BLOCKS",
    "STEP_TIME_FLUCTUATION",
    "STEP_TIME_FLUCTUATION_SPEC",
    "STEP_TIME_WARMUP_STEPS_KEY",
    "StepFluctuationRule",
]

_SYSTEM = "SystemMonitor"
STEP_TIME_FLUCTUATION_SPEC = register(RuleSpec(
    "step_time_fluctuation", _SYSTEM, "warning", 0.15,
    "step-time fluctuation (median change between consecutive {block_steps:g}-step block medians beyond {z:g} "
    "standard errors / (sqrt 2 x their median)) above {threshold:.0%}",
    settings={"patience": 3, "warmup_steps": 20, "block_steps": 10, "z": 2.0}, check="deploy_latency_fluctuation",
    source="seed 000 §7.1",
    limits={
        "threshold": POSITIVE, "patience": COUNT, "warmup_steps": STEPS, "block_steps": COUNT, "z": ANY_NON_NEGATIVE,
    },
))
STEP_TIME_FLUCTUATION = STEP_TIME_FLUCTUATION_SPEC.rule_id
#: ``step_time_fluctuation``'s row of the ``lightning-diag report`` checklist (registered in report order by
#: :mod:`lightning_diag.rules.catalog`).
LATENCY_FLUCTUATION_CHECK = CheckSpec("deploy_latency_fluctuation", "Deployment",
                                      "Latency fluctuation < {step_time_fluctuation:.0%}")
STEP_TIME_WARMUP_STEPS_KEY = STEP_TIME_FLUCTUATION_SPEC.key("warmup_steps")
#: ``step_time_fluctuation``: block-to-block fluctuation above this (seed 000 §7.1: 15%).
DEFAULT_STEP_TIME_FLUCTUATION_THRESHOLD = default(STEP_TIME_FLUCTUATION)
#: ``step_time_fluctuation``: consecutive evaluations it must hold.
DEFAULT_STEP_TIME_FLUCTUATION_PATIENCE = int(default(STEP_TIME_FLUCTUATION_SPEC.key("patience")))
#: Optimizer steps at the start of a fit left out of the step-time tests.
DEFAULT_STEP_TIME_WARMUP_STEPS = int(default(STEP_TIME_FLUCTUATION_SPEC.key("warmup_steps")))
#: ``step_time_fluctuation``: optimizer steps per block whose median is one point of the fluctuation.
DEFAULT_STEP_TIME_FLUCTUATION_BLOCK_STEPS = int(default(STEP_TIME_FLUCTUATION_SPEC.key("block_steps")))
#: ``step_time_fluctuation``: standard errors of the difference of two block medians a change must exceed to count
#: (run alone on this VM, the 1-10 ms steps of healthy runs jitter 7-23% inside a block, and their neighbouring block
#: medians differ by 0.5-1.4 standard errors; the step-time blocks fault's by about 100).
DEFAULT_STEP_TIME_FLUCTUATION_Z = default(STEP_TIME_FLUCTUATION_SPEC.key("z"))
#: Fewest blocks the fluctuation test judges: the median of 7 neighbouring differences (with 5 blocks, of 4, a healthy
#: run alone on this VM read up to 2.2x the threshold at its first checks; with 8, 1.35x).
MIN_BLOCKS = 8
_NEVER = -(2**62)  # no check counted yet


class StepFluctuationRule(Rule):
    """``step_time_fluctuation``: the block-to-block fluctuation of the step times above the threshold."""

    specs = (STEP_TIME_FLUCTUATION_SPEC,)
    state_keys = ("streak", "counted_at")
    needs = frozenset({Measure.COMPUTE_TIMES})
    optional = frozenset({Measure.CPU_PRESSURE})

    def __init__(
        self,
        threshold: float = DEFAULT_STEP_TIME_FLUCTUATION_THRESHOLD,
        patience: int = DEFAULT_STEP_TIME_FLUCTUATION_PATIENCE,
        block_steps: int = DEFAULT_STEP_TIME_FLUCTUATION_BLOCK_STEPS,
        z: float = DEFAULT_STEP_TIME_FLUCTUATION_Z,
    ) -> None:
        super().__init__()
        self.threshold = threshold
        self.patience = patience
        self.latch = Latch.for_patience(patience)
        self.block_steps = block_steps
        self.z = z
        self.streak = 0
        #: The global step of the last check counted in :attr:`streak`: a check counts when it brings at least one
        #: block of new steps (``block_steps`` optimizer steps later), so ``patience`` does not depend on how often
        #: the owner logs (at ``log_every_n_steps=5`` three consecutive checks share 90% of their window).
        self.counted_at = _NEVER
        #: The fluctuation of the last window judged (``nan``: too short), for the logs; not checkpoint state.
        self.last_value = math.nan

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge a window of step times already cleared of warm-up, validation and periodic steps
        (``m.compute_times``), an ``info`` when the window's CPU pressure (``m.cpu_pressure``) makes the machine
        contended; the fluctuation it measured is :attr:`last_value`."""
        times, source, pressure = m.compute_times, "step_time", m.cpu_pressure
        assert times is not None  # checked against `needs`
        self.last_value = math.nan
        if len(times) < MIN_BLOCKS * self.block_steps:
            return []
        value = self.last_value = block_fluctuation(times, self.block_steps, self.z)
        busy = contended(pressure)
        if not busy:
            self.observe(value, self.threshold)
        active = math.isfinite(value) and value > self.threshold
        if not active:
            self.streak = 0
        elif ctx.global_step >= self.counted_at + self.block_steps:  # a block of new evidence
            self.streak, self.counted_at = self.streak + 1, ctx.global_step
        persists = self.streak >= self.patience
        if not judged_once(self.latch, source, busy, persists, excess(value, self.threshold)):
            return []
        message = (
            f"step time fluctuates by {value:.0%} (median change between consecutive medians of"
            f" {self.block_steps}-step blocks beyond {self.z:g} standard errors / (sqrt 2 x their median) over the"
            f" last {len(times)} steps, warm-up,"
            f" validation and periodic steps left out) on {self.streak} consecutive checks a block apart, above"
            f" {self.threshold:.0%}"
        )
        if busy:
            assert pressure is not None  # contended
            return [
                self._alert(
                    ctx, message + contention_note(pressure), f"{source}_contended", value, self.threshold,
                    severity=Severity.INFO,
                )
            ]
        return [
            self._alert(
                ctx,
                message + ": look for contention (other jobs on the machine, thermal throttling), variable batch"
                " shapes or irregular host work",
                source,
                value,
                self.threshold,
            )
        ]


# -- the report's deploy_latency_fluctuation row ---------------------------------------------------------------


@measure("deploy_latency_fluctuation")
def _measure_latency(run: LoggedRun, check: Check) -> bool:
    # SystemMonitor's step-time fluctuation (relative MAD of block medians), judged by its rule's patience
    values = finite_values(run.scalars.get(family_tag("system", STEP_TIME_FLUCTUATION), []))
    limit = run_threshold(run, STEP_TIME_FLUCTUATION)
    check.threshold = f"step-time fluctuation <= {fmt(limit)}" if limit is not None else "not logged"
    check.threshold_value = {"value": limit} if limit is not None else {}
    if values:
        check.measured = f"step-time fluctuation up to {fmt(max(values))} (last {fmt(values[-1])})"
        check.measured_value = {"max": max(values), "last": values[-1]}
        if limit is not None and max(values) > limit:
            check.add_note(f"above the threshold on fewer consecutive checks than {STEP_TIME_FLUCTUATION}'s patience")
    return bool(values)
