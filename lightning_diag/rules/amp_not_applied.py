"""``amp_not_applied``: mixed precision configured, float32 computed (framework-free).

Fed by :class:`~lightning_diag.AnomalyAlarm`
(:mod:`lightning_diag.callbacks.anomaly_alarm.runtime_checks` measures).

``amp_not_applied`` (warning): ``precision="16-mixed"`` or ``"bf16-mixed"`` is configured, but more than
``share`` of the matmul layers' parameters (``nn.Linear``, ``nn.Conv*``) computed in float32 on a sampled
training step: the forward escapes autocast (an ``autocast(enabled=False)`` block, inputs cast after it), so
the run pays for float32. Judged once per fit, on its first training batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import FRACTION, RuleSpec, default, register
from lightning_diag.rules.base import Rule, StepContext, list_names
from lightning_diag.rules.measures import Measure, Measures
from lightning_diag.rules.rows import Check, LoggedRun, measure

__all__ = [
    "AMP_NOT_APPLIED",
    "AMP_NOT_APPLIED_SPEC",
    "DEFAULT_AMP_SHARE",
    "AmpRule",
]

_ALARM = "AnomalyAlarm"

AMP_NOT_APPLIED_SPEC = register(
    RuleSpec(
        "amp_not_applied",
        _ALARM,
        "warning",
        0.5,
        "mixed precision configured, but more than {threshold:g} of the matmul layers' parameters compute in "
        "float32 on a sampled training step",
        limits={"threshold": FRACTION},
    )
)
AMP_NOT_APPLIED = AMP_NOT_APPLIED_SPEC.rule_id

#: ``amp_not_applied``: share of the matmul layers' parameters computing in float32 above which it fires.
DEFAULT_AMP_SHARE: float = default(AMP_NOT_APPLIED_SPEC.rule_id)
#: Names an alert lists, at most.
_SHOWN = 4


class AmpRule(Rule):
    """``amp_not_applied``: one sampled step's matmul layers and the dtype they computed in.

    Example:
        >>> from lightning_diag.rules.measures import AmpLayers
        >>> rule = AmpRule(0.5)
        >>> m = Measures(amp=AmpLayers({"fc1": 100, "fc2": 100}, {"fc1": 100, "fc2": 100}, "bf16-mixed"))
        >>> [(a.rule, a.value) for a in rule.judge(StepContext(0, 1), m)]
        [('amp_not_applied', 1.0)]
        >>> m = Measures(amp=AmpLayers({"fc1": 100, "fc2": 100}, {"fc2": 10}, "bf16-mixed"))
        >>> AmpRule(0.5).judge(StepContext(0, 1), m)
        []
    """

    specs = (AMP_NOT_APPLIED_SPEC,)
    setting_keys: ClassVar[Mapping[str, str]] = {"share": AMP_NOT_APPLIED}
    state_keys = ("checks", "last_share")
    needs = frozenset({Measure.AMP})

    def __init__(self, share: float = DEFAULT_AMP_SHARE) -> None:
        super().__init__()
        self.share = share
        self.checks = 0
        self.last_share = 0.0

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one sampled step, ``m.amp``: ``{layer: parameter count}`` of every matmul layer that ran, the same
        for those whose output was float32, and the trainer's precision setting."""
        assert m.amp is not None  # checked against `needs`
        layers, float32, precision = m.amp.layers, m.amp.float32, m.amp.precision
        total = sum(layers.values())
        if not total:
            return []
        self.checks += 1
        self.last_share = sum(float32.values()) / total
        self.observe(self.last_share, self.share)
        if not self.latch.update("amp", self.last_share > self.share):
            return []
        names = sorted(float32, key=lambda n: -float32[n])
        return [
            self._alert(
                ctx,
                f"`precision={precision!r}` is set, but {self.last_share:.0%} of the matmul layers' parameters "
                f"computed in float32 on this step ({list_names(names, _SHOWN)}); the forward escapes autocast (an "
                "`autocast(enabled=False)` block, a forward run outside `training_step`, inputs cast to float32 "
                "inside it), so the run pays float32's time and memory for mixed precision it does not get",
                source=names[0],
                value=self.last_share,
                threshold=self.share,
            )
        ]


# -- the report's amp_not_applied row (an "Other" row: the rule has no check) ----------------------------------

#: The run's provenance file (``diag/run.json``, written by every fit's session): the trainer's settings.
_RUN_FILE = "run.json"
#: The ``Trainer(precision=...)`` values under which ``amp_not_applied`` looks at the compute dtype.
_MIXED = ("16-mixed", "bf16-mixed")


def _trainer_precision(run: LoggedRun) -> str | None:
    """The ``precision`` in the run's ``diag/run.json`` (``None`` when the file or the value is missing)."""
    try:
        data = run.diag_json(_RUN_FILE)
    except (OSError, ValueError):
        return None
    trainer = data.get("trainer") if isinstance(data, dict) else None
    precision = trainer.get("precision") if isinstance(trainer, dict) else None
    return str(precision) if precision is not None else None


@measure(AMP_NOT_APPLIED)
def _amp_measured(run: LoggedRun, check: Check) -> bool:
    """``amp_not_applied`` looks at one training batch, and only under mixed precision."""
    precision = _trainer_precision(run)
    if precision in _MIXED:
        return AMP_NOT_APPLIED in run.thresholds
    if precision is None:
        check.add_note("the run's precision is not recorded (no diag/run.json): nothing to say it was checked")
    else:
        check.add_note(f"precision={precision!r}: no mixed precision to check")
    return False
