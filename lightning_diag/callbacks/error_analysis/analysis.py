"""ErrorAnalysis: the groups of validation inputs (slices sharing a feature) the model gets wrong far more often.

The samples are read from the validation batches and kept by :mod:`.samples`; this
module searches their slices, logs, writes ``errors.json`` and judges the rule.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.trainer.states import TrainerFn

from lightning_diag.callbacks.common.base import AlertHandler, DiagCallback, RuleChoices
from lightning_diag.callbacks.common.preset import Detector, Preset
from lightning_diag.callbacks.error_analysis.samples import (
    Predictions,
    SampleBuffer,
    Samples,
    batch_metadata,
    batch_tokens,
    default_predictions,
    embedding_rows,
    gather_samples,
    score,
)
from lightning_diag.core.files import write_json
from lightning_diag.core.tags import errors_tag
from lightning_diag.core.validation import check_callable, check_int, check_number
from lightning_diag.rules.errors import (
    ALPHA,
    ERROR_CLUSTER_MIN_ERRORS_KEY,
    ErrorClusterRule,
    describe_feature,
    describe_members,
)
from lightning_diag.rules.measures import ErrorGroups, Measures

__all__ = ["DEFAULT_MAX_SAMPLES", "ERRORS_FILE", "ErrorAnalysis", "Predictions"]

#: Validation samples kept per analysed validation, at most (bounds memory and the search's time).
DEFAULT_MAX_SAMPLES = 4096
#: The smallest slice tested, in samples, whatever ``min_share`` gives.
MIN_SLICE_SAMPLES = 5
#: A member of a group (a slice of a disjunction) holds at least this share of the smallest slice tested alone.
MEMBER_SHARE = 0.1
#: Slices listed in ``errors.json`` (the most significant), besides the findings.
_LISTED_SLICES = 20
#: Slices shown in the TensorBoard table below the findings.
_TABLE_SLICES = 5
#: Per-class precision and recall are logged for at most this many classes.
_MAX_CLASS_SCALARS = 32
ERRORS_FILE = "errors.json"


class ErrorAnalysis(DiagCallback):
    """Finds the groups of validation samples the model gets wrong far more often than the rest (seed 001 §2.2).

    At validation end (every ``every_n_validations`` validations of a fit, never the sanity check), the
    samples seen by ``validation_step`` (up to ``max_samples``) are scored: classification samples are wrong
    when the argmax differs from the label; token tasks score each sequence by its token error rate (labels
    ``-100`` ignored) and count it wrong when that rate is above the validation set's mean. Then a **slice
    search** (:mod:`lightning_diag.stats.error_slices`, as SliceFinder and SliceLine do): a slice is the samples
    sharing a feature, namely a token-id unigram or bigram present (padding excluded by the attention mask), the
    true label (classification), a metadata value (a ``"metadata"`` dict of per-sample values returned by
    ``validation_step``: ``{"logits": ..., "metadata": {"source": [...]}}``), or, with ``embed=``, a cluster of
    the embeddings (K-Means for every k in ``k_range``, :mod:`lightning_diag.stats.error_clusters`). Every slice
    holding at least ``min_share`` of the samples is judged on its error rate against the rest: lift (its rate
    over the overall rate) and a one-sided Fisher exact p-value, Bonferroni-corrected for the slices tested.
    Slices that fail together are one finding (:mod:`lightning_diag.stats.slice_groups`): a greedy union of member
    slices (down to a tenth of ``min_share``, and conjunctions of two features that fail only together), each
    joining while it lowers the union's p-value corrected over every union of that many candidates; a finding is
    judged and reported on its union and described as a slice, a conjunction ("token 5 and source=web") or a
    disjunction ("holding any of tokens 180–189"). Nothing runs on training steps.

    Rule ``error_cluster`` (warning): a finding whose lift is at least its threshold, which holds at least
    ``min_share`` of the samples, and whose corrected p-value is within the fit's significance level :attr:`alpha`
    (at the v-th analysed validation, at most ``alpha / (v (v + 1))``: shares that sum to ``alpha`` over the whole
    fit); the message names what its samples share (tokens decoded with ``tokenizer.decode`` when given), the
    size and share of the union, its error rate against the rest's, lift, p-value and majority true and predicted
    labels.

    Logged (global rank zero): ``diag/errors/rate`` (overall), ``diag/errors/worst_cluster_rate`` and
    ``diag/errors/worst_cluster_share`` (the first finding's, else the most significant slice's),
    ``diag/errors/clusters`` (the number of findings), per class ``diag/errors/precision/class_<c>`` and
    ``diag/errors/recall/class_<c>`` (classification, first 32 classes), a markdown table as TensorBoard text
    ``diag/errors/clusters``, and ``<log_dir>/diag/errors.json`` (findings, most significant slices, confusion
    matrix).

    Attributes:
        alpha: ``error_cluster``'s significance level over a whole fit (``ALPHA`` of
            :mod:`lightning_diag.rules.errors`, 0.01): the chance that a run whose errors share no cause alerts.
            Set it on the instance before the fit.

    Args:
        every_n_validations: Analyse every this many validations.
        max_samples: Validation samples kept per analysis (memory and time budget; later batches are skipped).
        k_range: ``(low, high)``: with ``embed=``, K-Means is fitted for every k in this range.
        embed: ``embed(pl_module, batch) -> Tensor[B, D]``: embedding clusters as slices too (the only
            features besides labels and metadata for inputs without token ids).
        predict: ``predict(pl_module, batch, outputs) -> (predictions, labels)`` instead of reading what
            ``validation_step`` returned (:func:`default_predictions`).
        tokenizer: Anything with ``decode(list[int]) -> str``, to print the token features as text.
        top_tokens: Defining features listed per finding in the TensorBoard table.
        seed: Seed of the embedding clusters.
        rules: ``{"error_cluster": {"threshold": 4.0, "min_share": 0.1, "min_errors": 20}}``: a group's lift (its
            error rate over the overall rate), its smallest share of the validation samples (also the smallest
            slice tested) and the fewest wrong samples to search (docs/thresholds.md), or ``False`` to switch the
            rule off.
        on_alert: Called with each alert as it is recorded (global rank zero).

    Raises:
        ValueError: On an out-of-range argument (named in the message).
        TypeError: When ``embed``, ``predict`` or ``tokenizer`` is not what is documented.
    """

    extra_state_keys = ("validations",)
    preset = Preset(
        "ErrorAnalysis",
        (
            Detector(ErrorClusterRule, "rule", "rule", context=(("alpha", "alpha"),)),
        ),
    )
    # the detectors, built by add_preset
    rule: ErrorClusterRule
    _alpha: float = ALPHA

    def __init__(
        self,
        *,
        every_n_validations: int = 1,
        max_samples: int = DEFAULT_MAX_SAMPLES,
        k_range: tuple[int, int] = (2, 8),
        embed: Callable[[pl.LightningModule, Any], torch.Tensor] | None = None,
        predict: Predictions | None = None,
        tokenizer: Any = None,
        top_tokens: int = 5,
        seed: int = 0,
        rules: RuleChoices | None = None,
        on_alert: AlertHandler | None = None,
    ) -> None:
        super().__init__(rules=rules, on_alert=on_alert)
        self.every_n_validations = check_int("every_n_validations", every_n_validations, low=1)
        self.max_samples = check_int("max_samples", max_samples, low=10)
        #: Fewest wrong samples to cluster (``error_cluster.min_errors``).
        self.min_errors = int(self.setting(ERROR_CLUSTER_MIN_ERRORS_KEY))
        if (
            not isinstance(k_range, (tuple, list))
            or len(k_range) != 2
            or not all(isinstance(k, int) and not isinstance(k, bool) for k in k_range)
            or not 2 <= k_range[0] <= k_range[1]
        ):
            raise ValueError(f"Expected argument `k_range` to be a pair of ints 2 <= low <= high, but got {k_range!r}")
        self.k_range = (int(k_range[0]), int(k_range[1]))
        check_callable("embed", embed)
        check_callable("predict", predict)
        if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
            raise TypeError(f"Expected argument `tokenizer` to have a `decode` method, but got {tokenizer!r}")
        self.embed, self.predict, self.tokenizer = embed, predict, tokenizer
        self.top_tokens = check_int("top_tokens", top_tokens, low=1)
        self.seed = check_int("seed", seed, low=0)
        self.add_preset()
        self.validations = 0
        self.last: dict[str, Any] | None = None
        self._samples = SampleBuffer()
        self._active = False

    @property
    def alpha(self) -> float:
        """``error_cluster``'s significance level (see the class's Attributes)."""
        return self._alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        self._alpha = check_number("alpha", value, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
        self.rule.alpha = self._alpha

    # -- state ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The validations counted and the rule's latch (the base class)."""
        return {"validations": self.validations, **super().state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (names any missing key)."""
        super().load_state_dict(state_dict)
        self.validations = int(state_dict["validations"])

    # -- collection -----------------------------------------------------------------------------------------
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Decide whether this validation is analysed, and start empty."""
        self._samples.clear()
        self._active = False
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        self.validations += 1
        self._active = (self.validations - 1) % self.every_n_validations == 0

    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Score the batch's samples and keep their features (within the sample budget)."""
        if not self._active or dataloader_idx != 0 or len(self._samples) >= self.max_samples:
            return
        with torch.no_grad():
            found = (self.predict or default_predictions)(pl_module, batch, outputs)
            if found is None:
                self._give_up(
                    trainer,
                    "no predictions: return logits (or a dict with 'logits'/'preds') from "
                    "`validation_step`, with labels in the batch, or pass predict=",
                )
                return
            scores = score(*found)
            if scores is None:
                self._give_up(
                    trainer,
                    "predictions and labels of unexpected shapes: pass predict= returning "
                    "([B] or [B, C], [B]) or ([B, T] or [B, T, V], [B, T])",
                )
                return
            size = len(scores.errors)
            tokens = batch_tokens(batch, size)
            embeddings = None
            if self.embed is not None:
                embeddings, why = embedding_rows(self.embed(pl_module, batch), size)
                if embeddings is None:
                    self._give_up(trainer, why)
                    return
            metadata, notices = batch_metadata(outputs, size)
        for key, message in notices:
            self.notice(trainer, key, message)
        if tokens is None and self.embed is None:
            self.notice(
                trainer,
                "no-tokens",
                "the batch has no token ids: only label and metadata slices are "
                "searched; pass embed=(pl_module, batch) -> Tensor[B, D] for clusters of the inputs",
            )
        self._samples.add(scores, tokens, embeddings, metadata, self.max_samples)

    def _give_up(self, trainer: pl.Trainer, why: str) -> None:
        self._active = False
        self._samples.clear()
        self.notice(trainer, f"nothing-{why[:20]}", f"nothing is analysed: {why}")

    # -- analysis ---------------------------------------------------------------------------------------------
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Gather the samples from every rank, search the slices, log and judge (every rank decides the same)."""
        if not self._active:
            return
        self._active = False
        mine = self._samples.parts()
        parts = [mine]
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            parts = [None] * torch.distributed.get_world_size()  # type: ignore[list-item]
            torch.distributed.all_gather_object(parts, mine)
        self._samples.clear()
        samples = gather_samples(parts, self.min_errors)
        if samples is not None:
            self._analyse(trainer, samples)

    def _slice_features(self, samples: Samples, wrong: np.ndarray, min_count: int) -> Any:
        from lightning_diag.stats.error_clusters import embedding_clusters
        from lightning_diag.stats.error_slices import stack_features, token_features, value_features

        parts = []
        if all(t is not None for t in samples.tokens):
            parts.append(token_features([t for t in samples.tokens if t is not None], min_count))
        if samples.classification:
            parts.append(value_features(samples.labels.tolist(), "label", min_count))
        for field in sorted({name for row in samples.metadata for name in row}):
            parts.append(value_features([row.get(field) for row in samples.metadata], field, min_count))
        if samples.embeddings is not None:
            clusters = embedding_clusters(samples.embeddings, wrong, self.k_range, self.seed)
            if clusters is not None:
                parts.append(clusters)
        parts = [p for p in parts if p.members.shape[1] > 0]
        return stack_features(parts) if parts else None

    def _analyse(self, trainer: pl.Trainer, samples: Samples) -> None:
        from lightning_diag.stats.error_slices import find_slices
        from lightning_diag.stats.slice_groups import find_groups

        errors, labels, preds, classification = samples.errors, samples.labels, samples.preds, samples.classification
        overall = float(errors.mean())
        wrong = errors > 0.5 if classification else errors > overall
        step = trainer.global_step
        min_count = max(MIN_SLICE_SAMPLES, math.ceil(self.rule.min_share * len(errors)))
        analysis = (self.validations - 1) // self.every_n_validations + 1  # resumed with `validations`
        values: dict[str, float] = {errors_tag("rate"): overall}
        report: dict[str, Any] = {
            "step": step,
            "epoch": trainer.current_epoch,
            "samples": len(errors),
            "error_rate": overall,
            "task": "classification" if classification else "tokens",
            "min_slice_samples": min_count,
            "alpha": self.rule.alpha,
            "analysis": analysis,
            "level": self.rule.level(analysis),
            "slices_tested": 0,
            "member_min": 0,
            "member_candidates": 0,
            "conjunctions_tested": 0,
            "hypotheses": 0,
            "findings": [],
            "slices": [],
        }
        if classification:
            report.update(self._per_class(labels, preds, values))
        findings: list[Any] = []
        candidates: list[Any] = []
        slices: list[Any] = []
        decode = self._decode if self.tokenizer is not None else None
        if int(wrong.sum()) >= self.min_errors and overall > 0:
            member_min = max(MIN_SLICE_SAMPLES, math.ceil(min_count * MEMBER_SHARE))
            features = self._slice_features(samples, wrong, member_min)
            if features is not None:
                slices, tested = find_slices(features, errors, wrong, min_count)
                groups = find_groups(
                    features, errors, wrong, min_count, self.rule.ratio, member_min=member_min,
                    labels=labels if classification else None, predictions=preds if classification else None,
                )
                candidates = groups.findings
                findings = self.rule.qualifying(candidates, analysis)
                report.update(
                    slices_tested=tested, member_min=member_min, member_candidates=groups.candidates,
                    conjunctions_tested=groups.conjunctions, hypotheses=groups.hypotheses,
                    findings=[{**f.to_dict(), "description": describe_members(f, decode)} for f in findings],
                    slices=[s.to_dict() for s in slices[:_LISTED_SLICES]],
                )
        values[errors_tag("clusters")] = float(len(findings))
        worst = findings[0] if findings else slices[0] if slices else None
        if worst is not None:
            values[errors_tag("worst_cluster_rate")] = worst.error_rate
            values[errors_tag("worst_cluster_share")] = worst.share
        self.last = report
        self.writer.scalars(values, step)
        if findings or slices:
            self.writer.text(
                errors_tag("clusters"), _table(findings, slices[:_TABLE_SLICES], self.top_tokens, decode), step
            )
        self._write_json(report)
        found = ErrorGroups(candidates, overall, decode, analysis)
        self.record(self.feed(self.context(trainer), Measures(error_groups=found)))

    def _per_class(self, labels: np.ndarray, preds: np.ndarray, values: dict[str, float]) -> dict[str, Any]:
        from torchmetrics.functional.classification import (
            multiclass_confusion_matrix,
            multiclass_precision,
            multiclass_recall,
        )

        num_classes = int(max(labels.max(), preds.max())) + 1
        target, pred = torch.as_tensor(labels), torch.as_tensor(preds)
        precision = multiclass_precision(pred, target, num_classes, average=None, zero_division=0).tolist()
        recall = multiclass_recall(pred, target, num_classes, average=None, zero_division=0).tolist()
        for c in range(min(num_classes, _MAX_CLASS_SCALARS)):
            values[errors_tag("precision", f"class_{c}")] = float(precision[c])
            values[errors_tag("recall", f"class_{c}")] = float(recall[c])
        confusion = multiclass_confusion_matrix(pred, target, num_classes).tolist()
        return {"precision": precision, "recall": recall, "confusion_matrix": confusion}

    def _decode(self, feature: str) -> str:
        try:
            return str(self.tokenizer.decode([int(t) for t in feature.split()]))
        except (ValueError, TypeError, AttributeError):
            return feature

    def _write_json(self, report: dict[str, Any]) -> None:
        session = self._session
        if session is None or not session.is_global_zero:
            return
        write_json(os.path.join(session.diag_dir, ERRORS_FILE), report)


def _table(findings: Sequence[Any], slices: Sequence[Any], top: int, decode: Callable[[str], str] | None) -> str:
    rows = [
        "| group | samples | share | error rate | rest | lift | p (corrected) | defining features | "
        "label -> predicted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, groups in (("finding", findings), ("slice", slices)):
        for i, g in enumerate(groups):
            if getattr(g, "kind", "slice") == "slice":
                shown = ", ".join(f"`{describe_feature(f, decode)}`" for f in g.features[:top])
                if len(g.features) > top:
                    shown += f" and {len(g.features) - top} more"
            else:
                shown = describe_members(g, decode)
            label = getattr(g, "majority_label", None)
            labels = "" if label is None else f"{label} -> {g.majority_prediction}"
            rows.append(
                f"| {kind} {i} | {g.size} | {g.share:.0%} | {g.error_rate:.1%} | {g.rest_error_rate:.1%} | "
                f"{g.lift:.1f}x | {g.p_adjusted:.1g} | {shown} | {labels} |"
            )
    return "\n".join(rows)
