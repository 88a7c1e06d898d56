"""Synthetic tasks of the real-architecture corpus (generated, deterministic, shipped in the package).

* ``"classify"``: the sequence-classification task of :func:`~lightning_diag.demo.synthetic.make_dataset` (BERT,
  the LSTM, the frozen-backbone fine-tune), as ``(tokens, padding_mask, labels)``.
* ``"lm"``: next-token prediction of :func:`~lightning_diag.demo.synthetic.make_lm_dataset` (GPT-2, Llama).
* ``"seq2seq"``: reverse a sequence of tokens (BART: encoder, decoder, cross-attention), as
  ``(source, target)``.
* ``"image"``: 1x16x16 images with a bright 4x4 blob in one of four quadrants over Gaussian noise; the label is
  the quadrant (ViT, the BatchNorm CNN), as ``(pixels, labels)``.

Every task but ``"lm"`` can have its training targets permuted against the inputs (``shuffle_targets``).

Example:
    >>> pixels, labels = make_image_dataset(8, seed=0).tensors
    >>> tuple(pixels.shape), int(labels.max()) < IMAGE_CLASSES
    ((8, 1, 16, 16), True)
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_diag.demo.loader_faults import JitteredInputs, loader
from lightning_diag.demo.synthetic import make_dataset, make_lm_dataset

__all__ = [
    "IMAGE_CLASSES",
    "IMAGE_SIZE",
    "SEQ2SEQ_VOCAB",
    "CorpusDataModule",
    "make_image_dataset",
    "make_seq2seq_dataset",
]

IMAGE_SIZE = 16
IMAGE_CLASSES = 4
#: Seq2seq vocabulary: 0 pad, 1 start, 2 end, then the content tokens.
SEQ2SEQ_VOCAB = 20
_SEQ2SEQ_LEN = 8


def make_image_dataset(n: int, seed: int, noise: float = 0.5) -> TensorDataset:
    """``n`` images ``[n, 1, 16, 16]`` and their quadrant labels ``[n]``."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, IMAGE_CLASSES, (n,), generator=g)
    pixels = noise * torch.randn(n, 1, IMAGE_SIZE, IMAGE_SIZE, generator=g)
    half = IMAGE_SIZE // 2
    offsets = torch.randint(0, half - 4 + 1, (n, 2), generator=g)
    for i in range(n):
        q = int(labels[i])
        r0 = (q // 2) * half + int(offsets[i, 0])
        c0 = (q % 2) * half + int(offsets[i, 1])
        pixels[i, 0, r0 : r0 + 4, c0 : c0 + 4] += 1.5
    return TensorDataset(pixels, labels)


def make_seq2seq_dataset(n: int, seed: int, length: int = _SEQ2SEQ_LEN) -> TensorDataset:
    """``n`` pairs ``(source [n, length + 1], target [n, length + 1])``: the target is the source reversed.

    Both end with the end token 2.
    """
    g = torch.Generator().manual_seed(seed)
    body = torch.randint(3, SEQ2SEQ_VOCAB, (n, length), generator=g)
    end = torch.full((n, 1), 2, dtype=torch.long)
    return TensorDataset(torch.cat([body, end], 1), torch.cat([body.flip(1), end], 1))


def _make(task: str, n: int, seed: int) -> TensorDataset:
    if task == "classify":
        return make_dataset(n, seed)
    if task == "lm":
        return make_lm_dataset(n, seed, length=16, noise=0.05)
    if task == "seq2seq":
        return make_seq2seq_dataset(n, seed)
    if task == "image":
        return make_image_dataset(n, seed)
    raise ValueError(f"Expected argument `task` to be one of classify, lm, seq2seq, image, but got {task!r}")


class CorpusDataModule(pl.LightningDataModule):
    """Train/validation loaders over one corpus task.

    Args:
        task: ``"classify"``, ``"lm"``, ``"seq2seq"`` or ``"image"``.
        n_train: Training examples.
        n_val: Validation examples.
        batch_size: Batch size of both loaders.
        seed: Seed of the generator (validation uses ``seed + 1``).
        shuffle_targets: Permute the training targets against their inputs (labels, target sequences; the
            ``"lm"`` task has no separate targets and ignores it).
        jitter: Add Gaussian noise of this scale to the training inputs, drawn from a numpy generator the dataset
            holds (:class:`~lightning_diag.demo.loader_faults.JitteredInputs`; image task); 0: none.
        num_workers: Training-loader worker processes.
        reseed_workers: Give each worker's copy of that generator its own stream (a ``worker_init_fn``).
        one_row_inputs: A broken ``collate_fn`` keeps the first row of the inputs and every target.

    Raises:
        ValueError: If ``task`` is unknown.
    """

    def __init__(
        self,
        task: str,
        n_train: int = 1024,
        n_val: int = 128,
        batch_size: int = 16,
        seed: int = 0,
        shuffle_targets: bool = False,
        jitter: float = 0.0,
        num_workers: int = 0,
        reseed_workers: bool = False,
        one_row_inputs: bool = False,
    ) -> None:
        super().__init__()
        if task not in ("classify", "lm", "seq2seq", "image"):
            raise ValueError(f"Expected argument `task` to be one of classify, lm, seq2seq, image, but got {task!r}")
        self.task, self.n_train, self.n_val, self.batch_size = task, n_train, n_val, batch_size
        self.seed, self.shuffle_targets = seed, shuffle_targets
        self.jitter, self.num_workers, self.reseed_workers = jitter, num_workers, reseed_workers
        self.one_row_inputs = one_row_inputs

    def setup(self, stage: str | None = None) -> None:
        self.train_set = _make(self.task, self.n_train, self.seed)
        self.val_set = _make(self.task, self.n_val, self.seed + 1)
        if self.shuffle_targets and self.task != "lm":
            perm = torch.randperm(self.n_train, generator=torch.Generator().manual_seed(self.seed + 7))
            tensors = list(self.train_set.tensors)
            tensors[-1] = tensors[-1][perm]  # the labels (classify, image) or the target sequences (seq2seq)
            self.train_set = TensorDataset(*tensors)

    def train_dataloader(self) -> DataLoader:
        dataset: Any = self.train_set
        if self.jitter:
            dataset = JitteredInputs(self.train_set, self.jitter, self.seed + 11)
        return loader(
            dataset,
            self.batch_size,
            shuffle=True,
            seed=self.seed,
            num_workers=self.num_workers,
            reseed_workers=self.reseed_workers,
            one_row_inputs=self.one_row_inputs,
            drop_last=True,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)
