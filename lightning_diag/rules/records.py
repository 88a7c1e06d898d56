"""Measurement records of several parts, held by a :class:`~lightning_diag.rules.measures.Measures` field
(framework-free).

Each is what a callback's measuring part (or :mod:`lightning_diag.instrument`) computed and a detector reads: an
activation's reading, a layer's sampled update, the sampled data, the sampled sequences, an attention module's
per-head statistics. They sit beside :mod:`lightning_diag.rules.measures` (the closed set and its smaller
records) rather than in the rule module that judges them, so that a measuring part imports the measurements and
nothing named after a rule.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

__all__ = [
    "ActivationReading",
    "DataMeasurement",
    "InputProblem",
    "LayerStats",
    "LayerUpdate",
    "SequenceMeasurement",
]


@dataclasses.dataclass(frozen=True)
class ActivationReading:
    """What one call of an activation module saw in a measured forward.

    Attributes:
        layer: The layer reported: the trainable module that ran just before the activation (``net.3``), else the
            activation module's own name.
        activation: The activation's class name (``"ReLU"``, ``"Tanh"``).
        dead: Share of the layer's units inactive for every sample of the batch (ReLU family with enough rows),
            else ``None``.
        zero_grad: Share of exactly-zero entries of the layer's weight gradient, ``None`` when unknown.
        saturated: Share of the activation's inputs beyond its linear range (bounded activations followed by a
            trainable layer), else ``None``.
        limit: The linear range's bound (``5`` for tanh), ``None`` for the ReLU family.
        first: Whether this is the first activation of the forward, right after the first trainable layer (the one
            that reads the model's inputs).
        after_frozen: Whether a frozen layer (no parameter requiring a gradient) ran before this layer in the
            forward: the layer reads a frozen part's fixed features.
    """

    layer: str
    activation: str
    dead: float | None = None
    zero_grad: float | None = None
    saturated: float | None = None
    limit: float | None = None
    first: bool = False
    after_frozen: bool = False


@dataclasses.dataclass(frozen=True)
class LayerUpdate:
    """What one measured optimizer step did to a layer's sampled elements.

    Attributes:
        counted: Sampled elements with a finite, non-zero gradient.
        unchanged: Of those, the elements the step left bit-for-bit unchanged.
        low_precision: Whether the layer's parameters are bf16 or fp16.
        cause: A key of :data:`~lightning_diag.rules.updates_applied.UPDATE_CAUSES` known before looking
            (``"no_optimizer"``, ``"lr_zero"``), else ``None``.
    """

    counted: int
    unchanged: int
    low_precision: bool = False
    cause: str | None = None

    @property
    def share(self) -> float:
        """Share of the counted elements left unchanged (0 when none was counted)."""
        return self.unchanged / self.counted if self.counted else 0.0


@dataclasses.dataclass(frozen=True)
class InputProblem:
    """Something wrong with the inputs of one split: a non-finite tensor, constant features, empty sequences.

    Attributes:
        split: ``"train"`` or ``"val"``.
        key: Where in the batch: ``"input_ids"``, ``"[0]"``, ``"[0].pixel_values"``...
        kind: ``"nonfinite"`` (critical), ``"constant"`` or ``"empty"`` (info).
        count: Samples concerned (for ``constant``: features).
        examples: Dataset indices of a few samples concerned (for ``constant``: feature indices).
    """

    split: str
    key: str
    kind: str
    count: int
    examples: tuple[int, ...] = ()


@dataclasses.dataclass
class DataMeasurement:
    """One measurement of the sampled data (host floats; ``nan`` where not measured).

    Attributes:
        vocab_kl: Smoothed ``KL(P_val || P_train)`` of the token frequencies.
        oov_share: Share of validation tokens never seen in the training sample.
        leaked_fraction: Estimated share of validation samples copying a training sample.
        leaked: Validation samples found leaked in the sample.
        val_samples: Validation samples compared.
        leak_examples: ``(val index, train index, similarity)`` of a few leaked samples.
        leak_parts: What the leakage search compared: ``("token ids",)``, ``("token ids", "pixel_values")`` (a
            multimodal sample matches only when its other parts are equal too), ``("input features",)``.
        text_only_leaks: Multimodal samples: validation samples whose text copies a training sample's while their
            other parts differ (not leaks; an ``info`` alert).
        label_std: Standard deviation of the class proportions, per split.
        label_counts: Samples per class, per split.
        problems: Broken inputs found.
    """

    vocab_kl: float = math.nan
    oov_share: float = math.nan
    leaked_fraction: float = math.nan
    leaked: int = 0
    val_samples: int = 0
    leak_examples: Sequence[tuple[int, int, float]] = ()
    leak_parts: Sequence[str] = ()
    text_only_leaks: int = 0
    label_std: Mapping[str, float] = dataclasses.field(default_factory=dict)
    label_counts: Mapping[str, Sequence[int]] = dataclasses.field(default_factory=dict)
    problems: Sequence[InputProblem] = ()


@dataclasses.dataclass(frozen=True)
class SequenceMeasurement:
    """What one measurement found about the sampled sequences.

    Attributes:
        label_positions: Token-level label positions (label other than -100) of the sampled training batches
            that have a padding mask.
        padded_labels: Of those, the positions that are padding.
        padded_examples: Dataset indices of a few training samples with labelled padding.
        extent: ``{split: positions the longest sampled sample uses}`` (last non-padding token + 1).
        capacity: The model's position capacity, or ``None`` when none was found.
        capacity_source: Where the capacity comes from (``config.max_position_embeddings``, a module name).
    """

    label_positions: int = 0
    padded_labels: int = 0
    padded_examples: Sequence[int] = ()
    extent: Mapping[str, int] = dataclasses.field(default_factory=dict)
    capacity: int | None = None
    capacity_source: str = ""

    @property
    def padded_share(self) -> float | None:
        """Share of the label positions that are padding (``None`` when no label position was measured)."""
        return self.padded_labels / self.label_positions if self.label_positions else None


class LayerStats(NamedTuple):
    """One attention module's per-head statistics at one measured step (host floats, one per head).

    ``first_mass`` (mass on the first key each query may see; empty when unknown) and ``causal`` (whether the
    module's mask is causal) tell an attention sink of causal attention from a collapse.
    """

    entropy: Sequence[float]
    uniform: Sequence[float]
    special_mass: Sequence[float]
    special_share: Sequence[float]
    first_mass: Sequence[float] = ()
    causal: bool = False
    coverage: Sequence[float] = ()
