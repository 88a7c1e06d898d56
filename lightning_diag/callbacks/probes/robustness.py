"""RobustnessProbe: the validation metric's drop when 5% of the tokens are perturbed (seed 000 §2.1)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from torch import nn

from lightning_diag.callbacks.common.base import AlertHandler, RuleChoices
from lightning_diag.callbacks.common.preset import Detector, Preset
from lightning_diag.callbacks.common.unlogged import unlogged_copy
from lightning_diag.callbacks.error_analysis.samples import default_predictions
from lightning_diag.callbacks.probes.probe import LossFn, ProbeError, ValidationProbe
from lightning_diag.core.alerts import Alert
from lightning_diag.core.tags import robustness_tag
from lightning_diag.core.validation import check_callable, check_int
from lightning_diag.instrument.batches import token_ids
from lightning_diag.rules.measures import Measures
from lightning_diag.rules.robustness import (
    ROBUSTNESS_DROP,
    ROBUSTNESS_RATE_KEY,
    RobustnessDropRule,
)
from lightning_diag.stats.perturb import adjacent_swaps, random_replacements

__all__ = ["Perturbation", "RobustnessProbe", "RobustnessResult"]

Perturbation = Literal["replace", "swap"]
#: ``perturb(batch, kind, rate, generator) -> batch``: a perturbed copy of a batch, for inputs other than token ids.
PerturbFn = Callable[[Any, str, float, torch.Generator], Any]
_IGNORE_INDEX = -100


@dataclasses.dataclass(frozen=True)
class RobustnessResult:
    """One probe: the metric on the clean batches and under each perturbation.

    Attributes:
        metric: ``"accuracy"`` (predictions read from ``validation_step``) or ``"likelihood"`` (exp(−loss)).
        clean: The metric on the clean batches.
        perturbed: The metric under each perturbation kind.
    """

    metric: str
    clean: float
    perturbed: dict[str, float]

    @property
    def drops(self) -> dict[str, float]:
        """Relative drop of the metric per kind: ``(clean − perturbed) / clean``."""
        return {k: (self.clean - v) / self.clean if self.clean > 0 else math.nan for k, v in self.perturbed.items()}


class RobustnessProbe(ValidationProbe):
    """Measures how much the validation metric drops when ``rate`` (5%) of the tokens are perturbed.

    At the end of validation, every ``every_n_epochs`` epochs, on the first ``num_batches`` validation batches,
    inside the probes' sandbox (eval mode, ``self.log`` silenced, parameters untouched, every RNG restored), the
    metric is measured on the clean batch and on each perturbation of its token ids: ``replace`` (random
    replacement: typos at token level) and ``swap`` (adjacent tokens swapped: shuffled words). Padding
    (``attention_mask == 0``) is never perturbed; labels are never changed. A ``perturb=`` callable perturbs
    other input types.

    The metric (higher is better): accuracy when ``validation_step`` returns logits or predictions that, with
    the batch's labels, give one (classification, or token accuracy with ``-100`` ignored; the same reading as
    :class:`~lightning_diag.ErrorAnalysis`); otherwise the likelihood exp(−loss) of the module's loss
    (``loss_fn`` or ``training_step``), whose relative drop is ``1 − exp(L_clean − L_perturbed)``: scale-free, so
    a converged loss near zero does not make a tiny change look large.

    Rule ``robustness_drop`` (warning): the relative drop above ``threshold`` (15%, three times the perturbed
    share: a model whose evidence is spread over its input loses about the share of the input that changed,
    one that keys on exact tokens or their order loses much more).

    Logged (global rank zero, step = global step): ``diag/robustness/clean``, ``diag/robustness/<kind>/metric``,
    ``diag/robustness/<kind>/drop``, ``diag/threshold/robustness_drop``.

    Args:
        perturbations: The kinds measured (``"replace"``, ``"swap"``).
        vocab_size: Ids drawn for replacements are in ``[0, vocab_size)``; default: the model's largest
            ``nn.Embedding`` that covers the batch's ids, else the batch's largest id + 1.
        perturb: ``perturb(batch, kind, rate, generator) -> batch`` for inputs without token ids.
        every_n_epochs: Probe every this many epochs.
        num_batches: Validation batches per probe.
        loss_fn: ``loss_fn(pl_module, batch) -> loss`` for the likelihood metric; default ``training_step``.
        seed: Seed of the perturbations (the same tokens are perturbed at every probe).
        rules: ``{"robustness_drop": {"threshold": ...}}``: the rule's threshold and settings
            (docs/thresholds.md), or ``False`` to switch it off.
        on_alert: Called with each alert as it is recorded (global rank zero).

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range.
    """

    preset = Preset("RobustnessProbe", (Detector(RobustnessDropRule, "rule", "rules"),))

    def __init__(
        self,
        *,
        perturbations: Sequence[Perturbation] = ("replace", "swap"),
        vocab_size: int | None = None,
        perturb: PerturbFn | None = None,
        every_n_epochs: int = 1,
        num_batches: int = 2,
        loss_fn: LossFn | None = None,
        seed: int = 0,
        rules: RuleChoices | None = None,
        on_alert: AlertHandler | None = None,
    ) -> None:
        super().__init__(
            every_n_epochs=every_n_epochs, num_batches=num_batches, loss_fn=loss_fn, rules=rules, on_alert=on_alert
        )
        #: Share of the tokens perturbed (``robustness_drop.rate``).
        self.rate = self.setting(ROBUSTNESS_RATE_KEY)
        kinds = tuple(perturbations) if isinstance(perturbations, (list, tuple)) else ()
        if not kinds or any(k not in ("replace", "swap") for k in kinds):
            raise ValueError(f"Expected argument `perturbations` to be a non-empty sequence of 'replace' and 'swap', "
                             f"but got {perturbations!r}")
        self.perturbations: tuple[str, ...] = kinds
        self.vocab_size = None if vocab_size is None else check_int("vocab_size", vocab_size, low=2)
        self.perturb = check_callable("perturb", perturb)
        self.seed = check_int("seed", seed, low=0)
        self.add_preset()
        self.last_result: RobustnessResult | None = None

    # -- measuring --------------------------------------------------------------------------------------------
    def measure(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batches: list[tuple[int, Any]]
    ) -> RobustnessResult:
        """The metric on the clean batches and under each perturbation (no gradient)."""
        owned = [(i, self.own_batch(b)) for i, b in batches]
        with torch.no_grad():
            first_idx, first = owned[0]
            metric = "accuracy" if self._accuracy(pl_module, first, first_idx) is not None else "likelihood"
            clean = self._metric(trainer, pl_module, owned, metric)
            perturbed = {}
            for kind in self.perturbations:
                generator = torch.Generator().manual_seed(self.seed)
                noisy = [(i, self._perturbed(pl_module, b, kind, generator)) for i, b in owned]
                perturbed[kind] = self._metric(trainer, pl_module, noisy, metric)
        return RobustnessResult(metric, clean, perturbed)

    @staticmethod
    def _accuracy(pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> tuple[int, int] | None:
        quiet = unlogged_copy(pl_module)  # its self.log reaches no logged value
        outputs = quiet.validation_step(batch, batch_idx)
        found = default_predictions(quiet, batch, outputs)
        if found is None:
            return None
        preds, labels = found
        if preds.is_floating_point():
            preds = preds.argmax(-1)
        if preds.shape != labels.shape:
            return None
        valid = labels != _IGNORE_INDEX
        return int(((preds == labels) & valid).sum()), int(valid.sum())

    def _metric(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batches: list[tuple[int, Any]], metric: str
    ) -> float:
        if metric == "accuracy":
            counts = [self._accuracy(pl_module, b, i) for i, b in batches]
            right = sum(c[0] for c in counts if c is not None)
            total = sum(c[1] for c in counts if c is not None)
            return right / total if total else math.nan
        return math.exp(-float(self.mean_loss(trainer, pl_module, batches)))

    def _perturbed(self, pl_module: pl.LightningModule, batch: Any, kind: str, generator: torch.Generator) -> Any:
        if self.perturb is not None:
            return self.perturb(batch, kind, self.rate, generator)
        ids = token_ids(batch)
        if ids is None:
            raise ProbeError("the batch has no token ids (input_ids, or a 2-D integer tensor): pass perturb=... "
                             "to perturb other inputs")
        mask = batch.get("attention_mask") if isinstance(batch, dict) else None
        mask = mask if isinstance(mask, torch.Tensor) and mask.shape == ids.shape else None
        if kind == "replace":
            new = random_replacements(ids, self.rate, self._vocab(pl_module, ids), generator, mask)
        else:
            new = adjacent_swaps(ids, self.rate, generator, mask)
        if isinstance(batch, dict):
            return {**batch, "input_ids": new}
        if isinstance(batch, (tuple, list)):
            return type(batch)(new if item is ids else item for item in batch)
        return new

    def _vocab(self, pl_module: pl.LightningModule, ids: torch.Tensor) -> int:
        if self.vocab_size is not None:
            return self.vocab_size
        top = int(ids.max()) + 1
        sizes = [m.num_embeddings for m in pl_module.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
        covering = [n for n in sizes if n >= top]
        return max(covering) if covering else top

    # -- deciding ---------------------------------------------------------------------------------------------
    def decide(self, trainer: pl.Trainer, result: RobustnessResult) -> list[Alert]:
        """Log the measurement and feed ``robustness_drop``."""
        self.last_result = result
        values = {robustness_tag("clean"): result.clean, **self.threshold_lines(ROBUSTNESS_DROP)}
        for kind, value in result.perturbed.items():
            values[robustness_tag(kind, "metric")] = value
            values[robustness_tag(kind, "drop")] = result.drops[kind]
        self.writer.scalars({k: v for k, v in values.items() if math.isfinite(v)}, trainer.global_step)
        return self.feed(self.context(trainer), Measures(robustness_drops=result.drops))
