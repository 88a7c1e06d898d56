"""``attn_logit_growth``: attention logits growing towards one-hot attention (framework-free).

Fed by :class:`~lightning_diag.AttentionEntropyMonitor` on its sampled steps: per attention module, the largest
``|q·k| * scale`` (``1/sqrt(head_dim)`` by default) among the keys each measured query may attend, over the
sampled sequences and queries (recomputed from the call's query and key for ``scaled_dot_product_attention`` and
``nn.MultiheadAttention``, read off the softmax's input for hand-written attention; not measured for probabilities
handed over by :func:`~lightning_diag.record_attention`). Without qk-layernorm and at a high learning rate the
query and key weights grow together and the logits with their product, until the softmax is one-hot and the
training diverges (Dehghani et al. 2023, ViT-22B: logits of 1e4 and more; Wortsman et al. 2023, small-scale
proxies). The rule fires when a module's peak logit is above ``threshold`` (50: a softmax over a few thousand keys
is one-hot from a logit gap of about 20) **and** at least ``growth`` (1.5) times its peak ``patience`` (1)
measurement(s) before, having grown on each measurement in between: the growth, seen while it happens, at the
second measurement at the earliest, usually before ``attn_entropy_low`` (which needs two measurements of a fallen
entropy). A model that learned sharp logits and keeps them stable does not fire.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import COUNT, POSITIVE, CheckSpec, Limit, RuleSpec, register
from lightning_diag.rules.base import Latch, Rule, StepContext
from lightning_diag.rules.measures import Measure, Measures

__all__ = [
    "ATTN_LOGITS_CHECK",
    "ATTN_LOGIT_GROWTH",
    "ATTN_LOGIT_GROWTH_SPEC",
    "DEFAULT_LOGIT_GROWTH_FACTOR",
    "DEFAULT_LOGIT_GROWTH_PATIENCE",
    "DEFAULT_LOGIT_GROWTH_THRESHOLD",
    "AttentionLogitRule",
]

ATTN_LOGIT_GROWTH_SPEC = register(
    RuleSpec(
        "attn_logit_growth",
        "AttentionEntropyMonitor",
        "warning",
        50.0,
        "an attention module's largest logit |q.k|/sqrt(d) above {threshold:g} and grown {growth:g}x over its last "
        "{patience:g} measurement(s)",
        settings={"growth": 1.5, "patience": 1},
        limits={"threshold": POSITIVE, "growth": Limit(low=1.0), "patience": COUNT},
        check="attn_logits_bounded",
    )
)
ATTN_LOGIT_GROWTH = ATTN_LOGIT_GROWTH_SPEC.rule_id
#: The rule's row of the ``lightning-diag report`` checklist (registered by :mod:`lightning_diag.rules.catalog`).
ATTN_LOGITS_CHECK = CheckSpec(
    "attn_logits_bounded", "Model", "Attention logits not growing: no module's largest logit above "
    "{attn_logit_growth:g} and growing"
)

#: ``attn_logit_growth``: the peak attention logit above which growth is judged.
DEFAULT_LOGIT_GROWTH_THRESHOLD: float = float(ATTN_LOGIT_GROWTH_SPEC.threshold or 50.0)
#: ``attn_logit_growth``: the factor the peak must have grown by over the last ``patience`` measurements.
DEFAULT_LOGIT_GROWTH_FACTOR: float = float(ATTN_LOGIT_GROWTH_SPEC.settings["growth"])
#: ``attn_logit_growth``: consecutive measurements on which the peak must have grown.
DEFAULT_LOGIT_GROWTH_PATIENCE: int = int(ATTN_LOGIT_GROWTH_SPEC.settings["patience"])


class AttentionLogitRule(Rule):
    """``attn_logit_growth``: per module, the peak attention logit of each measurement.

    Example:
        >>> rule = AttentionLogitRule(threshold=50.0)
        >>> def peaks(p):
        ...     return Measures(attention_logit_peaks={"attn": p})
        >>> [rule.judge(StepContext(0, s), peaks(p)) for s, p in enumerate((2.0, 40.0))]
        [[], []]
        >>> [(a.rule, a.source) for a in rule.judge(StepContext(0, 2), peaks(110.0))]
        [('attn_logit_growth', 'attn')]
        >>> stable = AttentionLogitRule(threshold=50.0)
        >>> [stable.judge(StepContext(0, s), peaks(p)) for s, p in enumerate((80.0, 95.0, 79.0, 100.5))]
        [[], [], [], []]
    """

    specs = (ATTN_LOGIT_GROWTH_SPEC,)
    needs = frozenset({Measure.ATTENTION_LOGIT_PEAKS})
    state_keys = ("history", "first")

    def __init__(
        self,
        threshold: float = DEFAULT_LOGIT_GROWTH_THRESHOLD,
        growth: float = DEFAULT_LOGIT_GROWTH_FACTOR,
        patience: int = DEFAULT_LOGIT_GROWTH_PATIENCE,
    ) -> None:
        super().__init__()
        self.threshold = threshold
        self.growth = max(float(growth), 1.0)
        self.patience = max(int(patience), 1)
        # one event while the logits keep growing; it ends after `patience` + 2 measurements without growth
        self.latch = Latch(clear_after=self.patience + 2)
        #: Per module, its peak logits at its last ``patience + 1`` measurements.
        self.history: dict[str, list[float]] = {}
        #: Per module, its peak logit at its first measurement.
        self.first: dict[str, float] = {}

    @classmethod
    def from_settings(cls, thresholds: Mapping[str, float | None]) -> AttentionLogitRule:
        """The rule with the threshold and settings in effect (see :meth:`Rule.from_settings`)."""
        spec = ATTN_LOGIT_GROWTH_SPEC
        return cls(spec.value(thresholds), spec.value(thresholds, "growth"), int(spec.value(thresholds, "patience")))

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one measurement: ``{module: its peak attention logit}`` (``nan``: not measured)."""
        peaks = m.attention_logit_peaks or {}
        tripped: list[tuple[str, float, float]] = []
        for module, peak in peaks.items():
            if not math.isfinite(peak):
                continue
            self.first.setdefault(module, peak)
            seen = [*self.history.get(module, []), float(peak)][-(self.patience + 1) :]
            self.history[module] = seen
            rising = len(seen) > self.patience and all(b > a for a, b in itertools.pairwise(seen))
            grown = rising and peak >= self.growth * seen[0]
            # the margin: the weaker of the two conditions (0 while the peak is not rising), above 1 where both hold
            ratio = peak / seen[0] if seen[0] > 0 else math.inf
            self.observe(min(peak / self.threshold, ratio / self.growth) if rising else 0.0, 1.0)
            bad = peak > self.threshold and grown
            if self.latch.update(module, bad) and bad:
                tripped.append((module, peak, seen[0]))
        if not tripped:
            return []
        tripped.sort(key=lambda t: -t[1])
        module, peak, before = tripped[0]
        others = f" ({len(tripped) - 1} more module(s) too)" if len(tripped) > 1 else ""
        return [
            self._alert(
                ctx,
                f"the attention logits of `{module}` are growing: its largest |q.k|/sqrt(d) is {peak:.4g}, "
                f"{peak / before:.3g}x its {before:.3g} of {self.patience} measurement(s) before (from "
                f"{self.first[module]:.3g} at its first){others}. Logits "
                "this large make the softmax one-hot and precede an entropy collapse and a loss divergence "
                "(attention-logit growth). Remedies: qk-layernorm (normalise queries and keys), a lower learning "
                "rate or a longer warm-up, weight decay on the query/key projections",
                source=module,
                value=peak,
                threshold=self.threshold,
            )
        ]
