"""What :class:`~lightning_diag.DataDiagnostics` keeps of one split's sample, and the measurement made from two.

:class:`SplitSample` accumulates batch views (token counts, sequence lengths, padding, labels, MinHash signatures,
whole-sample hashes, broken inputs) into a compact, picklable summary: under DDP every rank's summary is gathered
and :meth:`SplitSample.merge`\\ d, so every rank measures the same data and takes the same decisions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lightning_diag.callbacks.data_diagnostics.batch import BatchView
from lightning_diag.rules.records import DataMeasurement, InputProblem, SequenceMeasurement
from lightning_diag.stats import token_stats as ds

__all__ = ["Measured", "SplitSample", "measure"]

_EXAMPLES = 5
_MAX_TOKENS_PER_SAMPLE = 512  # leakage looks at the first this many tokens of a sample


@dataclasses.dataclass
class _Problem:
    count: int = 0
    examples: list[int] = dataclasses.field(default_factory=list)

    def add(self, indices: np.ndarray) -> None:
        self.count += len(indices)
        room = _EXAMPLES - len(self.examples)
        if room > 0:
            self.examples.extend(int(i) for i in indices[:room])


def _row_hashes(tensor: torch.Tensor) -> np.ndarray:
    """``[B]`` hash of each row's bytes (exact equality), whatever the dtype (bfloat16 is widened exactly)."""
    t = tensor.detach().cpu().contiguous()
    try:
        rows = t.numpy()
    except TypeError:  # a dtype numpy lacks (bfloat16, float8): float32 holds it exactly
        rows = t.float().numpy()
    return ds.bytes_hashes(rows)


@dataclasses.dataclass
class SplitSample:
    """The summary of one split's sample.

    Attributes:
        split: ``"train"`` or ``"val"``.
        dataset_size: ``len(dataset)`` when known, else ``None``.
        samples: Samples read.
        token_counts: Occurrences of each token id (non-padding).
        seq_lens: Non-padding tokens per sample.
        positions: Token positions read (padding included); ``pad`` of them padding.
        labels: Class labels read (1-D int).
        signatures: MinHash signatures (``[n, num_perm]`` uint64) of the samples with tokens.
        hashes: Whole-sample hashes, one per sample with tokens or input features.
        indices: Dataset indices of those samples.
        nonfinite, empty: Broken inputs by key.
        constant_ref, constant_varies: For 2-D floating features: the first sample and which features vary.
        extent: Positions the longest sample uses (its last non-padding token + 1).
        label_positions, padded_labels, padded: Token-level label positions (not -100) of batches with a padding
            mask, those that are padding, and the samples concerned (``loss_on_padding``).
        salts: Per sample with a hash: the hash of its non-text inputs (images...; 0 without), folded into its
            text hash and signature when whole samples are compared (``data_leakage``).
        context_keys: Keys of those non-text inputs.
        mismatch, mismatch_indices: The first sampled batch whose tensors disagree on the batch dimension
            (``{key: rows}``, ``batch_size_mismatch``) and a few of its dataset indices.
        advanced: Paths of the generators the dataset or its ``collate_fn`` hold that reading the sample drew
            from (put back since; ``worker_rng_shared``).
    """

    split: str
    dataset_size: int | None = None
    samples: int = 0
    token_counts: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    seq_lens: list[np.ndarray] = dataclasses.field(default_factory=list)
    positions: int = 0
    pad: int = 0
    labels: list[np.ndarray] = dataclasses.field(default_factory=list)
    signatures: list[np.ndarray] = dataclasses.field(default_factory=list)
    hashes: list[np.ndarray] = dataclasses.field(default_factory=list)
    salts: list[np.ndarray] = dataclasses.field(default_factory=list)
    indices: list[np.ndarray] = dataclasses.field(default_factory=list)
    valid: list[np.ndarray] = dataclasses.field(default_factory=list)
    nonfinite: dict[str, _Problem] = dataclasses.field(default_factory=dict)
    empty: dict[str, _Problem] = dataclasses.field(default_factory=dict)
    constant_ref: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    constant_varies: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    has_tokens: bool = False
    extent: int = 0
    label_positions: int = 0
    padded_labels: int = 0
    padded: _Problem = dataclasses.field(default_factory=_Problem)
    advanced: list[str] = dataclasses.field(default_factory=list)
    context_keys: set[str] = dataclasses.field(default_factory=set)
    mismatch: dict[str, int] | None = None
    mismatch_indices: list[int] = dataclasses.field(default_factory=list)

    def add(
        self,
        view: BatchView,
        indices: np.ndarray,
        pad_token_id: int | None,
        shingle_size: int,
        num_perm: int,
        seed: int,
    ) -> None:
        """Add one batch (its view and its samples' dataset indices)."""
        size = view.size
        idx = np.asarray(indices, np.int64)
        if len(idx) != size:  # a dataset item that is itself a batch: its rows share the item's index
            idx = np.repeat(idx[:1], size)
        self.samples += size
        for key, tensor in view.floats.items():
            self._check_floats(key, tensor, idx)
        if view.labels is not None:
            self.labels.append(view.labels.detach().cpu().numpy().astype(np.int64).reshape(-1))
        if view.tokens is not None:
            self._add_tokens(view, idx, pad_token_id, shingle_size, num_perm, seed)
        elif view.inputs is not None and view.inputs in view.floats:
            rows = view.floats[view.inputs].detach().cpu()
            if rows.dim() > 0 and rows.shape[0] == size:
                self.hashes.append(ds.bytes_hashes(rows.numpy()))
                self.salts.append(np.zeros(size, np.uint64))
                self.indices.append(idx)
                self.valid.append(np.ones(size, bool))

    def _add_tokens(
        self, view: BatchView, idx: np.ndarray, pad_token_id: int | None, shingle_size: int, num_perm: int, seed: int
    ) -> None:
        assert view.tokens is not None
        self.has_tokens = True
        tokens = view.tokens.detach().cpu().numpy().astype(np.int64)
        mask = view.mask.detach().cpu().numpy().astype(bool) if view.mask is not None else np.ones_like(tokens, bool)
        if pad_token_id is not None:
            mask &= tokens != pad_token_id
        mask &= tokens >= 0
        self.positions += tokens.size
        self.pad += int(tokens.size - mask.sum())
        real = tokens[mask]
        if real.size:
            counts = np.bincount(real)
            if len(counts) > len(self.token_counts):
                self.token_counts = np.pad(self.token_counts, (0, len(counts) - len(self.token_counts)))
            self.token_counts[: len(counts)] += counts
        lengths = mask.sum(axis=1)
        if mask.shape[1]:
            last = mask.shape[1] - np.argmax(mask[:, ::-1], axis=1)  # last real position + 1 per row
            self.extent = max(self.extent, int(np.where(mask.any(axis=1), last, 0).max(initial=0)))
        if view.token_labels is not None and (view.mask is not None or pad_token_id is not None):
            labels = view.token_labels.detach().cpu().numpy()
            labelled = labels != -100
            on_pad = labelled & ~mask
            self.label_positions += int(labelled.sum())
            self.padded_labels += int(on_pad.sum())
            rows = on_pad.any(axis=1)
            if rows.any():
                self.padded.add(idx[rows])
        self.seq_lens.append(lengths)
        if (lengths == 0).any():
            self.empty.setdefault("tokens", _Problem()).add(idx[lengths == 0])
        # left-align each row's real tokens (left padding, masks with holes), cut to the leakage window
        order = np.argsort(~mask, axis=1, kind="stable")
        packed = np.take_along_axis(tokens, order, axis=1)[:, :_MAX_TOKENS_PER_SAMPLE]
        lens = np.minimum(lengths, _MAX_TOKENS_PER_SAMPLE)
        self.signatures.append(ds.minhash(packed, lens, shingle_size, num_perm, seed))
        self.hashes.append(ds.sequence_hashes(packed, lens))
        if view.context:  # a multimodal sample is the same sample only when its image (...) is the same too
            self.salts.append(ds.combined_hashes([_row_hashes(t) for t in view.context.values()]))
            self.context_keys.update(view.context)
        else:
            self.salts.append(np.zeros(len(lens), np.uint64))
        self.indices.append(idx)
        self.valid.append(lens > 0)

    def _check_floats(self, key: str, tensor: torch.Tensor, idx: np.ndarray) -> None:
        t = tensor.detach()
        if t.dim() == 0 or t.shape[0] != len(idx):
            if not bool(torch.isfinite(t).all()):
                self.nonfinite.setdefault(key, _Problem()).add(idx[:1])
            return
        flat = t.reshape(t.shape[0], -1)
        bad = ~torch.isfinite(flat).all(dim=1)
        if bool(bad.any()):
            self.nonfinite.setdefault(key, _Problem()).add(idx[bad.cpu().numpy()])
        # masks (float attention masks) are constant by design when nothing is padded
        if t.dim() == 2 and not t.is_complex() and "mask" not in key.lower():
            rows = flat.cpu().double().numpy()
            ref = self.constant_ref.setdefault(key, rows[0].copy())
            if ref.shape != rows.shape[1:]:
                return
            varies = (rows != ref[None, :]).any(axis=0) & np.isfinite(rows).all(axis=0)
            prev = self.constant_varies.get(key)
            self.constant_varies[key] = varies if prev is None else (prev | varies)

    # -- summary -----------------------------------------------------------------------------------------
    def seal(self) -> SplitSample:
        """Concatenate the per-batch arrays (once, after the last batch)."""
        for name in ("seq_lens", "labels", "hashes", "salts", "indices", "valid"):
            parts = getattr(self, name)
            if len(parts) > 1:
                setattr(self, name, [np.concatenate(parts)])
        if len(self.signatures) > 1:
            self.signatures = [np.concatenate(self.signatures)]
        return self

    def array(self, name: str, dtype: Any = np.int64) -> np.ndarray:
        """One of the concatenated per-sample arrays (empty if none)."""
        parts = getattr(self, name)
        return np.concatenate(parts) if parts else np.zeros(0, dtype)

    @staticmethod
    def merge(parts: Sequence[SplitSample]) -> SplitSample:
        """The union of several ranks' samples of one split (in rank order: the result is the same everywhere)."""
        out = SplitSample(parts[0].split, dataset_size=parts[0].dataset_size)
        for p in parts:
            out.samples += p.samples
            out.positions += p.positions
            out.pad += p.pad
            out.has_tokens |= p.has_tokens
            out.context_keys |= p.context_keys
            out.extent = max(out.extent, p.extent)
            out.label_positions += p.label_positions
            out.padded_labels += p.padded_labels
            out.padded.count += p.padded.count
            out.padded.examples = (out.padded.examples + p.padded.examples)[:_EXAMPLES]
            a, b = ds.aligned(out.token_counts, p.token_counts)
            out.token_counts = (a + b).astype(np.int64)
            for name in ("seq_lens", "labels", "signatures", "hashes", "salts", "indices", "valid"):
                getattr(out, name).extend(getattr(p, name))
            for mine, theirs in ((out.nonfinite, p.nonfinite), (out.empty, p.empty)):
                for key, prob in theirs.items():
                    got = mine.setdefault(key, _Problem())
                    got.count += prob.count
                    got.examples = (got.examples + prob.examples)[:_EXAMPLES]
            for key, varies in p.constant_varies.items():
                ref = out.constant_ref.setdefault(key, p.constant_ref[key])
                if ref.shape != p.constant_ref[key].shape:
                    continue
                differs = varies | (p.constant_ref[key] != ref)
                out.constant_varies[key] = differs | out.constant_varies.get(key, np.zeros_like(differs))
        return out.seal()

    def label_counts(self, num_classes: int | None) -> np.ndarray:
        """Samples per class ``0 .. C - 1`` (``C`` from ``num_classes`` or the largest label seen)."""
        labels = self.array("labels")
        labels = labels[labels >= 0]  # -100 and other negative "ignore" labels are not classes
        if labels.size == 0:
            return np.zeros(0, np.int64)
        return np.bincount(labels, minlength=num_classes or 0)

    def problems(self) -> list[InputProblem]:
        """Broken inputs: non-finite tensors, empty sequences, constant features."""
        out = [InputProblem(self.split, k, "nonfinite", p.count, tuple(p.examples)) for k, p in self.nonfinite.items()]
        out += [InputProblem(self.split, k, "empty", p.count, tuple(p.examples)) for k, p in self.empty.items()]
        if self.samples > 1:
            for key, varies in self.constant_varies.items():
                constant = np.flatnonzero(~varies)
                if constant.size:
                    out.append(
                        InputProblem(
                            self.split, key, "constant", int(constant.size), tuple(int(i) for i in constant[:_EXAMPLES])
                        )
                    )
        return out


@dataclasses.dataclass
class Measured:
    """A measurement and the extra values that are logged but judged by no rule."""

    measurement: DataMeasurement
    scalars: dict[str, float]
    label_counts: dict[str, np.ndarray]
    sequences: SequenceMeasurement = dataclasses.field(default_factory=SequenceMeasurement)


def measure(
    train: SplitSample | None,
    val: SplitSample | None,
    num_classes: int | None,
    near_duplicate: float,
    min_count: int,
    min_leaks: int,
    capacity: tuple[int, str] | None = None,
) -> Measured:
    """The measurement of the sampled splits (either may be missing); ``capacity`` is the model's position
    capacity and where it comes from (``position_overflow``)."""
    m = DataMeasurement()
    scalars: dict[str, float] = {}
    label_counts: dict[str, np.ndarray] = {}
    for s in (train, val):
        if s is None:
            continue
        scalars[f"{s.split}/samples"] = float(s.samples)
        if s.has_tokens:
            lens = s.array("seq_lens")
            scalars[f"{s.split}/padding_ratio"] = s.pad / s.positions if s.positions else math.nan
            scalars[f"{s.split}/mean_seq_len"] = float(lens.mean()) if lens.size else math.nan
            for k, v in ds.tail_summary(s.token_counts).items():
                scalars[f"{s.split}/{k}"] = v
        counts = s.label_counts(num_classes)
        if counts.size:
            label_counts[s.split] = counts
            std = ds.proportion_std(counts)
            m.label_std = {**m.label_std, s.split: std}
            scalars[f"{s.split}/label_std"] = std
            scalars[f"{s.split}/classes"] = float(np.count_nonzero(counts))
        scalars[f"{s.split}/nonfinite_samples"] = float(sum(p.count for p in s.nonfinite.values()))
    m.label_counts = {k: [int(x) for x in v] for k, v in label_counts.items()}
    if "train" in label_counts and "val" in label_counts:
        scalars["label_tv"] = ds.total_variation(label_counts["train"], label_counts["val"])
    m.problems = [*(train.problems() if train else []), *(val.problems() if val else [])]
    if train is not None and val is not None:
        if train.has_tokens and val.has_tokens:
            m.vocab_kl = ds.vocab_kl(val.token_counts, train.token_counts, min_count=min_count)
            m.oov_share = ds.oov_share(val.token_counts, train.token_counts)
            scalars["vocab_kl"] = m.vocab_kl
            scalars["oov_share"] = m.oov_share
            scalars["val_rare_share"] = ds.rare_share(val.token_counts, train.token_counts)
        _leakage(train, val, m, scalars, near_duplicate, min_leaks)
    extent = {s.split: s.extent for s in (train, val) if s is not None and s.has_tokens and s.extent}
    for split, n in extent.items():
        scalars[f"{split}/max_positions"] = float(n)
    if train is not None and train.label_positions:
        scalars["train/padding_label_share"] = train.padded_labels / train.label_positions
    sequences = SequenceMeasurement(
        label_positions=train.label_positions if train is not None else 0,
        padded_labels=train.padded_labels if train is not None else 0,
        padded_examples=tuple(train.padded.examples) if train is not None else (),
        extent=extent,
        capacity=capacity[0] if capacity else None,
        capacity_source=capacity[1] if capacity else "",
    )
    return Measured(m, scalars, label_counts, sequences)


def _leakage(
    train: SplitSample, val: SplitSample, m: DataMeasurement, scalars: dict[str, float], near: float, min_leaks: int
) -> None:
    t_hash, v_hash = train.array("hashes", np.uint64), val.array("hashes", np.uint64)
    if t_hash.size == 0 or v_hash.size == 0:
        return
    tokens = train.has_tokens and val.has_tokens
    t_sig = train.signatures[0] if tokens and train.signatures else np.zeros((0, 0), np.uint64)
    v_sig = val.signatures[0] if tokens and val.signatures else None
    whole = tokens and bool(train.context_keys | val.context_keys)
    t_salt, v_salt = train.array("salts", np.uint64), val.array("salts", np.uint64)

    def search(salted: bool) -> ds.LeakMatches:
        ts, vs, th, vh = t_sig, v_sig, t_hash, v_hash
        if salted:  # the whole sample: text and images together
            ts = ds.salted(ts, t_salt) if ts.size else ts
            vs = ds.salted(vs, v_salt) if vs is not None else None
            th, vh = ds.salted(th, t_salt), ds.salted(vh, v_salt)
        return ds.find_near_duplicates(
            ts, th, vs, vh, ref_valid=train.array("valid", bool), query_valid=val.array("valid", bool)
        )

    found = search(whole)
    leaked = found.exact | (found.similarity >= near)
    if whole:  # templated prompts over other images: the text alone repeats, the sample does not
        text = search(False)
        m.text_only_leaks = int(((text.exact | (text.similarity >= near)) & ~leaked).sum())
    n_val = int(val.array("valid", bool).sum())
    hits = int(leaked.sum())
    # A sampled training set holds a leaked sample's twin with probability (samples read / dataset size): the
    # share of validation samples with a twin in the whole training set is the share found divided by it.
    coverage = 1.0
    if train.dataset_size:
        coverage = min(1.0, train.samples / train.dataset_size)
    share = hits / n_val / coverage if n_val else math.nan
    if hits < min_leaks and coverage < 1.0:
        share = min(share, hits / n_val) if n_val else share  # too few hits to extrapolate from
    m.leaked_fraction = min(share, 1.0) if math.isfinite(share) else share
    if tokens:
        m.leak_parts = ("token ids", *sorted(train.context_keys | val.context_keys))
    else:
        m.leak_parts = ("input features",)
    m.leaked = hits
    m.val_samples = n_val
    v_idx, t_idx = val.array("indices"), train.array("indices")
    rows = np.flatnonzero(leaked)
    m.leak_examples = [
        (int(v_idx[r]), int(t_idx[found.match[r]]), float(found.similarity[r])) for r in rows[:_EXAMPLES]
    ]
    scalars["leaked_fraction"] = m.leaked_fraction
    scalars["exact_copies"] = float(found.exact.sum() / n_val) if n_val else math.nan
    scalars["near_copies"] = float((leaked & ~found.exact).sum() / n_val) if n_val else math.nan
    scalars["train_coverage"] = coverage
