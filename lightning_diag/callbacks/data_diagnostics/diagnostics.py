"""DataDiagnostics: vocabulary shift, train/validation leakage, label balance and broken inputs, before training."""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.trainer.states import TrainerFn

from lightning_diag.callbacks.common.base import AlertHandler, DiagCallback, RuleChoices
from lightning_diag.callbacks.common.preset import Detector, Preset
from lightning_diag.callbacks.data_diagnostics.batch import (
    UninterpretableBatch,
    interpret,
    read_sample,
    shape_signature,
)
from lightning_diag.callbacks.data_diagnostics.sample import Measured, SplitSample, measure
from lightning_diag.core.registry import default
from lightning_diag.core.tags import data_tag
from lightning_diag.core.validation import check_callable, check_int
from lightning_diag.instrument.batches import size_mismatch
from lightning_diag.instrument.positions import position_capacity
from lightning_diag.output.images import heatmap
from lightning_diag.rules.data_loader import BATCH_SIZE_MISMATCH, LoaderRules
from lightning_diag.rules.data_sample import (
    DATA_LEAKAGE,
    DATA_MAX_BATCHES_SETTING,
    DATA_VOCAB_SHIFT,
    LABEL_IMBALANCE,
    LEAKAGE_MIN_LEAKS_KEY,
    LEAKAGE_NEAR_DUPLICATE_KEY,
    LEAKAGE_NUM_PERM_KEY,
    LEAKAGE_SHINGLE_SIZE_KEY,
    VOCAB_SHIFT_MIN_COUNT_KEY,
    DataRules,
)
from lightning_diag.rules.data_sequences import SequenceRules
from lightning_diag.rules.measures import BatchSizes, LoaderStreams, Measures

__all__ = [
    "DEFAULT_LEAKAGE_SHINGLE_SIZE",
    "DEFAULT_MAX_BATCHES",
    "DEFAULT_MIN_LEAKS",
    "DEFAULT_NUM_PERM",
    "DEFAULT_VOCAB_SHIFT_MIN_COUNT",
    "DataDiagnostics",
]

#: Batches read from each loader per measurement (``data.max_batches``).
DEFAULT_MAX_BATCHES = int(DATA_MAX_BATCHES_SETTING.default)
#: ``data_vocab_shift``: token types seen fewer times (both samples together) are pooled into one bin.
DEFAULT_VOCAB_SHIFT_MIN_COUNT = int(default(VOCAB_SHIFT_MIN_COUNT_KEY))
#: ``data_leakage``: token n-gram size of the shingles.
DEFAULT_LEAKAGE_SHINGLE_SIZE = int(default(LEAKAGE_SHINGLE_SIZE_KEY))
#: ``data_leakage``: MinHash signature length.
DEFAULT_NUM_PERM = int(default(LEAKAGE_NUM_PERM_KEY))
#: ``data_leakage``: leaked samples needed before the share found is extrapolated to the whole training set.
DEFAULT_MIN_LEAKS = int(default(LEAKAGE_MIN_LEAKS_KEY))
_MAX_HIST_VALUES = 1_000_000
_MAX_IMAGE_CLASSES = 256
_SPLITS = ("train", "val")


def _first_loader(loaders: Any) -> tuple[Any, int]:
    """The first loader of what ``trainer.train_dataloader`` / ``val_dataloaders`` hold, and how many there are."""
    if isinstance(loaders, Mapping):
        values = list(loaders.values())
        return (values[0] if values else None), len(values)
    if isinstance(loaders, (list, tuple)) and any(isinstance(x, torch.utils.data.DataLoader) for x in loaders):
        return loaders[0], len(loaders)
    return loaders, 1


class DataDiagnostics(DiagCallback):
    r"""Examines the training and validation data before the first step: vocabulary shift, leakage, labels, inputs.

    At ``on_train_start`` (and, with ``every_n_epochs``, at the start of every n-th epoch) it reads a bounded
    sample of each loader, ``max_batches`` batches, straight from the loader's dataset with its ``collate_fn``
    and a private random generator, in the main process: the training iterator, the sampler (and its generator),
    the workers, the global random states and the generators the dataset holds itself (their states are copied
    and put back) are untouched, so the run is bit-for-bit the run without it. An
    ``IterableDataset`` is read from a fresh ``iter(dataset)``, its first ``max_batches`` batches, never exhausted.
    Under DDP each rank reads its own shard (indices ``rank, rank + world, ...``); the ranks' summaries are
    gathered, so every rank measures the union and decides the same; only global rank zero writes.

    Batches are understood as Lightning users have them: ``(inputs, targets)`` tuples, Hugging Face dicts
    (``input_ids``, ``attention_mask``, ``labels``), plain tensors; anything else through ``extract``. Token ids
    are the vocabulary (no tokenizer needed); padding is left out (``attention_mask``, or ``pad_token_id``).

    Logged (global rank zero, at the step of the measurement; ``<split>`` is ``train`` or ``val``):

    * ``diag/data/vocab_kl``, ``diag/data/oov_share``, ``diag/data/val_rare_share``: vocabulary shift, share of
      validation tokens never seen in the training sample, and seen there fewer than 5 times.
    * ``diag/data/leaked_fraction``, ``diag/data/exact_copies``, ``diag/data/near_copies``,
      ``diag/data/train_coverage``: leakage (see below), and the share of the training set read.
    * ``diag/data/<split>/label_std``, ``diag/data/<split>/classes``, ``diag/data/label_tv`` (total variation
      between the train and val label distributions); ``diag/data/label_distribution`` (image: one row per split,
      one column per class, colour = proportion).
    * ``diag/data/<split>/types``, ``.../head_types``, ``.../head_share``, ``.../singleton_share``: the long tail
      (distinct token ids, fewest ids covering 90% of the tokens, share of ids seen once).
    * ``diag/data/<split>/padding_ratio``, ``.../mean_seq_len``, ``.../samples``, ``.../nonfinite_samples``;
      histograms ``diag/data/<split>/seq_len`` and ``diag/data/<split>/token_ids``.
    * ``diag/data/<split>/max_positions``: positions the longest sampled sample uses (``position_overflow``);
      ``diag/data/train/padding_label_share``: share of token-level label positions that are padding
      (``loss_on_padding``).
    * ``diag/data/seconds``: what the measurement cost; ``diag/data/summary`` (text): class table, leak examples,
      broken inputs; ``diag/threshold/data_vocab_shift``, ``.../data_leakage``, ``.../label_imbalance``.

    Rules (exact meaning in :mod:`lightning_diag.rules.data_sample`, :mod:`lightning_diag.rules.data_loader` and
    docs/data_diagnostics.md):

    * ``data_vocab_shift`` (warning): smoothed ``KL(P_val || P_train)`` of the token frequencies above
      ``data_vocab_shift.threshold`` nats.
    * ``data_leakage`` (warning): share of validation samples whose token-trigram shingle set has Jaccard
      similarity ``>= data_leakage.near_duplicate`` with a training sample (exact copies included) at or above
      ``data_leakage.threshold``;
      a smaller non-zero share is an info alert.
    * ``label_imbalance`` (warning): standard deviation of a split's class proportions above
      ``label_imbalance.threshold``.
    * ``data_nonfinite`` (critical): NaN/Inf in a floating tensor of a sampled batch (key and dataset indices
      named); constant 2-D features and empty sequences are info alerts.
    * ``loss_on_padding`` (warning): share of the token-level label positions (labels other than -100) of the
      sampled training batches that are padding (``attention_mask == 0``, or ``pad_token_id``) above
      ``loss_on_padding.threshold`` (default 0: any).
    * ``position_overflow`` (warning): a validation sample using more than ``position_overflow.threshold`` times
      the positions of the longest training sample seen (at this or an earlier measurement), a training sample at
      a later measurement longer than every earlier one, or any sample longer than the model's position capacity
      (``config.max_position_embeddings``, a learned position embedding, a rotary cache). Judged on the sample,
      so nothing runs during training steps.
    * ``batch_size_mismatch`` (warning): the tensors of a sampled batch, or of a batch the trainer produced (checked
      from ``on_train_batch_start`` until one is reported; shapes only: a batch whose structure and shapes equal
      the last one checked, :func:`~.batch.shape_signature`, is not checked again),
      disagree on the batch dimension (:func:`~lightning_diag.instrument.batches.size_mismatch`).
    * ``worker_rng_shared`` (warning): the training loader has ``num_workers > 0``, a generator the dataset or its
      ``collate_fn`` holds drew while the sample was read, and no ``worker_init_fn`` (or only Lightning's)
      reseeds it: the workers' random augmentations repeat each other.

    Args:
        max_batches: Batches read from each loader per measurement (default 64); ``None`` reads a map-style
            dataset whole (an ``IterableDataset`` is then read to its end: only for finite ones).
        every_n_epochs: Also measure at the start of every n-th epoch; ``None`` (default): once per fit.
        num_classes: Number of classes (default: the largest label seen + 1).
        pad_token_id: Token id that is padding, for batches without an attention mask.
        extract: ``batch -> {"token_ids", "mask", "labels", "features"}`` (any subset) for batches of another shape.
        seed: Seed of the private generator that draws the sample.
        rules: Thresholds and settings by rule id, ``False`` to switch a rule off (docs/thresholds.md):
            ``{"data_leakage": {"threshold": 0.2, "shingle_size": 4}, "label_imbalance": False}``.
        on_alert: A callable receiving each :class:`~lightning_diag.core.alerts.Alert` as it is recorded (global
            rank zero, after it is written to ``alerts.jsonl``): send it to Slack, e-mail or a pager. A handler
            that raises is reported once per fit through the ``lightning_diag`` logger and never stops training.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range.

    Example:
        >>> DataDiagnostics().thresholds()["label_imbalance"]
        0.1
    """

    extra_state_keys = ("last_epoch", "last")
    preset = Preset(
        "DataDiagnostics",
        (
            Detector(DataRules, "data_rules", "rules"),
            Detector(SequenceRules, "sequence_rules", "sequences"),
            Detector(LoaderRules, "loader_rules", "loaders"),
        ),
    )
    # the detector whose latch ends the per-batch check once it reported (the others: fed, see `feed`)
    loader_rules: LoaderRules

    def __init__(
        self,
        *,
        max_batches: int | None = DEFAULT_MAX_BATCHES,
        every_n_epochs: int | None = None,
        num_classes: int | None = None,
        pad_token_id: int | None = None,
        extract: Callable[[Any], Mapping[str, Any] | None] | None = None,
        seed: int = 0,
        rules: RuleChoices | None = None,
        on_alert: AlertHandler | None = None,
    ) -> None:
        super().__init__(rules=rules, on_alert=on_alert)
        self.max_batches = None if max_batches is None else check_int("max_batches", max_batches, low=1)
        self.every_n_epochs = None if every_n_epochs is None else check_int("every_n_epochs", every_n_epochs, low=1)
        self.num_classes = None if num_classes is None else check_int("num_classes", num_classes, low=2)
        self.pad_token_id = None if pad_token_id is None else check_int("pad_token_id", pad_token_id, low=0)
        self.extract = check_callable("extract", extract, "a callable batch -> mapping")
        self.seed = check_int("seed", seed, low=0)
        # what the measurement needs of the rules' settings (``rules=``)
        self.leakage_shingle_size = int(self.setting(LEAKAGE_SHINGLE_SIZE_KEY))
        self.num_perm = int(self.setting(LEAKAGE_NUM_PERM_KEY))
        self.leakage_near_duplicate = self.setting(LEAKAGE_NEAR_DUPLICATE_KEY)
        self.min_leaks = int(self.setting(LEAKAGE_MIN_LEAKS_KEY))
        self.vocab_shift_min_count = int(self.setting(VOCAB_SHIFT_MIN_COUNT_KEY))
        self.add_preset()
        self.last_epoch = -1
        self.last: dict[str, float] = {}
        # the shape signature of the last training batch found consistent (``batch_size_mismatch``)
        self._checked_signature: Any = None

    def thresholds(self) -> dict[str, float]:
        """The thresholds in effect (see :meth:`DiagCallback.thresholds`); ``data.max_batches`` is left out when
        ``max_batches=None`` (every batch of a map-style dataset)."""
        values = super().thresholds()
        if self.max_batches is None:
            values.pop(DATA_MAX_BATCHES_SETTING.key, None)
        return values

    # -- state ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The rules' latches (what was already reported), the longest training sequence seen, the epoch last
        measured and its values."""
        return {**super().state_dict(), "last_epoch": self.last_epoch, "last": dict(self.last)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            KeyError: If a key is missing; the message names every missing key.
        """
        super().load_state_dict(state_dict)
        self.last_epoch = int(state_dict["last_epoch"])
        self.last = {str(k): float(v) for k, v in state_dict["last"].items()}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """A new fit starts with fresh rules (a resume then loads their state)."""
        super().setup(trainer, pl_module, stage)
        if stage == TrainerFn.FITTING:
            self.last_epoch = -1
            self.last = {}
            self._checked_signature = None

    # -- hooks ---------------------------------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Measure the data once the loaders exist, before the first step."""
        super().on_train_start(trainer, pl_module)
        self._measure(trainer)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Count the step (the base class), then ``batch_size_mismatch`` on the batch the trainer produced (shapes
        only: no host synchronisation), until a mismatch is reported."""
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        # a batch shaped like the last one checked needs no new check: comparing the signatures is the quiet step
        signature = shape_signature(batch)
        if signature is not None and signature == self._checked_signature:
            return
        if self.loader_rules.latch.is_active(f"{BATCH_SIZE_MISMATCH}:train"):  # reported already: once per fit
            return
        sizes = size_mismatch(batch)
        if sizes is None:
            self._checked_signature = signature
            return
        where = f" (training step {trainer.global_step})"
        sized = Measures(batch_sizes=BatchSizes(sizes, "train", where))
        self.record(self.feed(self.context(trainer), sized))

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """With ``every_n_epochs``: measure again at the start of every n-th epoch."""
        super().on_train_epoch_start(trainer, pl_module)
        epoch = trainer.current_epoch
        if self.every_n_epochs and epoch % self.every_n_epochs == 0 and epoch != self.last_epoch:
            self._measure(trainer)

    # -- measuring -----------------------------------------------------------------------------------------
    def _read(self, trainer: pl.Trainer, split: str, loaders: Any) -> SplitSample | None:
        loader, count = _first_loader(loaders)
        if loader is None:
            self.notice(trainer, f"no-{split}", f"no {split} loader: the {split} data is not examined")
            return None
        if count > 1:
            self.notice(trainer, f"many-{split}", f"{count} {split} loaders: only the first is examined")
        dataset = getattr(loader, "dataset", None)
        size = None
        try:
            if dataset is not None and not isinstance(dataset, torch.utils.data.IterableDataset):
                size = len(dataset)
        except TypeError:
            size = None
        sample = SplitSample(split, dataset_size=size)
        reading = read_sample(
            loader, self.max_batches, trainer.global_rank, trainer.world_size, self.seed, sample.advanced
        )
        try:
            with contextlib.closing(reading):  # the dataset's generators are put back even when a batch fails
                for batch, idx in reading:
                    if sample.mismatch is None:
                        sample.mismatch = size_mismatch(batch)
                        sample.mismatch_indices = [int(i) for i in idx[:5]]
                    view = interpret(batch, self.extract)
                    if view is not None:
                        sample.add(view, idx, self.pad_token_id, self.leakage_shingle_size, self.num_perm, self.seed)
        except UninterpretableBatch as err:
            self.notice(trainer, f"batch-{split}", f"the {split} data is not examined: {err}")
            return None
        except Exception as err:  # reading user data must never crash the run
            self.notice(trainer, f"read-{split}", f"the {split} data is not examined: {type(err).__name__}: {err}")
            return None
        return sample.seal()

    def _gather(self, trainer: pl.Trainer, mine: list[SplitSample | None]) -> list[SplitSample | None]:
        if trainer.world_size <= 1 or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return mine
        everyone: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, mine)
        merged: list[SplitSample | None] = []
        for i in range(len(mine)):
            parts = [rank[i] for rank in everyone if rank is not None and rank[i] is not None]
            merged.append(SplitSample.merge(parts) if parts else None)
        return merged

    def _measure(self, trainer: pl.Trainer) -> None:
        start = time.perf_counter()
        mine = [
            self._read(trainer, "train", trainer.train_dataloader),
            self._read(trainer, "val", trainer.val_dataloaders),
        ]
        self._judge_loaders(trainer, mine)
        train, val = self._gather(trainer, mine)
        self.last_epoch = trainer.current_epoch
        if train is None and val is None:
            return
        module = trainer.lightning_module
        capacity = position_capacity(module) if module is not None else None
        measured = measure(
            train, val, self.num_classes, self.leakage_near_duplicate, self.vocab_shift_min_count, self.min_leaks,
            capacity
        )
        seconds = time.perf_counter() - start
        step = trainer.global_step
        values = {data_tag(*k.split("/")): v for k, v in measured.scalars.items()}
        values[data_tag("seconds")] = seconds
        values.update(self.threshold_lines(DATA_VOCAB_SHIFT, DATA_LEAKAGE, LABEL_IMBALANCE))
        self.writer.scalars({k: v for k, v in values.items() if math.isfinite(v)}, step)
        self.last = {k: float(v) for k, v in measured.scalars.items()}
        if self.writer.active:
            self._draw(train, val, measured, step)
        m = Measures(data=measured.measurement, sequences=measured.sequences)
        self.record(self.feed(self.context(trainer), m))

    def _judge_loaders(self, trainer: pl.Trainer, mine: list[SplitSample | None]) -> None:
        """``batch_size_mismatch`` on the sampled batches, ``worker_rng_shared`` on the training loader."""
        ctx = self.context(trainer)
        for sample in mine:
            if sample is not None and sample.mismatch is not None:
                shown = ", ".join(str(i) for i in sample.mismatch_indices)
                where = f" (dataset indices {shown})" if shown else ""
                sized = Measures(batch_sizes=BatchSizes(sample.mismatch, sample.split, where))
                self.record(self.feed(ctx, sized))
        train = mine[0]
        loader, _ = _first_loader(trainer.train_dataloader)
        workers = int(getattr(loader, "num_workers", 0) or 0)
        if train is None or not train.advanced or workers <= 0:
            return
        init = _lightning_worker_init(getattr(loader, "worker_init_fn", None))
        if init is not None:
            streams = LoaderStreams(train.advanced, workers, init)
            self.record(self.feed(ctx, Measures(loader_streams=streams)))

    def _draw(self, train: SplitSample | None, val: SplitSample | None, measured: Measured, step: int) -> None:
        for s in (train, val):
            if s is None or not s.has_tokens:
                continue
            lens = s.array("seq_lens")
            if lens.size:
                self.writer.histogram(data_tag(s.split, "seq_len"), lens, step)
            counts = s.token_counts
            if counts.sum() > 0:
                scale = max(1, math.ceil(counts.sum() / _MAX_HIST_VALUES))
                ids = np.repeat(np.arange(len(counts)), counts // scale if scale > 1 else counts)
                if ids.size:
                    self.writer.histogram(data_tag(s.split, "token_ids"), ids, step)
        label_counts = measured.label_counts
        if label_counts:
            width = min(max(len(c) for c in label_counts.values()), _MAX_IMAGE_CLASSES)
            rows = np.full((len(_SPLITS), width), np.nan)
            for r, split in enumerate(_SPLITS):
                c = label_counts.get(split)
                if c is not None and c.sum() > 0:
                    rows[r, : min(len(c), width)] = (c / c.sum())[:width]
            cell = max(2, min(24, 512 // width))
            self.writer.image(data_tag("label_distribution"), heatmap(rows, cell, 0.0), step)
        self.writer.text(data_tag("summary"), _summary(measured), step)


def _lightning_worker_init(fn: Any) -> str | None:
    """``""`` for no ``worker_init_fn``, a name for Lightning's (it reseeds the global generators only), ``None``
    for the user's own (trusted to reseed what the dataset holds)."""
    if fn is None:
        return ""
    while isinstance(fn, functools.partial):
        fn = fn.func
    name = getattr(fn, "__name__", "")
    return name if name == "pl_worker_init_function" else None


def _summary(measured: Measured) -> str:
    """The measurement as markdown: values, class table, leak examples, broken inputs."""
    m = measured.measurement
    lines = ["| measure | value |", "|---|---|"]
    lines += [f"| {k} | {v:.4g} |" for k, v in sorted(measured.scalars.items())]
    counts = measured.label_counts
    if counts:
        lines += [
            "",
            "| class | " + " | ".join(f"{s} count | {s} share" for s in counts) + " |",
            "|---|" + "---|---|" * len(counts),
        ]
        width = max(len(c) for c in counts.values())
        for k in range(min(width, 50)):
            cells = []
            for c in counts.values():
                n = int(c[k]) if k < len(c) else 0
                cells.append(f"{n} | {n / max(int(c.sum()), 1):.1%}")
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
        if width > 50:
            lines.append(f"| ... {width - 50} more classes | |")
    if m.leak_examples:
        lines += [
            "",
            "Leaked validation samples (dataset index ~ training index, similarity): "
            + ", ".join(f"{v} ~ {t} ({s:.2f})" for v, t, s in m.leak_examples),
        ]
    for p in m.problems:
        lines += ["", f"{p.kind} in `{p.split}:{p.key}`: {p.count} (examples {list(p.examples)})"]
    return "\n".join(lines)
