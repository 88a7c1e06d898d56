"""The rollback policy of ``AnomalyAlarm(on_nonfinite="rollback")``: which snapshot to restore, and when to give up.

Plain Python (no torch, no Lightning): the callback hands it snapshot steps and trust flags, it answers with the
step to restore and writes the ``nonfinite_rollback`` alert. The snapshots themselves live in
:mod:`lightning_diag.instrument.snapshots`.

Policy:

* a snapshot is taken every ``every_n_steps`` optimizer steps; the newest ``keep`` are kept;
* a snapshot is *trusted* unless the mean training loss of the steps before it was above ``spike_factor`` times
  the running median of the loss (weights driven off by a burst of bad batches keep producing finite but
  exploding losses for many steps before the first NaN: such a snapshot is already ruined);
* on a non-finite step the newest trusted snapshot is restored (the oldest kept one when none is trusted);
  snapshots newer than it are dropped (they belong to the trajectory that failed);
* a non-finite step within ``repeat_window`` steps of the last rollback goes further back: the snapshot that
  rollback restored is dropped too, unless it is the oldest kept (a burst of bad batches longer than one step):
  then it is restored again, at the lower learning rate;
* every rollback multiplies the learning rates by ``lr_factor`` for the rest of the run;
* after ``max_rollbacks`` rollbacks (or before the first snapshot) the next non-finite step stops training.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from lightning_diag.core.record import Alert, Severity
from lightning_diag.core.registry import COUNT, FRACTION, STEPS, RuleSpec, register
from lightning_diag.rules.base import Rule, StepContext
from lightning_diag.rules.measures import Measure, Measures
from lightning_diag.rules.verdicts import RollbackChoice

__all__ = [
    "DEFAULT_MAX_ROLLBACKS",
    "DEFAULT_ROLLBACK_EVERY_N_STEPS",
    "DEFAULT_ROLLBACK_LR_FACTOR",
    "DEFAULT_ROLLBACK_SNAPSHOTS",
    "DEFAULT_SPIKE_FACTOR",
    "NONFINITE_ROLLBACK",
    "NONFINITE_ROLLBACK_SPEC",
    "RollbackRule",
]

# -- declaration: AnomalyAlarm(on_nonfinite="rollback") (issue 12); its settings are the rollback arguments -----
NONFINITE_ROLLBACK_SPEC = register(RuleSpec(
    "nonfinite_rollback", "AnomalyAlarm", "warning", None,
    "a non-finite step rolled back to a snapshot, learning rates x{lr_factor:g} per rollback",
    settings={"every_n_steps": 50, "lr_factor": 0.5, "max_rollbacks": 3, "snapshots": 3}, check="nonfinite",
    limits={"every_n_steps": COUNT, "lr_factor": FRACTION, "max_rollbacks": STEPS, "snapshots": COUNT},
))
NONFINITE_ROLLBACK = NONFINITE_ROLLBACK_SPEC.rule_id
_SPEC = NONFINITE_ROLLBACK_SPEC
#: Optimizer steps between two snapshots (see docs/anomaly_alarm.md for the cost).
DEFAULT_ROLLBACK_EVERY_N_STEPS = int(_SPEC.settings["every_n_steps"])
#: Every rollback multiplies the learning rates by this, for the rest of the run.
DEFAULT_ROLLBACK_LR_FACTOR = float(_SPEC.settings["lr_factor"])
#: Rollbacks allowed in one fit before the alarm stops training.
DEFAULT_MAX_ROLLBACKS = int(_SPEC.settings["max_rollbacks"])
#: Snapshots kept.
DEFAULT_ROLLBACK_SNAPSHOTS = int(_SPEC.settings["snapshots"])
#: A snapshot is not trusted when the loss before it was above this multiple of its running median.
DEFAULT_SPIKE_FACTOR = 3.0


class RollbackRule(Rule):
    """Chooses the snapshot to restore and counts rollbacks.

    Args:
        lr_factor: Learning-rate multiplier applied at every rollback, in (0, 1).
        max_rollbacks: Rollbacks allowed before the alarm stops.
        repeat_window: A non-finite step this many optimizer steps after a rollback or fewer goes further back.

    Example:
        >>> rule = RollbackRule(lr_factor=0.5, max_rollbacks=3, repeat_window=50)
        >>> rule.choose([0, 50, 100], [True, True, False], now=120).step
        50
        >>> rule.record(restored=50, now=120)
        0.5
        >>> rule.choose([0, 50], [True, True], now=130).step  # again within 50 steps: further back
        0
        >>> rule.record(restored=0, now=130)
        0.25
        >>> rule.choose([0], [True], now=131).step  # again, and no older one: the same snapshot again
        0
    """

    specs = (NONFINITE_ROLLBACK_SPEC,)
    setting_keys: ClassVar[Mapping[str, str]] = {"repeat_window": _SPEC.key("every_n_steps")}
    needs = frozenset({Measure.ROLLBACK})
    severity: ClassVar[Severity] = Severity.WARNING
    state_keys: ClassVar[tuple[str, ...]] = ("rollbacks", "lr_scale", "last_rollback_step", "last_restored_step")
    #: The trust test of the snapshots it chooses among (the recovery's snapshot store applies it).
    spike_factor: ClassVar[float] = DEFAULT_SPIKE_FACTOR

    def __init__(
        self,
        lr_factor: float = DEFAULT_ROLLBACK_LR_FACTOR,
        max_rollbacks: int = DEFAULT_MAX_ROLLBACKS,
        repeat_window: int = DEFAULT_ROLLBACK_EVERY_N_STEPS,
    ) -> None:
        super().__init__()
        self.lr_factor = float(lr_factor)
        self.max_rollbacks = int(max_rollbacks)
        self.repeat_window = int(repeat_window)
        self.rollbacks = 0
        self.lr_scale = 1.0
        self.last_rollback_step: int | None = None
        self.last_restored_step: int | None = None

    @property
    def exhausted(self) -> bool:
        """Whether ``max_rollbacks`` rollbacks were made already."""
        return self.rollbacks >= self.max_rollbacks

    def choose(self, steps: list[int], trusted: list[bool], now: int) -> RollbackChoice:
        """The snapshot to restore at non-finite step ``now``, given the kept snapshot steps and their trust."""
        if self.exhausted:
            return RollbackChoice(None, None, f"{self.rollbacks} rollbacks made already (max_rollbacks)")
        pairs = sorted(zip(steps, trusted, strict=True))
        if not pairs:
            return RollbackChoice(None, None, "no snapshot was taken yet")
        repeat = self.last_rollback_step is not None and now - self.last_rollback_step <= self.repeat_window
        how = []
        if repeat:
            how.append(f"non-finite again {now - (self.last_rollback_step or 0)} steps after the last rollback")
            older = [(s, t) for s, t in pairs if self.last_restored_step is None or s < self.last_restored_step]
            if older:
                pairs = older
            else:
                # a burst of bad batches longer than one step fails again right after the rollback: the
                # snapshot is the oldest there is, so it is restored again, at the lower learning rate
                # (max_rollbacks bounds the retries of a snapshot that is itself ruined)
                pairs = pairs[:1]
                how.append("no older snapshot is kept: the same one again")
        good = [s for s, t in pairs if t]
        step = good[-1] if good else pairs[0][0]
        if not good:
            how.append("no snapshot is trusted (the loss was spiking at each): the oldest kept")
        elif step != pairs[-1][0]:
            how.append(f"newer snapshots were taken while the loss was spiking ({pairs[-1][0]})")
        return RollbackChoice(step, step, "; ".join(how))

    def record(self, restored: int, now: int) -> float:
        """Count a rollback to snapshot ``restored`` at step ``now``; return the learning-rate scale in force."""
        self.rollbacks += 1
        self.lr_scale *= self.lr_factor
        self.last_rollback_step = now
        self.last_restored_step = restored
        return self.lr_scale

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """The ``nonfinite_rollback`` warning of the rollback just recorded (``m.rollback``)."""
        assert m.rollback is not None  # checked against `needs`
        restored, found, source, reason = m.rollback.restored, m.rollback.found, m.rollback.source, m.rollback.reason
        why = f" ({reason})" if reason else ""
        return [
            self._alert(
                ctx,
                f"non-finite values at global step {ctx.global_step} ({found}): rolled back to the snapshot of step "
                f"{restored}{why}; learning rates now x{self.lr_scale:.4g} (rollback {self.rollbacks} of "
                f"{self.max_rollbacks}); the batches in between are not replayed",
                source=source,
                value=float(self.rollbacks),
                threshold=float(self.max_rollbacks),
            )
        ]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (see :meth:`Rule.load_state_dict`)."""
        super().load_state_dict(state)
        self.rollbacks = int(self.rollbacks)
        self.lr_scale = float(self.lr_scale)
