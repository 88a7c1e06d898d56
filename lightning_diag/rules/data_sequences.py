"""Sequence rules of the data (framework-free): ``loss_on_padding``, ``position_overflow``.

Fed by :class:`~lightning_diag.DataDiagnostics` with a :class:`SequenceMeasurement` of the sampled batches, at the
same measurements as the other data rules (before the first step, and with ``every_n_epochs`` again). Exact
meaning:

* ``loss_on_padding`` (warning): in the sampled training batches that have token-level labels (``labels`` of the
  shape of ``input_ids``) and a padding mask (``attention_mask``, or ``pad_token_id``), the share of label
  positions (labels other than the ignore index -100) that are padding is above ``padding_labels`` (default 0:
  any). The loss then trains the model to predict the padding token. Batches without padding, and Hugging Face
  causal-LM batches whose ``labels`` are the ``input_ids`` with padding set to -100, are healthy.
* ``position_overflow`` (warning): the positions a sample uses (its last non-padding token's position + 1) go
  beyond what training covers: a validation sample longer than ``length_ratio`` times the longest training sample
  seen (in this measurement and every earlier one), a training sample at a later measurement longer than that
  ratio times the longest of every earlier measurement (a curriculum or a changed loader), or any sample longer
  than the model's position capacity (``config.max_position_embeddings`` of a Hugging Face model, the size of a
  learned position embedding, a rotary cache). Sources ``val``, ``train`` and ``capacity``.

Each (rule, source) pair is latched; a later measurement that finds the condition gone clears it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import Limit, RuleSpec, default, register
from lightning_diag.rules.base import Rule, StepContext
from lightning_diag.rules.measures import Measure, Measures
from lightning_diag.rules.records import SequenceMeasurement

__all__ = [
    "DEFAULT_LENGTH_RATIO",
    "DEFAULT_PADDING_LABELS",
    "LOSS_ON_PADDING",
    "LOSS_ON_PADDING_SPEC",
    "POSITION_OVERFLOW",
    "POSITION_OVERFLOW_SPEC",
    "SequenceRules",
]

# -- declarations (one per rule id; the docs' thresholds table and the report read them) -----------------------
_DATA = "DataDiagnostics"
LOSS_ON_PADDING_SPEC = register(RuleSpec(
    "loss_on_padding", _DATA, "warning", 0.0,
    "share of the label positions of sampled training batches that are padding (attention mask 0) "
    "yet carry a label other than -100, above {threshold:g}",
    limits={"threshold": Limit(low=0.0, high=1.0, low_inclusive=True, high_inclusive=False)},
))
POSITION_OVERFLOW_SPEC = register(RuleSpec(
    "position_overflow", _DATA, "warning", 1.0,
    "sequences longer than {threshold:g}x the longest training sequence seen (validation, or a later "
    "training measurement), or longer than the model's position capacity",
    limits={"threshold": Limit(low=1.0, low_inclusive=True)},
))
LOSS_ON_PADDING = LOSS_ON_PADDING_SPEC.rule_id
POSITION_OVERFLOW = POSITION_OVERFLOW_SPEC.rule_id

#: ``loss_on_padding``: share of the label positions that are padding, above this.
DEFAULT_PADDING_LABELS = default(LOSS_ON_PADDING)
#: ``position_overflow``: a sample longer than this many times the longest training sample seen.
DEFAULT_LENGTH_RATIO = default(POSITION_OVERFLOW)


class SequenceRules(Rule):
    """``loss_on_padding`` and ``position_overflow`` over one :class:`SequenceMeasurement`.

    State: the longest training extent of earlier measurements (a resumed run compares with it) and the latch.

    Example:
        >>> rules = SequenceRules()
        >>> m = SequenceMeasurement(label_positions=100, padded_labels=20, extent={"train": 24, "val": 40})
        >>> sorted((a.rule, a.source) for a in rules.judge(StepContext(0, 0), Measures(sequences=m)))
        [('loss_on_padding', 'train'), ('position_overflow', 'val')]
    """

    specs = (LOSS_ON_PADDING_SPEC, POSITION_OVERFLOW_SPEC)
    setting_keys: ClassVar[Mapping[str, str]] = {"padding_labels": LOSS_ON_PADDING, "length_ratio": POSITION_OVERFLOW}
    state_keys = ("train_extent",)
    needs = frozenset({Measure.SEQUENCES})

    def __init__(
        self, padding_labels: float = DEFAULT_PADDING_LABELS, length_ratio: float = DEFAULT_LENGTH_RATIO
    ) -> None:
        super().__init__()
        self.padding_labels = padding_labels
        self.length_ratio = length_ratio
        self.train_extent = 0

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one measurement, ``m.sequences``; return the alerts that just became active."""
        assert m.sequences is not None  # checked against `needs`
        return self._judge(m.sequences, ctx)

    def _judge(self, m: SequenceMeasurement, ctx: StepContext) -> list[Alert]:
        alerts = self._padding(m, ctx)
        earlier = self.train_extent
        train = int(m.extent.get("train", 0))
        seen = max(earlier, train)
        val = m.extent.get("val")
        if val is not None and seen:
            self.observe(val / seen, self.length_ratio, rule=POSITION_OVERFLOW)
            bad = val > self.length_ratio * seen
            if self.latch.update(f"{POSITION_OVERFLOW}:val", bad):
                alerts.append(
                    self._alert(
                        ctx,
                        f"validation samples use {val} positions but the longest training sample seen uses {seen}: "
                        "positions beyond it were never trained (learned position embeddings are untrained there, "
                        "rotary or ALiBi extrapolate), so validation measures extrapolation; truncate validation to "
                        "the training length, or train on long sequences too",
                        source="val",
                        value=val / seen,
                        threshold=self.length_ratio,
                        rule=POSITION_OVERFLOW,
                    )
                )
        if earlier and train:
            bad = train > self.length_ratio * earlier
            if self.latch.update(f"{POSITION_OVERFLOW}:train", bad):
                alerts.append(
                    self._alert(
                        ctx,
                        f"training samples now use {train} positions, longer than the {earlier} of every earlier "
                        "measurement: the positions beyond were never trained; if the sequence length grows on "
                        "purpose (a curriculum), expect a loss spike there",
                        source="train",
                        value=train / earlier,
                        threshold=self.length_ratio,
                        rule=POSITION_OVERFLOW,
                    )
                )
        longest = max(m.extent.values(), default=0)
        if m.capacity:
            bad = longest > m.capacity
            if self.latch.update(f"{POSITION_OVERFLOW}:capacity", bad):
                where = ", ".join(f"{s} {n}" for s, n in sorted(m.extent.items()) if n > m.capacity)
                alerts.append(
                    self._alert(
                        ctx,
                        f"sampled sequences are longer than the model's position capacity ({m.capacity}, "
                        f"{m.capacity_source}): {where} positions; a learned position embedding fails with an index "
                        "error (or a device-side assert) there, a rotary cache is recomputed or overruns; truncate "
                        "the inputs to the capacity (`max_length=`, `truncation=True`) or use a model built for them",
                        source="capacity",
                        value=float(longest),
                        threshold=float(m.capacity),
                        rule=POSITION_OVERFLOW,
                    )
                )
        self.train_extent = seen
        return alerts

    def _padding(self, m: SequenceMeasurement, ctx: StepContext) -> list[Alert]:
        share = m.padded_share
        if share is None:
            return []
        self.observe(share, self.padding_labels, rule=LOSS_ON_PADDING)
        if not self.latch.update(f"{LOSS_ON_PADDING}:train", share > self.padding_labels):
            return []
        examples = ", ".join(str(i) for i in list(m.padded_examples)[:5])
        return [
            self._alert(
                ctx,
                f"the loss trains on padding: {share:.1%} of the label positions of the sampled training batches "
                f"({m.padded_labels} of {m.label_positions}) are padding (attention mask 0) with a label other than "
                f"-100 (dataset indices {examples}); set `labels[attention_mask == 0] = -100` in the collator (or use "
                "`DataCollatorForLanguageModeling(mlm=False)` / `DataCollatorForSeq2Seq`, which do it), so the "
                "padding token is not learned",
                source="train",
                value=share,
                threshold=self.padding_labels,
            )
        ]
