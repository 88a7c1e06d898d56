"""``error_cluster`` (ErrorAnalysis): a group of validation samples the model gets wrong far more often than the
rest (seed 001 §2.2). Plain Python; the rule's declaration (its ``RuleSpec``) is here."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import Limit, RuleSpec, register
from lightning_diag.rules.base import Rule, StepContext

__all__ = [
    "DEFAULT_ERROR_RATIO",
    "DEFAULT_MIN_ERRORS",
    "DEFAULT_MIN_SHARE",
    "ERROR_CLUSTER",
    "ERROR_CLUSTER_SPEC",
    "ErrorClusterRule",
]

# -- declaration (the docs' thresholds table and the report read it) -------------------------------------------
ERROR_CLUSTER_SPEC = register(RuleSpec(
    "error_cluster", "ErrorAnalysis", "warning", 3.0,
    "a cluster of validation samples whose error rate is at least {threshold:g}x the overall rate and which holds "
    "at least {min_share:.0%} of the samples",
    settings={"min_share": 0.05, "min_errors": 10}, check="error_concentration", source="seed 001 §2.2",
    limits={"threshold": Limit(low=1.0), "min_share": Limit(low=0.0, high=1.0),
            "min_errors": Limit(low=2, integer=True)},
))
ERROR_CLUSTER = ERROR_CLUSTER_SPEC.rule_id
_SPEC = ERROR_CLUSTER_SPEC
#: A cluster's error rate must be at least this many times the overall rate.
DEFAULT_ERROR_RATIO: float = float(_SPEC.threshold or 3.0)
#: ... and the cluster must hold at least this share of the validation samples.
DEFAULT_MIN_SHARE: float = float(_SPEC.settings["min_share"])
#: Fewest wrong validation samples worth clustering.
DEFAULT_MIN_ERRORS: int = int(_SPEC.settings["min_errors"])
_SHOWN = 3


class Cluster(Protocol):
    """What the rule reads of a cluster (:class:`lightning_diag.stats.error_clusters.ClusterStat`)."""

    @property
    def cluster(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def share(self) -> float: ...
    @property
    def error_rate(self) -> float: ...
    @property
    def top_features(self) -> tuple[tuple[str, float], ...]: ...
    @property
    def majority_label(self) -> int | None: ...
    @property
    def majority_prediction(self) -> int | None: ...


class ErrorClusterRule(Rule):
    """``error_cluster``: a cluster whose error rate is at least ``ratio`` times the overall rate and which holds
    at least ``min_share`` of the validation samples.

    One condition for the run (source ``"validation"``): it alerts once when some cluster qualifies, naming the
    worst few, and again only after a validation where none did. Uniform label noise spreads the errors evenly,
    so every cluster's rate stays near the overall rate and nothing fires.

    Example:
        >>> from types import SimpleNamespace as C
        >>> hard = C(cluster=0, size=100, share=0.1, error_rate=0.8, top_features=(("7", 0.4),),
        ...          majority_label=1, majority_prediction=0)
        >>> rule = ErrorClusterRule()
        >>> [a.rule for a in rule.update([hard], overall_rate=0.15, ctx=StepContext(0, 10))]
        ['error_cluster']
        >>> rule.update([hard], overall_rate=0.15, ctx=StepContext(1, 20))  # the same condition: latched
        []
    """

    specs = (ERROR_CLUSTER_SPEC,)
    state_keys = ()

    def __init__(self, ratio: float = DEFAULT_ERROR_RATIO, min_share: float = DEFAULT_MIN_SHARE) -> None:
        super().__init__()
        self.ratio = ratio
        self.min_share = min_share

    @classmethod
    def from_settings(cls, thresholds: Mapping[str, float | None]) -> ErrorClusterRule:
        """The rule with the thresholds in effect (see :meth:`Rule.from_settings`)."""
        return cls(_SPEC.value(thresholds), _SPEC.value(thresholds, "min_share"))

    def qualifying(self, clusters: Sequence[Cluster], overall_rate: float) -> list[Cluster]:
        """The clusters that trip the rule, worst first."""
        if not overall_rate > 0:
            return []
        return sorted(
            (c for c in clusters if c.share >= self.min_share and c.error_rate >= self.ratio * overall_rate),
            key=lambda c: -c.error_rate,
        )

    def update(
        self,
        clusters: Sequence[Cluster],
        overall_rate: float,
        ctx: StepContext,
        decode: Callable[[str], str] | None = None,
    ) -> list[Alert]:
        """Judge one validation's clusters; ``decode`` turns a feature name (``"12 57"``) into text."""
        hits = self.qualifying(clusters, overall_rate)
        if not self.latch.update("validation", bool(hits)):
            return []
        parts = [self._describe(c, overall_rate, decode) for c in hits[:_SHOWN]]
        more = f" and {len(hits) - _SHOWN} more" if len(hits) > _SHOWN else ""
        worst = hits[0]
        message = (
            f"{len(hits)} cluster(s) of validation samples fail far more often than the rest "
            f"(overall error rate {overall_rate:.1%}): " + "; ".join(parts) + more
            + ". Inspect these inputs (diag/errors.json): more or better training data of that kind, or a fix "
            "to its labels or preprocessing, is where the next gain is"
        )
        return [self._alert(ctx, message, "validation", worst.error_rate / overall_rate, self.ratio)]

    @staticmethod
    def _describe(c: Cluster, overall: float, decode: Callable[[str], str] | None) -> str:
        tokens = ", ".join(
            f"{name} ({decode(name)!r})" if decode is not None else name for name, _ in c.top_features
        )
        text = (
            f"cluster {c.cluster}: {c.size} samples ({c.share:.0%}), error rate {c.error_rate:.1%} "
            f"({c.error_rate / overall:.1f}x), top tokens [{tokens}]"
        )
        if c.majority_label is not None:
            text += f", mostly label {c.majority_label} predicted as {c.majority_prediction}"
        return text
