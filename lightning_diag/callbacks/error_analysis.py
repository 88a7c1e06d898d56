"""ErrorAnalysis: which validation inputs the model gets wrong, clustered, with the group that fails most named."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.trainer.states import TrainerFn

from lightning_diag.callbacks.base import AlertHandler, DiagCallback, RuleChoices
from lightning_diag.core.tags import errors_tag
from lightning_diag.core.validation import check_int
from lightning_diag.instrument.batches import is_int_tensor, token_ids
from lightning_diag.rules.errors import ERROR_CLUSTER_SPEC, ErrorClusterRule

__all__ = ["DEFAULT_MAX_SAMPLES", "ERRORS_FILE", "ErrorAnalysis", "Predictions"]

#: Validation samples kept per analysed validation, at most (bounds memory and the clustering's time).
DEFAULT_MAX_SAMPLES = 4096
#: Per-class precision and recall are logged for at most this many classes.
_MAX_CLASS_SCALARS = 32
ERRORS_FILE = "errors.json"
_LABEL_KEYS = ("labels", "label", "targets", "target", "y")
_IGNORE_INDEX = -100

#: ``predict(pl_module, batch, outputs) -> (predictions, labels)``: class ids ``[B]`` (or logits ``[B, C]``) and
#: labels ``[B]``; or token predictions ``[B, T]`` (or logits ``[B, T, V]``) and labels ``[B, T]`` (-100 ignored).
Predictions = Callable[[pl.LightningModule, Any, Any], "tuple[torch.Tensor, torch.Tensor] | None"]


def _labels_of(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, dict):
        for key in _LABEL_KEYS:
            if is_int_tensor(batch.get(key)):
                return batch[key]
        return None
    if isinstance(batch, (tuple, list)) and len(batch) >= 2 and is_int_tensor(batch[-1]):
        return batch[-1]
    return None


def default_predictions(pl_module: pl.LightningModule, batch: Any, outputs: Any) -> tuple[Any, Any] | None:
    """What ``validation_step`` returned, read as predictions, and the labels.

    ``outputs`` is a logits tensor, or a dict with ``"logits"`` or ``"preds"`` (and optionally ``"labels"`` /
    ``"target"``); the labels default to the batch's (``batch["labels"]`` and the other usual keys, or the last
    element of a tuple batch). Logits ``[B, T, V]`` against labels that are the batch's own ``input_ids`` (a
    causal LM, which Hugging Face shifts itself) are compared one position ahead.
    """
    preds: Any
    labels: Any
    if isinstance(outputs, torch.Tensor):
        preds, labels = outputs, None
    elif isinstance(outputs, dict):
        preds = outputs.get("logits", outputs.get("preds"))
        labels = outputs.get("labels", outputs.get("target"))
    else:
        return None
    if not isinstance(preds, torch.Tensor):
        return None
    labels = labels if isinstance(labels, torch.Tensor) else _labels_of(batch)
    if labels is None:
        return None
    if preds.is_floating_point() and preds.dim() == 3 and labels.dim() == 2:
        ids = token_ids(batch)
        if ids is not None and ids.shape == labels.shape and torch.equal(ids, labels):
            return preds[:, :-1], labels[:, 1:]
    return preds, labels


class ErrorAnalysis(DiagCallback):
    """Clusters the validation samples the model gets wrong and names the group that fails most (seed 001 §2.2).

    At validation end (every ``every_n_validations`` validations of a fit, never the sanity check), the
    samples seen by ``validation_step`` (up to ``max_samples``) are scored: classification samples are wrong
    when the argmax differs from the label; token tasks score each sequence by its token error rate (labels
    ``-100`` ignored) and count it wrong when that rate is above the validation set's mean. Each sample's
    features are TF-IDF over its token ids (unigrams and bigrams; padding excluded by the attention mask), or
    ``embed(pl_module, batch)``'s rows. K-Means, with k chosen by silhouette within ``k_range``, is fitted on
    the wrong samples; every sample is then assigned to a cluster and each cluster's error rate is measured on
    all of its samples (:mod:`lightning_diag.stats.error_clusters`). Nothing runs on training steps.

    Rule ``error_cluster`` (warning): a cluster whose error rate is at least ``ratio`` times the overall rate
    and which holds at least ``min_share`` of the validation samples; the message names its top tokens (decoded
    with ``tokenizer.decode`` when given), its majority true and predicted labels, size and error rate.

    Logged (global rank zero): ``diag/errors/rate`` (overall), ``diag/errors/worst_cluster_rate``,
    ``diag/errors/worst_cluster_share``, ``diag/errors/clusters`` (k), per class ``diag/errors/precision/
    class_<c>`` and ``diag/errors/recall/class_<c>`` (classification, first 32 classes), a markdown table as
    TensorBoard text ``diag/errors/clusters``, and ``<log_dir>/diag/errors.json`` (clusters, confusion matrix).

    Args:
        every_n_validations: Analyse every this many validations.
        max_samples: Validation samples kept per analysis (memory and time budget; later batches are skipped).
        k_range: ``(low, high)`` numbers of clusters tried.
        embed: ``embed(pl_module, batch) -> Tensor[B, D]`` features instead of TF-IDF (needed for inputs
            without token ids).
        predict: ``predict(pl_module, batch, outputs) -> (predictions, labels)`` instead of reading what
            ``validation_step`` returned (:func:`default_predictions`).
        tokenizer: Anything with ``decode(list[int]) -> str``, to print the top tokens as text.
        top_tokens: Distinguishing tokens named per cluster.
        seed: Seed of the clustering.
        rules: ``{"error_cluster": {"threshold": 4.0, "min_share": 0.1, "min_errors": 20}}``: the ratio of a
            cluster's error rate to the overall rate, its smallest share of the validation samples and the fewest
            wrong samples to cluster (docs/thresholds.md), or ``False`` to switch the rule off.
        on_alert: Called with each alert as it is recorded (global rank zero).

    Raises:
        ValueError: On an out-of-range argument (named in the message).
        TypeError: When ``embed``, ``predict`` or ``tokenizer`` is not what is documented.
    """

    extra_state_keys = ("validations",)

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
        self.min_errors = int(self.setting(ERROR_CLUSTER_SPEC.key("min_errors")))
        if (
            not isinstance(k_range, (tuple, list)) or len(k_range) != 2
            or not all(isinstance(k, int) and not isinstance(k, bool) for k in k_range)
            or not 2 <= k_range[0] <= k_range[1]
        ):
            raise ValueError(f"Expected argument `k_range` to be a pair of ints 2 <= low <= high, but got {k_range!r}")
        self.k_range = (int(k_range[0]), int(k_range[1]))
        for name, fn in (("embed", embed), ("predict", predict)):
            if fn is not None and not callable(fn):
                raise TypeError(f"Expected argument `{name}` to be a callable or None, but got {fn!r}")
        if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
            raise TypeError(f"Expected argument `tokenizer` to have a `decode` method, but got {tokenizer!r}")
        self.embed, self.predict, self.tokenizer = embed, predict, tokenizer
        self.top_tokens = check_int("top_tokens", top_tokens, low=1)
        self.seed = check_int("seed", seed, low=0)
        self.rule = self.add_rule("rule", ErrorClusterRule.from_settings)
        self.validations = 0
        self.last: dict[str, Any] | None = None
        self._reset_buffers()
        self._active = False

    def _reset_buffers(self) -> None:
        self._errors: list[float] = []
        self._labels: list[int] = []
        self._preds: list[int] = []
        self._features: list[Any] = []
        self._classification = True

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
        self._reset_buffers()
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
        if not self._active or dataloader_idx != 0 or len(self._errors) >= self.max_samples:
            return
        with torch.no_grad():
            found = (self.predict or default_predictions)(pl_module, batch, outputs)
            if found is None:
                self._give_up(trainer, "no predictions: return logits (or a dict with 'logits'/'preds') from "
                              "`validation_step`, with labels in the batch, or pass predict=")
                return
            scored = self._score(*found)
            if scored is None:
                self._give_up(trainer, "predictions and labels of unexpected shapes: pass predict= returning "
                              "([B] or [B, C], [B]) or ([B, T] or [B, T, V], [B, T])")
                return
            errors, labels, preds = scored
            features = self._batch_features(pl_module, batch, len(errors))
            if features is None:
                self._give_up(trainer, "the batch has no token ids: pass embed=(pl_module, batch) -> Tensor[B, D]")
                return
        room = self.max_samples - len(self._errors)
        self._errors.extend(errors[:room])
        self._labels.extend(labels[:room])
        self._preds.extend(preds[:room])
        self._features.extend(features[:room])

    def _give_up(self, trainer: pl.Trainer, why: str) -> None:
        self._active = False
        self._reset_buffers()
        self.notice(trainer, f"nothing-{why[:20]}", f"nothing is analysed: {why}")

    def _score(self, preds: torch.Tensor, labels: torch.Tensor) -> tuple[list[float], list[int], list[int]] | None:
        if preds.is_floating_point():
            preds = preds.argmax(-1)
        if preds.shape != labels.shape or preds.dim() not in (1, 2):
            return None
        preds, labels = preds.detach().cpu(), labels.detach().cpu()
        if preds.dim() == 1:
            return (preds != labels).float().tolist(), labels.tolist(), preds.tolist()
        self._classification = False
        valid = labels != _IGNORE_INDEX
        counts = valid.sum(-1)
        wrong = ((preds != labels) & valid).sum(-1).float()
        rates = torch.where(counts > 0, wrong / counts.clamp(min=1), torch.full_like(wrong, math.nan))
        return rates.tolist(), [-1] * len(rates), [-1] * len(rates)

    def _batch_features(self, pl_module: pl.LightningModule, batch: Any, size: int) -> list[Any] | None:
        if self.embed is not None:
            rows = self.embed(pl_module, batch)
            return list(rows.detach().float().cpu().reshape(size, -1).numpy())
        ids = token_ids(batch)
        if ids is None or ids.shape[0] != size:
            return None
        mask = batch.get("attention_mask") if isinstance(batch, dict) else None
        ids = ids.detach().cpu()
        keep = mask.detach().cpu().bool() if isinstance(mask, torch.Tensor) and mask.shape == ids.shape else None
        return [row[keep[i]].numpy() if keep is not None else row.numpy() for i, row in enumerate(ids)]

    # -- analysis ---------------------------------------------------------------------------------------------
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Gather the samples from every rank, cluster, log and judge (every rank decides the same)."""
        if not self._active:
            return
        self._active = False
        mine = (self._errors, self._labels, self._preds, self._features, self._classification)
        parts = [mine]
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            parts = [None] * torch.distributed.get_world_size()  # type: ignore[list-item]
            torch.distributed.all_gather_object(parts, mine)
        errors = np.array([e for p in parts for e in p[0]], dtype=float)
        labels = np.array([v for p in parts for v in p[1]])
        preds = np.array([v for p in parts for v in p[2]])
        features = [f for p in parts for f in p[3]]
        classification = all(p[4] for p in parts)
        self._reset_buffers()
        keep = np.isfinite(errors)
        if keep.sum() < self.min_errors:
            return
        errors, labels, preds = errors[keep], labels[keep], preds[keep]
        features = [f for f, k in zip(features, keep, strict=True) if k]
        self._analyse(trainer, errors, labels, preds, features, classification)

    def _analyse(
        self,
        trainer: pl.Trainer,
        errors: np.ndarray,
        labels: np.ndarray,
        preds: np.ndarray,
        features: list[Any],
        classification: bool,
    ) -> None:
        from lightning_diag.stats.error_clusters import cluster_stats, fit_error_clusters, tfidf_features

        overall = float(errors.mean())
        wrong = errors > 0.5 if classification else errors > overall
        step = trainer.global_step
        values: dict[str, float] = {errors_tag("rate"): overall}
        report: dict[str, Any] = {"step": step, "epoch": trainer.current_epoch, "samples": len(errors),
                                  "error_rate": overall, "task": "classification" if classification else "tokens",
                                  "clusters": []}
        if classification:
            report.update(self._per_class(labels, preds, values))
        clusters: list[Any] = []
        if int(wrong.sum()) >= self.min_errors:
            if self.embed is not None:
                matrix: Any = np.stack(features)
                matrix = (matrix - matrix.mean(0)) / (matrix.std(0) + 1e-8)
                names = None
            else:
                matrix, names = tfidf_features(features)
            fitted = fit_error_clusters(matrix, wrong, self.k_range, self.seed)
            if fitted is not None:
                clusters = cluster_stats(fitted, matrix, errors, wrong, names,
                                         labels if classification else None, preds if classification else None,
                                         self.top_tokens)
                report["k"], report["silhouette"] = fitted.k, fitted.silhouette
                report["clusters"] = [c.to_dict() for c in clusters]
                values[errors_tag("clusters")] = float(fitted.k)
        if clusters:
            values[errors_tag("worst_cluster_rate")] = clusters[0].error_rate
            values[errors_tag("worst_cluster_share")] = clusters[0].share
        self.last = report
        self.writer.scalars(values, step)
        if clusters:
            self.writer.text(errors_tag("clusters"), _table(clusters, overall, self._decode if self.tokenizer
                                                            is not None else None), step)
        self._write_json(report)
        self.record(self.rule.update(clusters, overall, self.context(trainer), self._decode if self.tokenizer
                                     is not None else None))

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
        os.makedirs(session.diag_dir, exist_ok=True)
        with open(os.path.join(session.diag_dir, ERRORS_FILE), "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)


def _table(clusters: Sequence[Any], overall: float, decode: Callable[[str], str] | None) -> str:
    rows = ["| cluster | samples | share | error rate | x overall | top tokens | label -> predicted |",
            "|---|---|---|---|---|---|---|"]
    for c in clusters:
        tokens = ", ".join(f"`{name}`" + (f" ({decode(name)!r})" if decode else "") for name, _ in c.top_features)
        labels = "" if c.majority_label is None else f"{c.majority_label} -> {c.majority_prediction}"
        ratio = c.error_rate / overall if overall > 0 else math.nan
        rows.append(f"| {c.cluster} | {c.size} | {c.share:.0%} | {c.error_rate:.1%} | {ratio:.1f} | {tokens} | "
                    f"{labels} |")
    return "\n".join(rows)
