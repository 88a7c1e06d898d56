"""``robustness_drop`` (RobustnessProbe): the model's metric falls by much more than the share of the input a
small perturbation changes (seed 000 §2.1). Plain Python; the default read from the rule registry."""

from __future__ import annotations

import math
from collections.abc import Mapping

from lightning_diag.core.alerts import Alert
from lightning_diag.core.registry import RULES
from lightning_diag.rules.base import Rule, StepContext

__all__ = ["DEFAULT_PERTURB_RATE", "DEFAULT_ROBUSTNESS_DROP", "ROBUSTNESS_DROP", "RobustnessDropRule"]

ROBUSTNESS_DROP = "robustness_drop"
_SPEC = RULES[ROBUSTNESS_DROP]
#: Relative drop of the metric above which the model is judged brittle: three times the perturbed share.
DEFAULT_ROBUSTNESS_DROP: float = float(_SPEC.threshold or 0.15)
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
        >>> [a.source for a in rule.update({"replace": 0.4, "swap": 0.02}, StepContext(0, 10))]
        ['replace']
        >>> rule.update({"replace": 0.5, "swap": 0.02}, StepContext(1, 20))  # still brittle: latched
        []
    """

    rule_id = ROBUSTNESS_DROP
    state_keys = ()

    def __init__(self, threshold: float = DEFAULT_ROBUSTNESS_DROP, rate: float = DEFAULT_PERTURB_RATE) -> None:
        super().__init__()
        self.threshold = threshold
        self.rate = rate

    def update(self, drops: Mapping[str, float], ctx: StepContext) -> list[Alert]:
        """Feed one probe's relative drops by perturbation kind; return the new alert, if any."""
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
