"""The checklist of ``lightning-diag report``: one row per :class:`~lightning_diag.core.registry.CheckSpec`.

Each row is judged twice and the two must agree: by the run's own alerts (``diag/alerts.jsonl``) and by
**replaying the library's pure rules** (``lightning_diag.rules``) over the series the run logged, the way
SageMaker Debugger runs its rules offline over stored tensors. A row fails when either raised a warning or a
critical alert, so the checklist cannot say PASS beside a measurement its own rule rejects. Replayed rows:
``grad_norm_band``, ``grad_spread``, ``grad_collapse`` (the first optimizer's global norm),
``attn_entropy_band`` (with the logged ``uniform`` reference; special-token shares are not logged, so
``attn_sink`` is judged by its alerts and measured value), ``loss_swing`` and ``val_decline``.
``val_fluctuation`` compares the two fluctuations the alarm logged.

Adding a row (issues adding callbacks):

1. declare it beside its rules as ``<ROW>_CHECK = CheckSpec(id, layer, title)`` (the title a template over their
   thresholds) and add it to the rows :mod:`lightning_diag.rules.catalog` registers, in report order (or reuse
   one of the seed's rows: ``data_label_balance``, ``data_train_test_overlap``, ``deploy_quantization_error``,
   ``deploy_latency_fluctuation``);
2. join your rules to it with ``RuleSpec(..., check=id)``. That alone gives a working row: it fails on a
   warning/critical alert of its rules, passes when its callback logged thresholds and raised none, and shows
   each rule's described threshold and its last alert's value;
3. where the row can show a measured value from the logged series, add one function decorated with
   ``@measure(id)`` (from :mod:`lightning_diag.rules.rows`) to the rule module that declares the row's
   ``CheckSpec``: it fills ``check.measured`` / ``measured_value`` (and ``threshold`` / ``threshold_value`` if the
   generic text is not enough) and returns whether the series was measured. A ``@replay(id)`` function beside it
   may also re-run the row's pure rules. The registries are filled when :mod:`lightning_diag.rules.catalog` imports
   the rule modules; this module looks the functions up by check id (by rule id for an "Other" row: a rule with no
   check). The rows over several rule modules' rules and the rows of no rule are measured in this package
   (:mod:`~lightning_diag.report.measures`, :mod:`~lightning_diag.report.attention_range`).

Example:
    >>> check = Check("nonfinite", "Training", "No NaN/Inf in loss or gradients", ("nonfinite_loss",))
    >>> check.status
    'not measured'
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lightning_diag.core.alerts import Alert
from lightning_diag.core.registry import CHECKS, RULES, CheckSpec
from lightning_diag.report import attention_range as _attention_range  # noqa: F401  (the attention range row)
from lightning_diag.report import measures as _measures  # noqa: F401  (the rows over several rule modules)
from lightning_diag.report.load import RunData
from lightning_diag.report.text import clean, display
from lightning_diag.rules.catalog import ALL_RULES
from lightning_diag.rules.rows import (
    CHECKLIST_LAYERS,
    MEASURES,
    REPLAYS,
    Check,
    fmt,
    is_attached,
    json_safe,
    run_threshold,
    serious_alerts,
)

__all__ = [
    "RunReport",
    "diagnose",
    "finish_check",
]


@dataclasses.dataclass
class RunReport:
    """The diagnosis of one run: its checklist, alert timeline and plots."""

    run: RunData
    checks: list[Check]
    plots: list[Any] = dataclasses.field(default_factory=list)
    plot_note: str = ""

    @property
    def counts(self) -> dict[str, int]:
        """How many checks pass, fail and are not measured."""
        out = {"pass": 0, "fail": 0, "not measured": 0}
        for c in self.checks:
            out[c.status] += 1
        return out

    @property
    def timeline(self) -> list[Alert]:
        """Every alert of the run, oldest first."""
        return [a for _, a in sorted(enumerate(self.run.alerts), key=lambda ia: (ia[1].global_step, ia[0]))]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "run": display(self.run.path),
            "fit": self.run.fit,
            "kind": self.run.kind,
            "mapping": dict(self.run.mapping),
            "summary": self.counts,
            "threshold_source": self.run.threshold_source,
            "callbacks": sorted(self.run.callbacks),
            "thresholds": json_safe(self.run.thresholds),
            "dashboard_layout": self.run.has_layout,
            "checks": [c.to_dict() for c in self.checks],
            "alerts": [a.to_dict() for a in self.timeline],
            "plots": [display(p) for p in self.plots],
            "problems": list(self.run.problems) + ([self.plot_note] if self.plot_note else []),
        }


# -- the generic measure ------------------------------------------------------------------------------------------


def _measure_generic(run: RunData, check: Check) -> bool:
    """A row with rules but no measure function: each rule's described threshold and its last alert's value."""
    numbers = {r: run.thresholds[r] for r in check.rules if r in run.thresholds}
    check.threshold = "; ".join(RULES[r].describe(run.thresholds) if r in RULES else r for r in check.rules)
    if len(numbers) == 1:
        check.threshold_value = {"value": next(iter(numbers.values()))}
    elif numbers:
        check.threshold_value = dict(numbers)
    alerts = serious_alerts(run.alerts, check.rules)
    if alerts:
        last = alerts[-1]
        check.measured = f"{fmt(last.value) if last.value is not None else '-'} at step {last.global_step}"
    return any(r in run.thresholds for r in check.rules) or is_attached(run, check.rules)


# -- judging ----------------------------------------------------------------------------------------------


def finish_check(check: Check, run: RunData, measured: bool, replayed: list[Alert], name_owners: bool = True) -> Check:
    """The status from the run's alerts, the replayed rules' alerts and whether the series was measured.

    A row left ``not measured`` names the callbacks of its rules that the run did not attach (unless
    ``name_owners`` is false: the caller said why).
    """
    logged = serious_alerts(run.alerts, check.rules)
    again = serious_alerts(replayed, check.rules)
    check.alerts, check.replayed = len(logged), len(again)
    # The alert log's own alerts when there are some (their global step); the replay's only without them (its
    # steps are those of the logged series, on the user's step axis).
    first = min(logged or again, key=lambda a: a.global_step, default=None)
    if first is not None:
        check.status = "fail"
        check.severity = "critical" if any(a.severity == "critical" for a in [*logged, *again]) else "warning"
        check.first_alert_step = first.global_step
        if check.measured is None:
            check.measured = f"{first.rule} at step {first.global_step} ({first.source})"
        if again and not logged:
            a = min(again, key=lambda x: x.global_step)
            check.add_note(
                f"the alert log has no {a.rule} alert, but replaying the rule over the logged series raises one at "
                f"step {a.global_step} ({a.source}): the run used other thresholds, or lost its alert log"
            )
    elif check.status != "fail":
        check.status = "pass" if measured else "not measured"
    hints = sorted({a.rule for a in replayed if a.severity == "info"} - {a.rule for a in run.alerts})
    if hints:
        check.add_note(f"replayed info hints: {', '.join(hints)}")
    if check.status == "not measured":
        check.measured = None
        owners = {ALL_RULES[r] for r in check.rules if r in ALL_RULES}
        missing = sorted(owners - set(run.callbacks))
        if missing and len(missing) == len(owners) and name_owners:
            check.add_note(f"{', '.join(missing)} was not attached to the run")
    return check


def _evaluate(spec: CheckSpec, run: RunData) -> Check:
    check = Check(spec.check_id, spec.layer, spec.describe(run.thresholds), spec.rules)
    fn = MEASURES.get(spec.check_id)
    if fn is None and not check.rules:
        check.threshold = spec.threshold
        check.threshold_value = {"value": spec.threshold_value} if spec.threshold_value is not None else {}
        check.note = "outside what a training callback sees; no lightning_diag callback measures it"
        return check
    measured = (fn or _measure_generic)(run, check)
    replay_fn = REPLAYS.get(spec.check_id)
    replayed = replay_fn(run) if replay_fn is not None and measured else []
    return finish_check(check, run, measured, replayed)


def _guarded(spec: CheckSpec, run: RunData) -> Check:
    """:func:`_evaluate`, or a ``not measured`` row saying why when the logged values break it (one row, never
    the whole report), with a line in the run's problems."""
    try:
        return _evaluate(spec, run)
    except Exception as err:  # hostile or damaged logged values: one row is lost, never the report
        why = clean(f"{type(err).__name__}: {err}")
        run.problems.append(f"{display(run.path)}: check {spec.check_id} could not be judged ({why})")
        check = Check(spec.check_id, spec.layer, spec.title, spec.rules)
        check.note = f"could not be judged from the logged values ({why})"
        return check


def diagnose(run: RunData) -> RunReport:
    """The checklist of one run (seed 000 §7.1, layer by layer, plus the training-process checks).

    Rows come from the registry's :data:`~lightning_diag.core.registry.CHECKS` (grouped by layer, in
    declaration order); rules without a row are listed under "Other", judged by their alerts and threshold.
    """
    specs = sorted(CHECKS.values(), key=lambda s: CHECKLIST_LAYERS.index(s.layer))
    checks = [_guarded(spec, run) for spec in specs]
    covered = {r for c in checks for r in c.rules}
    logged_rules = {k for k in run.thresholds if "." not in k and k in ALL_RULES}
    for rule in sorted(({a.rule for a in run.alerts} | logged_rules) - covered):
        title = RULES[rule].describe(run.thresholds) if rule in RULES else f"Rule {rule}"
        check = Check(rule, "Other", title[:1].upper() + title[1:], (rule,))
        threshold = run_threshold(run, rule)
        check.threshold = fmt(threshold) if threshold is not None else "not logged"
        check.threshold_value = {"value": threshold} if threshold is not None else {}
        alerts = serious_alerts(run.alerts, (rule,))
        if alerts:
            last = alerts[-1]
            check.measured = f"{fmt(last.value) if last.value is not None else '-'} at step {last.global_step}"
        # a rule that measures only in some runs says when (its module's `@measure(rule)`); the others are measured
        # when their callback logged their thresholds
        measured_fn = MEASURES.get(rule)
        measured = measured_fn(run, check) if measured_fn is not None else rule in run.thresholds
        checks.append(finish_check(check, run, measured, []))
    return RunReport(run, checks)
