"""``train_override_bypassed``: a ``train()`` override Lightning never calls (framework-free).

Fed by :class:`~lightning_diag.AnomalyAlarm`
(:mod:`lightning_diag.callbacks.anomaly_alarm.runtime_checks` measures).

``train_override_bypassed`` (warning): a module overrides ``train()`` and what the override does (modules it puts
in eval mode, parameters it freezes) is not in effect during training: Lightning never calls ``train()``
during ``fit`` (it sets the ``training`` flags directly when validation ends), so the override's effect never
happens. Judged once, at the first training batch of a fit.
"""

from __future__ import annotations

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import RuleSpec, register
from lightning_diag.rules.base import Rule, StepContext, list_names
from lightning_diag.rules.measures import Measure, Measures

__all__ = [
    "TRAIN_OVERRIDE_BYPASSED",
    "TRAIN_OVERRIDE_BYPASSED_SPEC",
    "TrainOverrideRule",
]

_ALARM = "AnomalyAlarm"

TRAIN_OVERRIDE_BYPASSED_SPEC = register(
    RuleSpec(
        "train_override_bypassed",
        _ALARM,
        "warning",
        None,
        "a module's train() override would freeze parameters or switch modules to eval mode, but Lightning never "
        "calls train() during fit, so they keep training",
    )
)
TRAIN_OVERRIDE_BYPASSED = TRAIN_OVERRIDE_BYPASSED_SPEC.rule_id


#: Names an alert lists, at most.
_SHOWN = 4


class TrainOverrideRule(Rule):
    """``train_override_bypassed``: one comparison of what ``train()`` overrides would do with what is in effect.

    Example:
        >>> from lightning_diag.rules.measures import TrainOverrides
        >>> rule = TrainOverrideRule()
        >>> m = Measures(train_overrides=TrainOverrides(["Net"], ["backbone.bn"], ["backbone.conv.weight"]))
        >>> [(a.rule, a.source) for a in rule.judge(StepContext(0, 0), m)]
        [('train_override_bypassed', 'Net')]
        >>> rule.judge(StepContext(0, 0), Measures(train_overrides=TrainOverrides(["Net"], [], [])))
        []
    """

    specs = (TRAIN_OVERRIDE_BYPASSED_SPEC,)
    state_keys = ("checks",)
    needs = frozenset({Measure.TRAIN_OVERRIDES})

    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one comparison, ``m.train_overrides``: the classes whose ``train()`` override was tried, the
        modules the overrides would put in eval mode that are in training mode, and the parameters they would
        freeze (``requires_grad=False``) that train."""
        o = m.train_overrides
        assert o is not None  # checked against `needs`
        overriders, to_eval, to_freeze = o.overriders, o.to_eval, o.to_freeze
        self.checks += 1
        bypassed = bool(to_eval or to_freeze)
        if not self.latch.update("override", bypassed) or not overriders:
            return []
        parts = []
        if to_freeze:
            parts.append(f"freeze {list_names(to_freeze, _SHOWN, 'parameters')}")
        if to_eval:
            parts.append(f"put {list_names(to_eval, _SHOWN, 'modules')} in eval mode")
        who = ", ".join(f"`{c}`" for c in overriders[:_SHOWN])
        return [
            self._alert(
                ctx,
                f"{who} override(s) `train()`, which would {' and '.join(parts)}; Lightning never calls `train()` "
                "during fit (it sets the modules' `training` flags directly), so none of this is in effect and "
                f"{len(to_freeze)} parameter(s) meant to be frozen keep training. Apply it where Lightning runs "
                "it: freeze in `__init__`/`configure_model`/`on_fit_start`, switch modules in `on_train_epoch_start` "
                "(and `on_validation_model_train`)",
                source=overriders[0],
                value=float(len(to_freeze) + len(to_eval)),
                threshold=None,
            )
        ]
