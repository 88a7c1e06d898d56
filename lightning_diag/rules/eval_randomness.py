"""``eval_randomness``: dropout applied during validation (framework-free).

Fed by :class:`~lightning_diag.AnomalyAlarm`
(:mod:`lightning_diag.callbacks.anomaly_alarm.runtime_checks` measures).

``eval_randomness`` (warning): a dropout was applied with ``training=True`` (``F.dropout(x, training=True)``, a
Dropout module left in training mode) during validation: evaluation is random and the validation metric noisy.
Judged on the first batch of every validation run.
"""

from __future__ import annotations

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import RuleSpec, register
from lightning_diag.rules.base import Rule, StepContext
from lightning_diag.rules.measures import Measure, Measures

__all__ = [
    "EVAL_RANDOMNESS",
    "EVAL_RANDOMNESS_SPEC",
    "EvalRandomnessRule",
]

_ALARM = "AnomalyAlarm"

EVAL_RANDOMNESS_SPEC = register(
    RuleSpec(
        "eval_randomness",
        _ALARM,
        "warning",
        None,
        "a dropout applied with training=True during validation (evaluation is random)",
    )
)
EVAL_RANDOMNESS = EVAL_RANDOMNESS_SPEC.rule_id


#: Names an alert lists, at most.
_SHOWN = 4


class EvalRandomnessRule(Rule):
    """``eval_randomness``: the dropouts applied in training mode during one validation batch.

    Example:
        >>> rule = EvalRandomnessRule()
        >>> [(a.rule, a.source) for a in rule.judge(StepContext(0, 10), Measures(eval_dropouts={"encoder": 0.1}))]
        [('eval_randomness', 'encoder')]
        >>> rule.judge(StepContext(1, 20), Measures(eval_dropouts={"encoder": 0.1}))  # the same condition: latched
        []
    """

    specs = (EVAL_RANDOMNESS_SPEC,)
    state_keys = ("checks",)
    needs = frozenset({Measure.EVAL_DROPOUTS})

    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one validation batch's findings: ``{module name: dropout probability}``."""
        found = m.eval_dropouts or {}
        self.checks += 1
        if not self.latch.update("eval", bool(found)):
            return []
        names = sorted(found)
        shown = ", ".join(f"`{n or '<root>'}` (p={found[n]:g})" for n in names[:_SHOWN])
        more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
        return [
            self._alert(
                ctx,
                f"dropout applied in training mode during validation in {len(names)} module(s): {shown}{more}; "
                "each evaluation of the same batch gives another result and the validation metric is noisy and "
                "biased. Look for `F.dropout(x, p, training=True)` (pass `training=self.training`) or a Dropout "
                "switched back to training mode in a validation hook",
                source=names[0] or "<root>",
                value=max(found.values()),
                threshold=None,
            )
        ]
