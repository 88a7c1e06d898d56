"""``attn_logit_growth``: attention logits growing towards one-hot attention (framework-free).

Fed by :class:`~lightning_diag.AttentionEntropyMonitor` on its sampled steps: per attention module, the largest
``|q·k| * scale`` (``1/sqrt(head_dim)`` by default) among the keys each measured query may attend, over the
sampled sequences and queries (recomputed from the call's query and key for ``scaled_dot_product_attention`` and
``nn.MultiheadAttention``, read off the softmax's input for hand-written attention; not measured for probabilities
handed over by :func:`~lightning_diag.record_attention`). Without qk-layernorm and at a high learning rate the
query and key weights grow together and the logits with their product, until the softmax is one-hot and the
training diverges (Dehghani et al. 2023, ViT-22B: logits of 1e4 and more; Wortsman et al. 2023, small-scale
proxies). The rule fires when a module's peak logit is above ``threshold`` (50: a softmax over a few thousand keys
is one-hot from a logit gap of about 20) **and** at least ``growth`` (2) times the largest of its peaks over the
``window`` (8) measurements that end ``patience`` (1) measurement(s) before, having grown on each measurement in
between: the growth, seen while it happens, at the second measurement at the earliest, usually before
``attn_entropy_low`` (which needs two measurements of a fallen entropy). A model that learned sharp logits and keeps
them stable does not fire.

The growth is judged against the largest recent peak, not the one measurement before: the peak is a maximum over
a batch's sampled queries, and it scatters from batch to batch. Lightning's demo transformer (embeddings scaled by
``sqrt(d_model)`` into a post-norm first layer) holds logits of 400 to 780 from its first step to its last, one-hot
attention and a falling loss; over five seeds and up to 1000 steps its peak rose up to 1.81x over the measurement
before from that scatter alone (395 -> 717), and up to 1.38x over the largest of the 8 before it. The faults grow
3.2x and more over everything seen before (the demo fault 30 -> 95, BERT at a learning rate of 0.1 716 -> 2923, the
Llama growth 7 -> 351): ``growth`` 2 sits between the two (it was 1.5, within the healthy scatter).
"""

from __future__ import annotations

import itertools
import math

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import COUNT, POSITIVE, RULES, CheckSpec, Limit, RuleSpec, register
from lightning_diag.core.tags import tag
from lightning_diag.rules.base import Latch, Rule, StepContext
from lightning_diag.rules.measures import Measure, Measures
from lightning_diag.rules.rows import (
    Check,
    LoggedRun,
    finite_family,
    fmt,
    last_point,
    measure,
    run_setting,
    worst_point,
)

__all__ = [
    "ATTN_LOGITS_CHECK",
    "ATTN_LOGIT_GROWTH",
    "ATTN_LOGIT_GROWTH_SPEC",
    "DEFAULT_LOGIT_GROWTH_FACTOR",
    "DEFAULT_LOGIT_GROWTH_PATIENCE",
    "DEFAULT_LOGIT_GROWTH_THRESHOLD",
    "DEFAULT_LOGIT_GROWTH_WINDOW",
    "AttentionLogitRule",
]

ATTN_LOGIT_GROWTH_SPEC = register(
    RuleSpec(
        "attn_logit_growth",
        "AttentionEntropyMonitor",
        "warning",
        50.0,
        "an attention module's largest logit |q.k|/sqrt(d) above {threshold:g} and grown {growth:g}x over the "
        "largest of its {window:g} measurements up to {patience:g} before",
        settings={"growth": 2.0, "patience": 1, "window": 8},
        limits={"threshold": POSITIVE, "growth": Limit(low=1.0), "patience": COUNT, "window": COUNT},
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
DEFAULT_LOGIT_GROWTH_THRESHOLD: float = ATTN_LOGIT_GROWTH_SPEC.value({})
#: ``attn_logit_growth``: the factor the peak must have grown by over its reference (the largest peak of the
#: ``window`` measurements ending ``patience`` measurements before).
DEFAULT_LOGIT_GROWTH_FACTOR: float = float(ATTN_LOGIT_GROWTH_SPEC.settings["growth"])
#: ``attn_logit_growth``: consecutive measurements on which the peak must have grown.
DEFAULT_LOGIT_GROWTH_PATIENCE: int = int(ATTN_LOGIT_GROWTH_SPEC.settings["patience"])
#: ``attn_logit_growth``: measurements whose largest peak is the reference the growth is taken over (the batch-to-
#: batch scatter of a peak logit: a single measurement before is within its noise).
DEFAULT_LOGIT_GROWTH_WINDOW: int = int(ATTN_LOGIT_GROWTH_SPEC.settings["window"])


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
        window: int = DEFAULT_LOGIT_GROWTH_WINDOW,
    ) -> None:
        super().__init__()
        self.threshold = threshold
        self.growth = max(float(growth), 1.0)
        self.patience = max(int(patience), 1)
        self.window = max(int(window), 1)
        # one event while the logits keep growing; it ends after `patience` + 2 measurements without growth
        self.latch = Latch(clear_after=self.patience + 2)
        #: Per module, its peak logits at its last ``patience + window`` measurements.
        self.history: dict[str, list[float]] = {}
        #: Per module, its peak logit at its first measurement.
        self.first: dict[str, float] = {}

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one measurement: ``{module: its peak attention logit}`` (``nan``: not measured)."""
        peaks = m.attention_logit_peaks or {}
        tripped: list[tuple[str, float, float, float]] = []
        for module, peak in peaks.items():
            if not math.isfinite(peak):
                continue
            self.first.setdefault(module, peak)
            seen = [*self.history.get(module, []), float(peak)][-(self.patience + self.window) :]
            self.history[module] = seen
            last = seen[-(self.patience + 1) :]
            rising = len(seen) > self.patience and all(b > a for a, b in itertools.pairwise(last))
            # the reference: the largest peak of the `window` measurements ending `patience` before this one
            before = max(seen[-(self.patience + self.window) : -self.patience]) if rising else math.nan
            ratio = peak / before if rising and before > 0 else math.inf
            # the margin: the weaker of the two conditions (0 while the peak is not rising), above 1 where both hold
            self.observe(min(peak / self.threshold, ratio / self.growth) if rising else 0.0, 1.0)
            bad = rising and peak > self.threshold and ratio >= self.growth
            if self.latch.update(module, bad) and bad:
                tripped.append((module, peak, before, ratio))
        if not tripped:
            return []
        tripped.sort(key=lambda t: -t[1])
        module, peak, before, ratio = tripped[0]
        others = f" ({len(tripped) - 1} more module(s) too)" if len(tripped) > 1 else ""
        return [
            self._alert(
                ctx,
                f"the attention logits of `{module}` are growing: its largest |q.k|/sqrt(d) is {peak:.4g}, "
                f"{ratio:.3g}x the largest of its {self.window} measurement(s) up to {self.patience} before "
                f"({before:.3g}; from "
                f"{self.first[module]:.3g} at its first){others}. Logits "
                "this large make the softmax one-hot and precede an entropy collapse and a loss divergence "
                "(attention-logit growth). Remedies: qk-layernorm (normalise queries and keys), a lower learning "
                "rate or a longer warm-up, weight decay on the query/key projections",
                source=module,
                value=peak,
                threshold=self.threshold,
            )
        ]


# -- the report's attn_logits_bounded row ----------------------------------------------------------------------
# AttentionEntropyMonitor's ``diag/attn_logit_growth/<module>``. The row passes or fails on the rule's alerts (the
# rule judges the growth since the start, which the series do not hold), so nothing is replayed.


@measure("attn_logits_bounded")
def _measure_attn_logits(run: LoggedRun, check: Check) -> bool:
    check.threshold = RULES[ATTN_LOGIT_GROWTH].describe(run.thresholds)
    check.threshold_value = {"value": run_setting(run, ATTN_LOGIT_GROWTH)}
    peaks = finite_family(run, lambda module: tag(ATTN_LOGIT_GROWTH, module))
    if not peaks:
        return False
    module, step, peak = worst_point(peaks)
    last_module, last = last_point(peaks)
    check.measured = (
        f"largest attention logit {fmt(peak)} (`{module}`, step {step}); {fmt(last)} (`{last_module}`) at the last "
        f"measurement, over {len(peaks)} modules"
    )
    check.measured_value = {"max": peak, "last": last, "modules": float(len(peaks))}
    return True
