"""``error_cluster`` (ErrorAnalysis): a group of validation samples sharing a feature that the model gets wrong far
more often than the rest (seed 001 §2.2; slices as in SliceFinder). Plain Python; the rule's declaration (its
``RuleSpec``) is here."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar, Protocol, TypeVar

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import CheckSpec, Limit, RuleSpec, register
from lightning_diag.rules.base import Rule, StepContext
from lightning_diag.rules.measures import Measure, Measures
from lightning_diag.stats.slice_groups import CONJUNCTION as _CONJUNCTION

__all__ = [
    "ALPHA",
    "DEFAULT_ERROR_RATIO",
    "DEFAULT_MIN_ERRORS",
    "DEFAULT_MIN_SHARE",
    "ERROR_CLUSTER",
    "ERROR_CLUSTER_MIN_ERRORS_KEY",
    "ERROR_CLUSTER_SPEC",
    "ERROR_CONCENTRATION_CHECK",
    "ErrorClusterRule",
    "describe_conjunction",
    "describe_group",
    "describe_members",
    "token_ranges",
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
#: Its row of the ``lightning-diag report`` checklist (registered in report order
#: by :mod:`lightning_diag.rules.catalog`).
ERROR_CONCENTRATION_CHECK = CheckSpec(
    "error_concentration", "Model",
    "Error concentration: no cluster of validation samples with an error rate at least {error_cluster:g}x the "
    "overall rate holding {error_cluster__min_share:.0%} of them",
)
#: ``thresholds()`` key of the fewest wrong samples ErrorAnalysis clusters.
ERROR_CLUSTER_MIN_ERRORS_KEY = ERROR_CLUSTER_SPEC.key("min_errors")
_SPEC = ERROR_CLUSTER_SPEC
#: A group's error rate must be at least this many times the overall rate (its lift).
DEFAULT_ERROR_RATIO: float = _SPEC.value({})
#: ... the group must hold at least this share of the validation samples (the support of the slice search).
DEFAULT_MIN_SHARE: float = float(_SPEC.settings["min_share"])
#: ... and its one-sided Fisher exact p-value, corrected for the slices tested (Bonferroni), within the
#: significance level of the whole fit: at the v-th analysed validation the corrected p-value must be at most
#: ``ALPHA / (v (v + 1))``, a share of the level that sums to ``ALPHA`` over any number of validations, so that a
#: run whose errors share no cause alerts with a chance of at most 1% however long it trains
#: (``ErrorAnalysis.alpha``, a field rather than a constructor argument).
ALPHA: float = 0.01
#: Fewest wrong validation samples worth searching.
DEFAULT_MIN_ERRORS: int = int(_SPEC.settings["min_errors"])
_SHOWN = 3


class Group(Protocol):
    """What the rule reads of a slice or a finding (:class:`lightning_diag.stats.error_slices.SliceStat`,
    :class:`~lightning_diag.stats.error_slices.Finding`)."""

    @property
    def features(self) -> tuple[str, ...]: ...
    @property
    def size(self) -> int: ...
    @property
    def share(self) -> float: ...
    @property
    def error_rate(self) -> float: ...
    @property
    def rest_error_rate(self) -> float: ...
    @property
    def lift(self) -> float: ...
    @property
    def p_adjusted(self) -> float: ...


GroupT = TypeVar("GroupT", bound=Group)


class ErrorClusterRule(Rule):
    """``error_cluster``: a group of validation samples that share a feature (a slice, a conjunction of two, or the
    union of slices that fail together, :mod:`lightning_diag.stats.slice_groups`) whose error rate is at least
    ``ratio`` times the overall rate (its lift), which holds at least ``min_share`` of the samples, and whose
    corrected p-value is at most ``alpha``.

    The level is spent over the fit's validations: at the ``analysis``-th analysed validation the corrected
    p-value must be at most ``alpha / (analysis * (analysis + 1))`` (:meth:`level`), shares that sum to ``alpha``,
    so that chance alone (errors that share no cause) alerts in at most ``alpha`` of the runs however many
    validations they analyse, while a real hard group, whose p-value is orders of magnitude smaller, is found at
    the first.

    One condition for the run (source ``"validation"``): it alerts once when some group qualifies, naming the
    worst few, and again only after a validation where none did. Uniform label noise spreads the errors evenly:
    no slice's rate is several times the overall rate with a p-value that survives the correction, and nothing
    fires.

    Example:
        >>> from lightning_diag.rules.measures import ErrorGroups
        >>> from types import SimpleNamespace as G
        >>> hard = G(features=("7", "7 9"), size=140, share=0.14, error_rate=0.51, rest_error_rate=0.04,
        ...          lift=4.9, p_adjusted=1e-30, majority_label=1, majority_prediction=0, slices=2)
        >>> rule = ErrorClusterRule()
        >>> m = Measures(error_groups=ErrorGroups([hard], overall_rate=0.105))
        >>> [a.rule for a in rule.judge(StepContext(0, 10), m)]
        ['error_cluster']
        >>> rule.judge(StepContext(1, 20), m)  # the same condition: latched
        []
    """

    specs = (ERROR_CLUSTER_SPEC,)
    setting_keys: ClassVar[Mapping[str, str]] = {"ratio": ERROR_CLUSTER}
    state_keys = ()
    needs = frozenset({Measure.ERROR_GROUPS})

    def __init__(
        self, ratio: float = DEFAULT_ERROR_RATIO, min_share: float = DEFAULT_MIN_SHARE, alpha: float = ALPHA
    ) -> None:
        super().__init__()
        self.ratio = ratio
        self.min_share = min_share
        self.alpha = alpha

    def level(self, analysis: int = 1) -> float:
        """The significance level at the ``analysis``-th analysed validation of a fit (1-based).

        Example:
            >>> [ErrorClusterRule(alpha=0.01).level(v) for v in (1, 2, 3)]
            [0.005, 0.0016666666666666668, 0.0008333333333333334]
        """
        v = max(1, int(analysis))
        return self.alpha / (v * (v + 1))

    def qualifies(self, group: Group, analysis: int = 1) -> bool:
        """Whether ``group`` is large, far worse than the overall rate, and significant after the correction at
        the ``analysis``-th analysed validation."""
        return (
            group.share >= self.min_share and group.lift >= self.ratio and group.p_adjusted <= self.level(analysis)
        )

    def qualifying(self, groups: Sequence[GroupT], analysis: int = 1) -> list[GroupT]:
        """The groups that trip the rule, most significant first (then highest lift)."""
        return sorted((g for g in groups if self.qualifies(g, analysis)), key=lambda g: (g.p_adjusted, -g.lift))

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge the candidate groups of the ``analysis``-th analysed validation (those that qualify alert);
        ``decode`` turns a token feature (``"12 57"``) into text."""
        assert m.error_groups is not None  # checked against `needs`
        groups, overall_rate = m.error_groups.groups, m.error_groups.overall_rate
        decode, analysis = m.error_groups.decode, m.error_groups.analysis
        hits = self.qualifying(groups, analysis)
        # the margin: the largest lift of a group large and significant enough to count (0: none is)
        level = self.level(analysis)
        counted = [g.lift for g in groups if g.share >= self.min_share and g.p_adjusted <= level]
        self.observe(max(counted, default=0.0), self.ratio)
        if not self.latch.update("validation", bool(hits)):
            return []
        parts = [describe_group(g, decode) for g in hits[:_SHOWN]]
        more = f"; and {len(hits) - _SHOWN} more" if len(hits) > _SHOWN else ""
        message = (
            f"{len(hits)} group(s) of validation samples fail far more often than the rest (overall error rate "
            f"{overall_rate:.1%}): " + "; ".join(parts) + more
            + ". Inspect these inputs (diag/errors.json): more or better training data of that kind, or a fix "
            "to its labels or preprocessing, is where the next gain is"
        )
        return [self._alert(ctx, message, "validation", hits[0].lift, self.ratio)]


def is_token_feature(name: str) -> bool:
    """Whether a feature name is a token-id n-gram (``"12 57"``) rather than a ``field=value`` feature."""
    return "=" not in name


def describe_feature(name: str, decode: Callable[[str], str] | None = None) -> str:
    """``token 12 ('dose')``, ``tokens '12 57' ('dose of')``, or the ``field=value`` feature as it is."""
    if not is_token_feature(name):
        return name
    text = f" ({decode(name)!r})" if decode is not None else ""
    return f"token {name}{text}" if " " not in name else f"tokens '{name}'{text}"


def token_ranges(ids: Sequence[int]) -> str:
    """Token ids as compact ranges of consecutive ids.

    Example:
        >>> token_ranges([189, 180, 181, 182, 7, 183, 184, 185, 186, 187, 188, 9])
        '7, 9, 180–189'
    """
    runs: list[list[int]] = []
    for i in sorted(set(ids)):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}–{b}" if b > a + 1 else f"{a}, {b}" for a, b in runs)


def describe_conjunction(name: str, decode: Callable[[str], str] | None = None) -> str:
    """``token 5 and source=web`` for the conjunction ``"5 & source=web"``; any other feature as
    :func:`describe_feature`."""
    return " and ".join(describe_feature(part, decode) for part in name.split(_CONJUNCTION))


def describe_members(g: Group, decode: Callable[[str], str] | None = None) -> str:
    """What the samples of a group share, by its kind: ``"holding any of tokens 180–189, source=forum"``
    (a disjunction: unigram members as compact ranges, then the other members), ``"with token 5 and
    source=web"`` (a conjunction), or ``"with token 12, token 13"`` (a slice and the features of largely the same
    samples)."""
    kind = getattr(g, "kind", "slice")
    members = getattr(g, "members", ())
    if kind == "disjunction" and members:
        firsts = [m.features[0] for m in members]
        tokens = [int(f) for f in firsts if f.isdigit()]
        others = [describe_conjunction(f, decode) for f in firsts if not f.isdigit()]
        parts = ([f"token{'s' if len(tokens) > 1 else ''} {token_ranges(tokens)}"] if tokens else []) + others
        text = "holding any of " + ", ".join(parts)
        alternates = getattr(g, "alternates", ())
        if alternates:
            text += " (also " + ", ".join(describe_conjunction(f, decode) for f in alternates[:_SHOWN]) + ")"
        return text
    if kind == "conjunction":
        return "with " + describe_conjunction(g.features[0], decode)
    shown = ", ".join(describe_conjunction(f, decode) for f in g.features[:_SHOWN * 2])
    if len(g.features) > _SHOWN * 2:
        shown += f" and {len(g.features) - _SHOWN * 2} more"
    return "with " + shown


def describe_group(g: Group, decode: Callable[[str], str] | None = None) -> str:
    """One group in words: what its samples share (:func:`describe_members`), the size and share of their union,
    its error rate against the rest, lift and corrected p-value."""
    text = (
        f"samples {describe_members(g, decode)}: {g.size} samples ({g.share:.0%}), error rate {g.error_rate:.1%} "
        f"against {g.rest_error_rate:.1%} for the rest ({g.lift:.1f}x overall), p = {g.p_adjusted:.1g} corrected"
    )
    members = getattr(g, "members", ())
    if getattr(g, "kind", "slice") == "disjunction":
        text += f", {len(members)} slices that fail together"
    label, pred = getattr(g, "majority_label", None), getattr(g, "majority_prediction", None)
    if label is not None:
        text += f", mostly label {label} predicted as {pred}"
    return text
