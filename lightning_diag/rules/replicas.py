"""``ddp_desync`` (framework-free): parameters that differ across data-parallel replicas.

Fed by :class:`~lightning_diag.AnomalyAlarm` early (after optimizer steps 1, 2, 4, 8, ... below the interval: a run
is compared within its first steps, whatever its length) and then every ``ddp_desync.every_n_steps`` optimizer steps
(:func:`lightning_diag.stats.replicas.check_due`). A *replica group* is a set of ranks that must hold identical
copies of a parameter's local tensor: every rank under DDP (plain tensors); for a DTensor, the ranks along one of
its mesh dimensions with a ``Replicate`` placement (HSDP's replicate dimension, a ``RowwiseParallel`` bias or a norm
on the tensor-parallel dimension). Shards are never compared. Each rank's checksums (two numbers per parameter: its
L2 norm and its sum, :func:`lightning_diag.stats.updates.parameter_checksums`) are gathered within each group; a
member whose checksum differs from the group's first member's by more than ``tolerance`` (relative) is out of sync
(:mod:`lightning_diag.stats.replicas`). The alert (critical) names the first such parameter in the model's order,
the global ranks that differ and the ranks they were compared with. Latched: the run alerts once, and again only
after a check found the replicas in agreement."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from lightning_diag.core.record import Alert, Severity
from lightning_diag.core.registry import COUNT, RULES, CheckSpec, RuleSpec, default, register
from lightning_diag.core.tags import replicas_tag
from lightning_diag.rules.base import Rule, StepContext
from lightning_diag.rules.measures import Measure, Measures, ReplicaDifferences
from lightning_diag.rules.rows import Check, LoggedRun, finite_values, fmt, measure, run_setting
from lightning_diag.stats.replicas import first_differences, member_differences

__all__ = [
    "DDP_DESYNC",
    "DDP_DESYNC_SPEC",
    "DEFAULT_DESYNC_EVERY_N_STEPS",
    "DEFAULT_DESYNC_TOLERANCE",
    "DESYNC_EVERY_N_STEPS_KEY",
    "REPLICAS_AGREE_CHECK",
    "DesyncRule",
    "compare_replicas",
]

# -- declaration (the docs' thresholds table and the report read it) -------------------------------------------
_ALARM = "AnomalyAlarm"
DDP_DESYNC_SPEC = register(RuleSpec(
    "ddp_desync", _ALARM, "critical", 1e-6,
    "a parameter's checksum differs across data-parallel replicas by more than {threshold:g} "
    "(relative), checked after steps 1, 2, 4, ... and then every {every_n_steps:g} optimizer steps",
    settings={"every_n_steps": 100}, check="replicas_agree",
    limits={"every_n_steps": COUNT},
))
DDP_DESYNC = DDP_DESYNC_SPEC.rule_id
#: Its row of the ``lightning-diag report`` checklist (registered in report order
#: by :mod:`lightning_diag.rules.catalog`).
REPLICAS_AGREE_CHECK = CheckSpec("replicas_agree", "Training",
                                 "Data-parallel replicas hold the same parameters (checksum relative difference at "
                                 "most {ddp_desync:g}, every {ddp_desync__every_n_steps:g} steps)")

#: ``ddp_desync``: relative checksum difference across ranks above this.
DEFAULT_DESYNC_TOLERANCE = default(DDP_DESYNC)
#: ``thresholds()`` key of ``ddp_desync``'s optimizer steps between two comparisons (read by AnomalyAlarm).
DESYNC_EVERY_N_STEPS_KEY = DDP_DESYNC_SPEC.key("every_n_steps")
#: ``ddp_desync``: optimizer steps between two comparisons.
DEFAULT_DESYNC_EVERY_N_STEPS = int(default(DESYNC_EVERY_N_STEPS_KEY))


def compare_replicas(
    checksums: Sequence[Sequence[float]],
    names: Sequence[str],
    ranks: Sequence[int] | None = None,
    tolerance: float = DEFAULT_DESYNC_TOLERANCE,
) -> ReplicaDifferences:
    """The comparison of a single replica group (every rank under DDP), for :meth:`DesyncRule.judge`.

    Args:
        checksums: ``[member][2 * n]``: each member's norms of the ``n`` parameters, then their sums.
        names: The ``n`` parameter names, in the model's order.
        ranks: The members' global ranks (default ``0 .. len(checksums) - 1``).
        tolerance: Relative difference above which a member differs (the rule's).
    """
    ranks = list(range(len(checksums))) if ranks is None else list(ranks)
    diffs = member_differences(checksums)
    per_param = [max((d[i] for d in diffs), default=0.0) for i in range(len(names))]
    return ReplicaDifferences(per_param, names, first_differences(diffs, ranks, range(len(names)), tolerance))


class DesyncRule(Rule):
    """``ddp_desync``: one comparison of every rank's parameter checksums.

    Example:
        >>> rule = DesyncRule()
        >>> same = [[1.0, 2.0, 1.0, 2.0]] * 2  # two ranks, norms then sums of two parameters
        >>> rule.judge(StepContext(0, 100), Measures(replica_differences=compare_replicas(same, ["a", "b"])))
        []
        >>> drifted = [[1.0, 2.0, 1.0, 2.0], [1.0, 2.1, 1.0, 2.0]]
        >>> drift = Measures(replica_differences=compare_replicas(drifted, ["a", "b"]))
        >>> [(a.rule, a.source, a.severity) for a in rule.judge(StepContext(0, 200), drift)]
        [('ddp_desync', 'b', <Severity.CRITICAL: 'critical'>)]
    """

    specs = (DDP_DESYNC_SPEC,)
    setting_keys: ClassVar[Mapping[str, str]] = {"tolerance": DDP_DESYNC}
    severity = Severity.CRITICAL
    state_keys = ("checks", "last_max_diff")
    needs = frozenset({Measure.REPLICA_DIFFERENCES})

    def __init__(self, tolerance: float = DEFAULT_DESYNC_TOLERANCE) -> None:
        super().__init__()
        self.tolerance = tolerance
        self.checks = 0
        self.last_max_diff = 0.0

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one comparison over every replica group, ``m.replica_differences`` (the same inputs on every rank:
        the same decision; :func:`compare_replicas` makes it from a single group's checksums)."""
        d = m.replica_differences
        assert d is not None  # checked against `needs`
        per_param, names, first, compared = d.per_param, d.names, d.first, d.compared
        self.checks += 1
        n = len(names) if compared is None else compared
        self.last_max_diff = max(per_param, default=0.0)
        self.observe(self.last_max_diff, self.tolerance)
        bad = [i for i, v in enumerate(per_param) if v > self.tolerance]
        if not self.latch.update("replicas", bool(bad)):
            return []
        j = bad[0]
        ranks = sorted(r for r, (i, _) in first.items() if i == j)
        refs = sorted({first[r][1] for r in ranks})
        against = f" from its replica(s) on rank(s) {', '.join(map(str, refs))}" if refs else ""
        return [
            self._alert(
                ctx,
                f"data-parallel replicas disagree: `{names[j]}` on rank(s) {', '.join(map(str, ranks))} differs"
                f"{against} by {per_param[j]:.3g} (relative checksum difference, above {self.tolerance:g}); "
                f"{len(bad)} of {n} replicated parameters differ. Each rank now trains its own model: look for "
                "rank-dependent code touching the weights (an update outside the optimizer, loading weights on one "
                "rank), non-synchronised parameters (`find_unused_parameters`, parameters DDP does not see) or a "
                "hardware fault; resume from a checkpoint saved before this step",
                source=names[j],
                value=per_param[j],
                threshold=self.tolerance,
            )
        ]


# -- the report's replicas_agree row ---------------------------------------------------------------------------
# AnomalyAlarm's ``diag/replicas/...``. The row passes or fails on ``ddp_desync``'s alerts, which need every rank's
# checksums (not in the series), so nothing is replayed.


@measure("replicas_agree")
def _measure_replicas(run: LoggedRun, check: Check) -> bool:
    check.threshold = RULES[DDP_DESYNC].describe(run.thresholds)
    check.threshold_value = {"value": run_setting(run, DDP_DESYNC)}
    diffs = finite_values(run.scalars.get(replicas_tag("max_rel_diff"), []))
    if not diffs:
        return False
    check.measured = f"largest relative checksum difference across ranks {fmt(max(diffs))} over {len(diffs)} checks"
    check.measured_value = {"max": max(diffs), "checks": float(len(diffs))}
    return True
