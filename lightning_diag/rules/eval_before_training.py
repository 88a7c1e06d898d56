"""``eval_before_training``: a validation before the first training forward (framework-free).

Fed by :class:`~lightning_diag.AnomalyAlarm`
(:mod:`lightning_diag.callbacks.anomaly_alarm.runtime_checks` measures).

``eval_before_training`` (warning; ``info`` in the sanity check): a validation runs before the first training
forward of a component whose state only training updates (an ``nn.utils.spectral_norm`` whose power iteration
never ran: its weight is divided by a norm estimated from random vectors), so the validation computes nonsense.
"""

from __future__ import annotations

from lightning_diag.core.record import Alert, Severity
from lightning_diag.core.registry import RuleSpec, register
from lightning_diag.rules.base import Rule, StepContext, list_names
from lightning_diag.rules.measures import Measure, Measures

__all__ = [
    "EVAL_BEFORE_TRAINING",
    "EVAL_BEFORE_TRAINING_SPEC",
    "EvalBeforeTrainingRule",
]

_ALARM = "AnomalyAlarm"

EVAL_BEFORE_TRAINING_SPEC = register(
    RuleSpec(
        "eval_before_training",
        _ALARM,
        "warning",
        None,
        "a validation runs before the first training forward of a component whose state only training updates "
        "(spectral norm's power iteration)",
    )
)
EVAL_BEFORE_TRAINING = EVAL_BEFORE_TRAINING_SPEC.rule_id


#: Names an alert lists, at most.
_SHOWN = 4


class EvalBeforeTrainingRule(Rule):
    """``eval_before_training``: components evaluated before any training forward updated their state.

    Example:
        >>> from lightning_diag.rules.measures import UntrainedInEval
        >>> rule = EvalBeforeTrainingRule()
        >>> m = Measures(untrained_in_eval=UntrainedInEval(["disc.conv"], sanity=False))
        >>> [(a.rule, a.severity.value) for a in rule.judge(StepContext(0, 0), m)]
        [('eval_before_training', 'warning')]
        >>> rule.judge(StepContext(0, 0), m)
        []
    """

    specs = (EVAL_BEFORE_TRAINING_SPEC,)
    state_keys = ("checks",)
    needs = frozenset({Measure.UNTRAINED_IN_EVAL})

    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one validation run's untrained components (``sanity``: it is Lightning's sanity check)."""
        assert m.untrained_in_eval is not None  # checked against `needs`
        modules, sanity = m.untrained_in_eval.modules, m.untrained_in_eval.sanity
        self.checks += 1
        key = "sanity" if sanity else "eval"
        if not modules or not self.latch.update(key, True):
            return []
        what = "the sanity check" if sanity else "a validation whose metrics are logged"
        return [
            self._alert(
                ctx,
                f"{what} runs before the first training forward of {list_names(modules, _SHOWN, 'modules')} with "
                "`spectral_norm`: its power iteration has not run, so the weight is divided by a norm estimated from "
                "random vectors and the outputs are meaningless. Run a training forward first, or use "
                "`torch.nn.utils.parametrizations.spectral_norm`, which iterates at construction",
                source=modules[0],
                value=float(len(modules)),
                threshold=None,
                severity=Severity.INFO if sanity else None,
            )
        ]
