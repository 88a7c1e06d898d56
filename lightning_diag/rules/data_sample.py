"""Rules of the sampled data (framework-free, :class:`DataRules`): ``data_vocab_shift``, ``data_leakage``,
``label_imbalance``, ``data_nonfinite``.

Fed with one measurement of the sampled training and validation data (:class:`DataMeasurement`, computed by
:class:`~lightning_diag.DataDiagnostics` through :mod:`lightning_diag.stats.token_stats`). Exact meaning:

* ``data_vocab_shift`` (warning): the smoothed, bias-corrected ``KL(P_val || P_train)`` of the token
  frequencies is above ``threshold`` nats (seed 000 §2.1: 0.3).
* ``data_leakage`` (warning): the estimated share of validation samples that are copies or near-copies of
  training samples is at or above ``threshold`` (seed 000 §7.1: "train/test Jaccard similarity < 0.15"; see
  docs/data_diagnostics.md for how the share is that Jaccard similarity). Any smaller, non-zero share is an
  ``info`` alert under the same id.
* ``label_imbalance`` (warning): the standard deviation of a split's class proportions is above ``threshold``
  (seed 000 §7.1: 0.1), per split (source ``train`` / ``val``).
* ``data_nonfinite`` (critical): a floating tensor of a sampled batch holds NaN or Inf (source
  ``<split>:<key>``). Constant features and empty sequences are ``info`` alerts under the same id.
Each (rule, source) pair is latched: it alerts once, and again only after a later measurement has cleared it, so
a resumed run (which measures again) does not repeat what it already reported.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar

from lightning_diag.core.record import Alert, Severity
from lightning_diag.core.registry import (
    COUNT,
    POSITIVE,
    CheckSpec,
    Limit,
    RuleSpec,
    SettingSpec,
    default,
    register,
    register_setting,
)
from lightning_diag.core.tags import family_tag
from lightning_diag.rules.base import Rule, StepContext
from lightning_diag.rules.measures import Measure, Measures
from lightning_diag.rules.records import DataMeasurement
from lightning_diag.rules.rows import Check, LoggedRun, measure, replay, run_setting

__all__ = [
    "DATA_LEAKAGE",
    "DATA_LEAKAGE_SPEC",
    "DATA_MAX_BATCHES_SETTING",
    "DATA_NONFINITE",
    "DATA_NONFINITE_SPEC",
    "DATA_VOCAB_SHIFT",
    "DATA_VOCAB_SHIFT_SPEC",
    "DEFAULT_LABEL_IMBALANCE_THRESHOLD",
    "DEFAULT_LEAKAGE_NEAR_DUPLICATE",
    "DEFAULT_LEAKAGE_THRESHOLD",
    "DEFAULT_VOCAB_SHIFT_THRESHOLD",
    "LABEL_BALANCE_CHECK",
    "LABEL_IMBALANCE",
    "LABEL_IMBALANCE_SPEC",
    "LEAKAGE_MIN_LEAKS_KEY",
    "LEAKAGE_NEAR_DUPLICATE_KEY",
    "LEAKAGE_NUM_PERM_KEY",
    "LEAKAGE_SHINGLE_SIZE_KEY",
    "TRAIN_TEST_OVERLAP_CHECK",
    "VOCAB_SHIFT_MIN_COUNT_KEY",
    "DataRules",
]

# -- declarations (one per rule id; the docs' thresholds table and the report read them) -----------------------
_DATA = "DataDiagnostics"
DATA_VOCAB_SHIFT_SPEC = register(RuleSpec(
    "data_vocab_shift", _DATA, "warning", 0.3,
    "KL divergence of validation vs training token frequencies above {threshold:g} nats",
    settings={"min_count": 5}, source="seed 000 §2.1", limits={"threshold": POSITIVE, "min_count": COUNT},
))
DATA_LEAKAGE_SPEC = register(RuleSpec(
    "data_leakage", _DATA, "warning", 0.15,
    "share of validation samples copying a training sample (shingle Jaccard >= {near_duplicate:g}) at or above "
    "{threshold:g}",
    settings={"near_duplicate": 0.5, "shingle_size": 3, "num_perm": 64, "min_leaks": 3},
    check="data_train_test_overlap", source="seed 000 §2.2, §7.1",
    limits={"threshold": Limit(low=0.0, high=1.0), "near_duplicate": Limit(low=0.0, high=1.0),
            "shingle_size": Limit(low=1, high=16, integer=True), "num_perm": Limit(low=4, high=1024, integer=True),
            "min_leaks": COUNT},
))
LABEL_IMBALANCE_SPEC = register(RuleSpec(
    "label_imbalance", _DATA, "warning", 0.1, "standard deviation of the class proportions above {threshold:g}",
    check="data_label_balance", source="seed 000 §7.1", limits={"threshold": Limit(low=0.0, high=0.5)},
))
DATA_NONFINITE_SPEC = register(RuleSpec(
    "data_nonfinite", _DATA, "critical", None, "NaN/Inf in a floating tensor of a sampled batch",
    source="seed 000 §2.1",
))
DATA_VOCAB_SHIFT = DATA_VOCAB_SHIFT_SPEC.rule_id
DATA_LEAKAGE = DATA_LEAKAGE_SPEC.rule_id
LABEL_IMBALANCE = LABEL_IMBALANCE_SPEC.rule_id
DATA_NONFINITE = DATA_NONFINITE_SPEC.rule_id
#: Their rows of the ``lightning-diag report`` checklist (registered in report order by
#: :mod:`lightning_diag.rules.catalog`).
LABEL_BALANCE_CHECK = CheckSpec("data_label_balance", "Data",
                                "Label distribution standard deviation < {label_imbalance:g}")
TRAIN_TEST_OVERLAP_CHECK = CheckSpec("data_train_test_overlap", "Data",
                                     "Train/test Jaccard similarity < {data_leakage:g}")
#: ``thresholds()`` keys of the settings DataDiagnostics reads for its own measuring.
VOCAB_SHIFT_MIN_COUNT_KEY = DATA_VOCAB_SHIFT_SPEC.key("min_count")
LEAKAGE_SHINGLE_SIZE_KEY = DATA_LEAKAGE_SPEC.key("shingle_size")
LEAKAGE_NUM_PERM_KEY = DATA_LEAKAGE_SPEC.key("num_perm")
LEAKAGE_NEAR_DUPLICATE_KEY = DATA_LEAKAGE_SPEC.key("near_duplicate")
LEAKAGE_MIN_LEAKS_KEY = DATA_LEAKAGE_SPEC.key("min_leaks")
#: ``data.max_batches``: batches read from each loader per measurement (every data rule).
DATA_MAX_BATCHES_SETTING = register_setting(SettingSpec("data.max_batches", _DATA, 64, "max_batches"))

#: ``data_vocab_shift``: KL divergence (nats) of validation vs training token frequencies above this.
DEFAULT_VOCAB_SHIFT_THRESHOLD = default(DATA_VOCAB_SHIFT)
#: ``data_leakage``: share of validation samples that (nearly) copy a training sample, at or above this.
DEFAULT_LEAKAGE_THRESHOLD = default(DATA_LEAKAGE)
#: ``data_leakage``: shingle Jaccard similarity at or above which two samples count as the same sample.
DEFAULT_LEAKAGE_NEAR_DUPLICATE = default(LEAKAGE_NEAR_DUPLICATE_KEY)
#: ``label_imbalance``: standard deviation of the class proportions above this.
DEFAULT_LABEL_IMBALANCE_THRESHOLD = default(LABEL_IMBALANCE)

_EXAMPLES = 5


class DataRules(Rule):
    """The four data rules over one :class:`DataMeasurement`; one latch for all of them (keys ``rule:source``).

    Example:
        >>> rules = DataRules()
        >>> m = DataMeasurement(vocab_kl=0.5, label_std={"train": 0.02})
        >>> [a.rule for a in rules.judge(StepContext(0, 0), Measures(data=m))]
        ['data_vocab_shift']
        >>> rules.judge(StepContext(1, 10), Measures(data=m))  # latched: a second measurement repeats nothing
        []
    """

    specs = (DATA_VOCAB_SHIFT_SPEC, DATA_LEAKAGE_SPEC, LABEL_IMBALANCE_SPEC, DATA_NONFINITE_SPEC)
    setting_keys: ClassVar[Mapping[str, str]] = {
        "vocab_kl": DATA_VOCAB_SHIFT, "leakage": DATA_LEAKAGE, "label_std": LABEL_IMBALANCE,
    }
    state_keys = ("measurements",)
    needs = frozenset({Measure.DATA})

    def __init__(
        self,
        vocab_kl: float = DEFAULT_VOCAB_SHIFT_THRESHOLD,
        leakage: float = DEFAULT_LEAKAGE_THRESHOLD,
        label_std: float = DEFAULT_LABEL_IMBALANCE_THRESHOLD,
    ) -> None:
        super().__init__()
        self.vocab_kl = vocab_kl
        self.leakage = leakage
        self.label_std = label_std
        self.measurements = 0

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one measurement, ``m.data``; return the alerts that just became active."""
        assert m.data is not None  # checked against `needs`
        return self._judge(m.data, ctx)

    def _judge(self, m: DataMeasurement, ctx: StepContext) -> list[Alert]:
        self.measurements += 1
        alerts: list[Alert] = []
        alerts += self._vocab(m, ctx)
        alerts += self._leakage(m, ctx)
        for split, std in m.label_std.items():
            self.observe(std, self.label_std, rule=LABEL_IMBALANCE)
            bad = math.isfinite(std) and std > self.label_std
            if self.latch.update(f"{LABEL_IMBALANCE}:{split}", bad):
                counts = list(m.label_counts.get(split, ()))
                total = sum(counts) or 1
                table = (
                    ", ".join(f"{c}: {n / total:.0%}" for c, n in enumerate(counts))
                    if len(counts) <= 20
                    else (
                        f"{len(counts)} classes, largest {max(counts) / total:.0%}, smallest {min(counts) / total:.0%}"
                    )
                )
                alerts.append(
                    self._alert(
                        ctx,
                        f"the {split} labels are imbalanced: the class proportions have a standard deviation "
                        f"of {std:.3g} (above {self.label_std:g}) over {sum(counts)} sampled labels ({table}); "
                        "consider class weights, resampling or a metric that accounts for imbalance",
                        source=split,
                        value=std,
                        threshold=self.label_std,
                        rule=LABEL_IMBALANCE,
                    )
                )
        alerts += self._inputs(m, ctx)
        return alerts

    def _vocab(self, m: DataMeasurement, ctx: StepContext) -> list[Alert]:
        self.observe(m.vocab_kl, self.vocab_kl, rule=DATA_VOCAB_SHIFT)
        bad = math.isfinite(m.vocab_kl) and m.vocab_kl > self.vocab_kl
        if not self.latch.update(f"{DATA_VOCAB_SHIFT}:tokens", bad):
            return []
        oov = (
            f"; {m.oov_share:.1%} of the validation tokens never occur in the training sample"
            if math.isfinite(m.oov_share)
            else ""
        )
        return [
            self._alert(
                ctx,
                f"the validation token frequencies diverge from the training ones: KL(val || train) = {m.vocab_kl:.3g} "
                f"nats, above {self.vocab_kl:g}{oov}; the validation set may come from another domain, period or "
                "tokenizer",
                source="tokens",
                value=m.vocab_kl,
                threshold=self.vocab_kl,
                rule=DATA_VOCAB_SHIFT,
            )
        ]

    def _leakage(self, m: DataMeasurement, ctx: StepContext) -> list[Alert]:
        if not math.isfinite(m.leaked_fraction):
            return []
        self.observe(m.leaked_fraction, self.leakage, rule=DATA_LEAKAGE)
        warn = m.leaked_fraction >= self.leakage
        hint = m.leaked > 0 and not warn
        out = []
        examples = ", ".join(f"val {v} ~ train {t} ({s:.2f})" for v, t, s in list(m.leak_examples)[:_EXAMPLES])
        parts = " and ".join(f"`{p}`" if p != "token ids" else p for p in m.leak_parts)
        compared = f" (compared: {parts})" if parts else ""
        what = (
            f"{m.leaked} of {m.val_samples} sampled validation samples copy or nearly copy a training sample"
            f"{compared} (estimated share of the validation set: {m.leaked_fraction:.1%}); examples: {examples}"
        )
        if self.latch.update(f"{DATA_LEAKAGE}:val", warn):
            out.append(
                self._alert(
                    ctx,
                    f"train/validation leakage: {what}; validation scores overstate generalisation, deduplicate "
                    "the splits",
                    source="val",
                    value=m.leaked_fraction,
                    threshold=self.leakage,
                    rule=DATA_LEAKAGE,
                )
            )
        if self.latch.update(f"{DATA_LEAKAGE}:val/text", m.text_only_leaks > 0):
            others = ", ".join(f"`{p}`" for p in m.leak_parts if p != "token ids")
            out.append(
                self._alert(
                    ctx,
                    f"{m.text_only_leaks} of {m.val_samples} sampled validation samples repeat a training sample's "
                    f"token ids with other {others}: not counted as leaks (templated prompts over other images); a "
                    "training image copied into validation after a random augmentation or a re-encoding is not "
                    "recognised (images are compared byte for byte)",
                    source="val",
                    value=float(m.text_only_leaks),
                    threshold=None,
                    rule=DATA_LEAKAGE,
                    severity=Severity.INFO,
                )
            )
        if self.latch.update(f"{DATA_LEAKAGE}:val/few", hint):
            out.append(
                self._alert(
                    ctx,
                    f"{what}; below the {self.leakage:.0%} threshold",
                    source="val",
                    value=m.leaked_fraction,
                    threshold=self.leakage,
                    rule=DATA_LEAKAGE,
                    severity=Severity.INFO,
                )
            )
        return out

    def _inputs(self, m: DataMeasurement, ctx: StepContext) -> list[Alert]:
        out = []
        for p in m.problems:
            source = f"{p.split}:{p.key}" + ("" if p.kind == "nonfinite" else f" ({p.kind})")
            if not self.latch.update(f"{DATA_NONFINITE}:{source}", True):
                continue
            shown = ", ".join(str(i) for i in p.examples[:_EXAMPLES])
            if p.kind == "nonfinite":
                message = (
                    f"NaN/Inf in `{p.key}` of {p.count} sampled {p.split} samples (dataset indices {shown}"
                    f"{', ...' if p.count > len(p.examples[:_EXAMPLES]) else ''}): the first step on such a batch "
                    "produces a non-finite loss; clean or filter these samples"
                )
                severity = Severity.CRITICAL
            elif p.kind == "constant":
                message = (
                    f"{p.count} feature(s) of `{p.key}` are constant over every sampled {p.split} sample (feature "
                    f"indices {shown}): they carry no information; check the preprocessing"
                )
                severity = Severity.INFO
            else:
                message = (
                    f"{p.count} sampled {p.split} samples have an empty `{p.key}` (no non-padding token; dataset "
                    f"indices {shown}): they add nothing but cost a step; filter them"
                )
                severity = Severity.INFO
            out.append(
                self._alert(
                    ctx,
                    message,
                    source=source,
                    value=float(p.count),
                    threshold=None,
                    rule=DATA_NONFINITE,
                    severity=severity,
                )
            )
        # a broken input that is gone on a later measurement clears its latch
        seen = {
            f"{DATA_NONFINITE}:{p.split}:{p.key}" + ("" if p.kind == "nonfinite" else f" ({p.kind})")
            for p in m.problems
        }
        for key in self.latch.active:
            if key.startswith(f"{DATA_NONFINITE}:") and key not in seen:
                self.latch.update(key, False)
        return out


# -- the report's two Data rows --------------------------------------------------------------------------------
# ``data_label_balance`` ("label distribution standard deviation < 0.1"): the latest ``diag/data/<split>/label_std``
# of each split against ``label_imbalance``; ``data_train_test_overlap`` ("train/test Jaccard similarity < 0.15"):
# the latest ``diag/data/leaked_fraction`` (the Jaccard containment of the validation set in the training set,
# docs/data_diagnostics.md) against ``data_leakage``. Both are replayed with :class:`DataRules`.

_SPLITS = ("train", "val")


def _latest(run: LoggedRun, *parts: str) -> tuple[int, float] | None:
    points = [(s, v) for s, v in run.scalars.get(family_tag("data", *parts), []) if math.isfinite(v)]
    return points[-1] if points else None


def _label_std(run: LoggedRun) -> dict[str, tuple[int, float]]:
    return {split: p for split in _SPLITS if (p := _latest(run, split, "label_std")) is not None}


@measure("data_label_balance")
def _measure_label_balance(run: LoggedRun, check: Check) -> bool:
    limit = run_setting(run, LABEL_IMBALANCE)
    check.threshold = f"std of class proportions <= {limit:.3g}"
    check.threshold_value = {"value": limit}
    stds = _label_std(run)
    if stds:
        check.measured = "std of class proportions: " + ", ".join(f"{k} {v:.3g}" for k, (_, v) in stds.items())
        check.measured_value = {k: v for k, (_, v) in stds.items()}
    return bool(stds)


@measure("data_train_test_overlap")
def _measure_overlap(run: LoggedRun, check: Check) -> bool:
    limit = run_setting(run, DATA_LEAKAGE)
    check.threshold = f"share of validation samples copying a training sample < {limit:.3g}"
    check.threshold_value = {"value": limit}
    leaked = _latest(run, "leaked_fraction")
    if leaked is not None:
        extra = [
            (name, p[1]) for name in ("exact_copies", "near_copies", "train_coverage") if (p := _latest(run, name))
        ]
        check.measured = f"{leaked[1]:.1%} of validation samples" + (
            " (" + ", ".join(f"{n.replace('_', ' ')} {v:.1%}" for n, v in extra) + ")" if extra else ""
        )
        check.measured_value = {"value": leaked[1], **dict(extra)}
    return leaked is not None


@replay("data_label_balance")
def _replay_label_balance(run: LoggedRun) -> list[Alert]:
    stds = _label_std(run)
    if not stds:
        return []
    step = max(s for s, _ in stds.values())
    m = DataMeasurement(label_std={k: v for k, (_, v) in stds.items()})
    rules = DataRules.from_settings(run.thresholds)
    return [a for a in rules.judge(StepContext(0, step), Measures(data=m)) if a.rule == LABEL_IMBALANCE]


@replay("data_train_test_overlap")
def _replay_overlap(run: LoggedRun) -> list[Alert]:
    leaked = _latest(run, "leaked_fraction")
    if leaked is None:
        return []
    m = DataMeasurement(leaked_fraction=leaked[1], leaked=1 if leaked[1] > 0 else 0)
    rules = DataRules.from_settings(run.thresholds)
    return [a for a in rules.judge(StepContext(0, leaked[0]), Measures(data=m)) if a.rule == DATA_LEAKAGE]
