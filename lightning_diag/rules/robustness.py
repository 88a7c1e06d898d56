"""``robustness_drop`` (RobustnessProbe): the model's metric falls by much more than the share of the input a
small perturbation changes (seed 000 §2.1). Plain Python; the rule's declaration (its ``RuleSpec``) is here."""

from __future__ import annotations

import math

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import CheckSpec, Limit, RuleSpec, register
from lightning_diag.rules.base import Rule, StepContext
from lightning_diag.rules.measures import Measure, Measures

__all__ = [
    "DEFAULT_PERTURB_RATE", "DEFAULT_ROBUSTNESS_DROP", "ROBUSTNESS_CHECK", "ROBUSTNESS_DROP",
    "ROBUSTNESS_DROP_SPEC", "ROBUSTNESS_RATE_KEY", "RobustnessDropRule",
]

# -- declaration (the docs' thresholds table and the report read it) -------------------------------------------
ROBUSTNESS_DROP_SPEC = register(RuleSpec(
    "robustness_drop", "RobustnessProbe", "warning", 0.15,
    "perturbing {rate:.0%} of the tokens (typos or swapped neighbours) drops the validation metric by more than "
    "{threshold:.0%} (relative)",
    settings={"rate": 0.05}, check="robustness", source="seed 000 §2.1",
    limits={"threshold": Limit(low=0.0, high=1.0), "rate": Limit(low=0.0, high=1.0)},
))
ROBUSTNESS_DROP = ROBUSTNESS_DROP_SPEC.rule_id
#: Its row of the ``lightning-diag report`` checklist (registered in report order
#: by :mod:`lightning_diag.rules.catalog`).
ROBUSTNESS_CHECK = CheckSpec("robustness", "Model",
                             "Robustness ({robustness_drop__rate:.0%} perturbation): the validation metric drops by "
                             "at most {robustness_drop:.0%}")
#: ``thresholds()`` key of the perturbation rate RobustnessProbe applies.
ROBUSTNESS_RATE_KEY = ROBUSTNESS_DROP_SPEC.key("rate")
_SPEC = ROBUSTNESS_DROP_SPEC
#: Relative drop of the metric above which the model is judged brittle: three times the perturbed share.
DEFAULT_ROBUSTNESS_DROP: float = _SPEC.value({})
#: Share of the real tokens each perturbation changes (seed 000 §2.1: 5% typos or shuffled words).
DEFAULT_PERTURB_RATE: float = float(_SPEC.settings["rate"])

_ADVICE = {
    "replace": "train with token-level noise (random replacement / typo augmentation) or check the tokenizer",
    "swap": "train with word-order augmentation, or check that the model is not keying on exact positions",
}


class RobustnessDropRule(Rule):
    """``robustness_drop``: the relative drop of the probe's metric under a perturbation above ``threshold``.

    Latched per perturbation kind (the alert's source: ``replace`` or ``swap``); perturbations tripping at the
    same probe make one alert.

    Example:
        >>> rule = RobustnessDropRule(threshold=0.15)
        >>> m = Measures(robustness_drops={"replace": 0.4, "swap": 0.02})
        >>> [a.source for a in rule.judge(StepContext(0, 10), m)]
        ['replace']
        >>> rule.judge(StepContext(1, 20), Measures(robustness_drops={"replace": 0.5, "swap": 0.02}))  # latched
        []
    """

    specs = (ROBUSTNESS_DROP_SPEC,)
    state_keys = ()
    needs = frozenset({Measure.ROBUSTNESS_DROPS})

    def __init__(self, threshold: float = DEFAULT_ROBUSTNESS_DROP, rate: float = DEFAULT_PERTURB_RATE) -> None:
        super().__init__()
        self.threshold = threshold
        self.rate = rate

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one probe's relative drops by perturbation kind; return the new alert, if any."""
        drops = m.robustness_drops or {}
        self.observe(max((d for d in drops.values() if math.isfinite(d)), default=math.nan), self.threshold)
        fresh = {k: d for k, d in drops.items() if self.latch.update(k, math.isfinite(d) and d > self.threshold)}
        if not fresh:
            return []
        worst = max(fresh, key=fresh.__getitem__)
        parts = ", ".join(f"{kind} {d:.0%}" for kind, d in sorted(fresh.items(), key=lambda kv: -kv[1]))
        message = (
            f"perturbing {self.rate:.0%} of the tokens drops the validation metric by {parts} (relative), above "
            f"{self.threshold:.0%}: the model relies on exact tokens more than the perturbation changes; "
            + "; ".join(_ADVICE.get(k, f"{k}: check what the model keys on") for k in fresh)
        )
        return [self._alert(ctx, message, worst, fresh[worst], self.threshold)]
