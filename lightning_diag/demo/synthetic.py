"""Tiny synthetic tasks shipped with the package (generated, deterministic).

* :class:`SyntheticDataModule`: sequence classification (transformer and GRU classifiers). Each example is
  ``[CLS] t_1 ... t_n [SEP] PAD ...`` with ``n`` between ``min_len`` and ``max_len``. Four *marker* tokens are
  scattered among filler tokens; the label is the marker that occurs most often. Solving it needs attention
  over the whole sequence, so heads learn real patterns, and padding exercises masks.
* :class:`RegressionDataModule`: regression of a smooth non-linear function of 8 features, with Gaussian noise
  on the targets (the MLP).
* :class:`CausalLMDataModule`: next-token prediction (the causal language model). Each sequence is
  ``[stride] x_0 x_1 ...`` with ``x_{t+1} = x_t + stride (mod LM_VOCAB_SIZE - 4)``; a fraction of the tokens
  is replaced by random ones, so the loss has a floor above zero.
"""

from __future__ import annotations

import functools
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_diag.demo import loader_faults

__all__ = [
    "CLS",
    "DATA_MODULES",
    "LM_VOCAB_SIZE",
    "NUM_CLASSES",
    "PAD",
    "REGRESSION_FEATURES",
    "SEP",
    "VOCAB_SIZE",
    "CausalLMDataModule",
    "RegressionDataModule",
    "SyntheticDataModule",
    "make_dataset",
    "make_lm_dataset",
    "make_regression_dataset",
]

PAD, CLS, SEP = 0, 1, 2
MARKERS = (3, 4, 5, 6)
NUM_CLASSES = len(MARKERS)
VOCAB_SIZE = 24
#: Features of the regression task.
REGRESSION_FEATURES = 8
#: Vocabulary of the language-modelling task: 4 stride tokens, then the sequence tokens.
LM_VOCAB_SIZE = 20
_LM_STRIDES = 4


def make_dataset(
    n: int,
    seed: int,
    min_len: int = 8,
    max_len: int = 14,
    random_labels: bool = False,
) -> TensorDataset:
    """``n`` examples as a ``TensorDataset(tokens [n, max_len+2], padding_mask [n, max_len+2], labels [n])``.

    ``padding_mask`` is ``True`` at padded positions (PyTorch's ``key_padding_mask`` convention).
    ``random_labels`` replaces the labels with random ones (a memorisation task).
    """
    g = torch.Generator().manual_seed(seed)
    width = max_len + 2
    tokens = torch.full((n, width), PAD, dtype=torch.long)
    labels = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g)
    first_filler = max(MARKERS) + 1
    for i in range(n):
        length = int(lengths[i])
        body = torch.randint(first_filler, VOCAB_SIZE, (length,), generator=g)
        winner = int(labels[i])
        counts = torch.randint(0, 2, (NUM_CLASSES,), generator=g)
        counts[winner] = 2 + int(torch.randint(0, 2, (), generator=g))
        pos = torch.randperm(length, generator=g)
        k = 0
        for m, c in enumerate(counts.tolist()):
            for _ in range(c):
                if k < length:
                    body[pos[k]] = MARKERS[m]
                    k += 1
        tokens[i, 0] = CLS
        tokens[i, 1 : 1 + length] = body
        tokens[i, 1 + length] = SEP
    mask = tokens == PAD
    if random_labels:
        labels = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    return TensorDataset(tokens, mask, labels)


class SyntheticDataModule(pl.LightningDataModule):
    """Train/validation loaders over :func:`make_dataset`.

    Args:
        n_train: Training examples.
        n_val: Validation examples.
        batch_size: Batch size of both loaders.
        seed: Seed of the generator (validation uses ``seed + 1``).
        random_labels: Train on random labels (memorisation; validation keeps the true ones).
        shuffle_targets: Permute the training labels against their inputs (a label/target bug).
        shuffle: Shuffle the training loader (``False`` gives the same batches every epoch).
    """

    def __init__(
        self,
        n_train: int = 512,
        n_val: int = 128,
        batch_size: int = 32,
        seed: int = 0,
        random_labels: bool = False,
        shuffle_targets: bool = False,
        shuffle: bool = True,
    ) -> None:
        super().__init__()
        self.n_train, self.n_val, self.batch_size, self.seed = n_train, n_val, batch_size, seed
        self.random_labels, self.shuffle_targets, self.shuffle = random_labels, shuffle_targets, shuffle

    def setup(self, stage: str | None = None) -> None:
        self.train_set = make_dataset(self.n_train, self.seed, random_labels=self.random_labels)
        if self.shuffle_targets:
            tokens, mask, labels = self.train_set.tensors
            perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.seed + 7))
            self.train_set = TensorDataset(tokens, mask, labels[perm])
        self.val_set = make_dataset(self.n_val, self.seed + 1)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=self.shuffle, generator=g)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()


class _TensorDataModule(pl.LightningDataModule):
    """Train/validation loaders over two generated ``TensorDataset``s."""

    def __init__(self, n_train: int, n_val: int, batch_size: int, seed: int, shuffle: bool) -> None:
        super().__init__()
        self.n_train, self.n_val, self.batch_size, self.seed, self.shuffle = n_train, n_val, batch_size, seed, shuffle

    def make(self, n: int, seed: int) -> TensorDataset:
        """``n`` examples generated from ``seed``."""
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        self.train_set = self.make(self.n_train, self.seed)
        self.val_set = self.make(self.n_val, self.seed + 1)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=self.shuffle, generator=g)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


def make_regression_dataset(n: int, seed: int, noise: float = 0.3) -> TensorDataset:
    """``n`` examples ``TensorDataset(x [n, 8], y [n])``: ``y = sin(x @ a) + 0.5 * (x @ b) + noise * N(0, 1)``.

    ``a`` and ``b`` are fixed (seed 1234) so training and validation sets share the function.
    """
    fixed = torch.Generator().manual_seed(1234)
    a = torch.randn(REGRESSION_FEATURES, generator=fixed) / REGRESSION_FEATURES**0.5
    b = torch.randn(REGRESSION_FEATURES, generator=fixed) / REGRESSION_FEATURES**0.5
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, REGRESSION_FEATURES, generator=g)
    y = torch.sin(2.0 * (x @ a)) + 0.5 * (x @ b) + noise * torch.randn(n, generator=g)
    return TensorDataset(x, y)


class RegressionDataModule(_TensorDataModule):
    """Noisy regression: :func:`make_regression_dataset`.

    Args:
        n_train: Training examples.
        n_val: Validation examples.
        batch_size: Batch size of both loaders.
        seed: Seed of the generator (validation uses ``seed + 1``).
        noise: Standard deviation of the target noise.
        shuffle: Shuffle the training loader.
        jitter: Standard deviation of a random augmentation of the training inputs drawn from a numpy generator
            the dataset holds (0: none; :mod:`lightning_diag.demo.loader_faults`).
        num_workers: Worker processes of the training loader.
        reseed_workers: A ``worker_init_fn`` reseeds the dataset's generator in each worker.
        one_row_inputs: A broken ``collate_fn`` keeps one row of the inputs and every target.
    """

    def __init__(
        self,
        n_train: int = 1024,
        n_val: int = 256,
        batch_size: int = 32,
        seed: int = 0,
        noise: float = 0.3,
        shuffle: bool = True,
        jitter: float = 0.0,
        num_workers: int = 0,
        reseed_workers: bool = False,
        one_row_inputs: bool = False,
    ) -> None:
        super().__init__(n_train, n_val, batch_size, seed, shuffle)
        self.noise = noise
        self.jitter, self.num_workers, self.reseed_workers = jitter, num_workers, reseed_workers
        self.one_row_inputs = one_row_inputs

    def make(self, n: int, seed: int) -> TensorDataset:
        return make_regression_dataset(n, seed, self.noise)

    def train_dataloader(self) -> DataLoader:
        data: Dataset = self.train_set
        if self.jitter:
            data = loader_faults.JitteredInputs(self.train_set, self.jitter, self.seed)
        return loader_faults.loader(
            data, self.batch_size, self.shuffle, self.seed, self.num_workers, self.reseed_workers,
            self.one_row_inputs,
        )


def make_lm_dataset(n: int, seed: int, length: int = 24, noise: float = 0.1) -> TensorDataset:
    """``n`` sequences ``TensorDataset(tokens [n, length + 1])`` for next-token prediction.

    Token 0..3 is the stride ``s`` (1..4); then ``x_0`` is random and ``x_{t+1} = x_t + s`` modulo the
    ``LM_VOCAB_SIZE - 4`` sequence tokens (ids 4 and up). A fraction ``noise`` of the sequence tokens is random.
    """
    g = torch.Generator().manual_seed(seed)
    span = LM_VOCAB_SIZE - _LM_STRIDES
    stride = torch.randint(0, _LM_STRIDES, (n, 1), generator=g)
    start = torch.randint(0, span, (n, 1), generator=g)
    body = (start + (stride + 1) * torch.arange(length)) % span
    random = torch.randint(0, span, body.shape, generator=g)
    body = torch.where(torch.rand(body.shape, generator=g) < noise, random, body)
    return TensorDataset(torch.cat([stride, body + _LM_STRIDES], dim=1))


def _pad_lm_batch(items: list[torch.Tensor], mask_padding_labels: bool) -> dict[str, torch.Tensor]:
    """Right-pad sequences of several lengths into a Hugging Face style batch; ``labels`` are the input ids
    (the model shifts them), with the padding set to -100 when ``mask_padding_labels``."""
    width = max(len(x) for x in items)
    ids = torch.zeros(len(items), width, dtype=torch.long)
    mask = torch.zeros(len(items), width, dtype=torch.long)
    for i, x in enumerate(items):
        ids[i, : len(x)] = x
        mask[i, : len(x)] = 1
    labels = ids.clone()
    if mask_padding_labels:
        labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class _VariableLengthLM(torch.utils.data.Dataset):
    """The sequences of a :func:`make_lm_dataset` cut to random lengths (half to all of their tokens)."""

    def __init__(self, data: TensorDataset, seed: int) -> None:
        (self.seq,) = data.tensors
        full = self.seq.shape[1]
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(full // 2, full + 1, (len(self.seq),), generator=g)

    def __len__(self) -> int:
        return len(self.seq)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.seq[i, : int(self.lengths[i])]


class CausalLMDataModule(_TensorDataModule):
    """Next-token prediction: :func:`make_lm_dataset`.

    Args:
        n_train: Training sequences.
        n_val: Validation sequences.
        batch_size: Batch size of both loaders.
        seed: Seed of the generator (validation uses ``seed + 1``).
        length: Tokens after the stride token.
        noise: Fraction of random tokens.
        shuffle: Shuffle the training loader.
        padded: Sequences of random lengths, right-padded into Hugging Face style dict batches (``input_ids``,
            ``attention_mask``, ``labels``).
        mask_padding_labels: With ``padded``, set the labels of the padding to -100 (``False``: the fault
            ``loss_on_padding`` finds).
        val_length: Tokens after the stride token of the validation sequences (default: ``length``; longer: the
            fault ``position_overflow`` finds).
    """

    def __init__(
        self,
        n_train: int = 512,
        n_val: int = 128,
        batch_size: int = 32,
        seed: int = 0,
        length: int = 24,
        noise: float = 0.1,
        shuffle: bool = True,
        padded: bool = False,
        mask_padding_labels: bool = True,
        val_length: int | None = None,
    ) -> None:
        super().__init__(n_train, n_val, batch_size, seed, shuffle)
        self.length, self.noise = length, noise
        self.padded, self.mask_padding_labels, self.val_length = padded, mask_padding_labels, val_length

    def make(self, n: int, seed: int) -> TensorDataset:
        return make_lm_dataset(n, seed, self.length, self.noise)

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        if self.val_length is not None:
            self.val_set = make_lm_dataset(self.n_val, self.seed + 1, self.val_length, self.noise)
        if self.padded:
            self.train_set = _VariableLengthLM(self.train_set, self.seed)  # type: ignore[assignment]
            self.val_set = _VariableLengthLM(self.val_set, self.seed + 1)  # type: ignore[assignment]

    def _collate(self) -> Any:
        return functools.partial(_pad_lm_batch, mask_padding_labels=self.mask_padding_labels) if self.padded else None

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=self.shuffle, generator=g, collate_fn=self._collate()
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, collate_fn=self._collate())


#: Model shape name (:data:`~lightning_diag.demo.models.MODELS`) -> its data module.
DATA_MODULES: dict[str, type[pl.LightningDataModule]] = {
    "transformer": SyntheticDataModule,
    "gru": SyntheticDataModule,
    "mlp": RegressionDataModule,
    "causal_lm": CausalLMDataModule,
}
