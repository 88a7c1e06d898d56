"""A tiny synthetic sequence-classification task shipped with the package (generated, deterministic).

Each example is ``[CLS] t_1 ... t_n [SEP] PAD ...`` with ``n`` between ``min_len`` and ``max_len``. Four
*marker* tokens are scattered among filler tokens; the label is the marker that occurs most often. Solving it
needs attention over the whole sequence, so heads learn real patterns, and padding exercises masks.
"""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["CLS", "NUM_CLASSES", "PAD", "SEP", "VOCAB_SIZE", "SyntheticDataModule", "make_dataset"]

PAD, CLS, SEP = 0, 1, 2
MARKERS = (3, 4, 5, 6)
NUM_CLASSES = len(MARKERS)
VOCAB_SIZE = 24


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
