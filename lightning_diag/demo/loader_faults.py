"""Loader faults of the fault library (issue 35): a collate_fn that drops input rows, workers sharing one stream.

Used by :class:`~lightning_diag.demo.synthetic.RegressionDataModule` (``one_row_inputs``, ``jitter``,
``num_workers``, ``reseed_workers``) for the ``batch_rows`` and ``worker_rng`` faults and their healthy twins, and by
:class:`~lightning_diag.demo.corpus_data.CorpusDataModule` for the same faults on real architectures.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate, get_worker_info

__all__ = ["JitteredInputs", "first_row_inputs", "loader", "reseed_jitter"]


class JitteredInputs(Dataset):
    """``(x + noise, y)``: a random augmentation drawn from a numpy generator the dataset holds (``self.rng``).

    Example:
        >>> data = JitteredInputs(TensorDataset(torch.zeros(4, 2), torch.zeros(4)), scale=0.1, seed=0)
        >>> x, y = data[0]
        >>> bool((x != 0).all())
        True
    """

    def __init__(self, data: TensorDataset, scale: float, seed: int) -> None:
        self.data, self.scale = data, scale
        self.rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data[i]
        noise = self.rng.normal(0.0, self.scale, tuple(x.shape)).astype(np.float32)
        return x + torch.from_numpy(noise), y


def reseed_jitter(worker_id: int) -> None:
    """A ``worker_init_fn`` that gives each worker's copy of :class:`JitteredInputs` its own stream."""
    info = get_worker_info()
    if info is not None and isinstance(info.dataset, JitteredInputs):
        info.dataset.rng = np.random.default_rng(info.seed)


def first_row_inputs(items: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """A broken ``collate_fn``: the inputs keep their first row only, the targets all of theirs."""
    x, y = default_collate(items)
    return x[:1], y


def loader(
    dataset: Dataset,
    batch_size: int,
    shuffle: bool,
    seed: int,
    num_workers: int = 0,
    reseed_workers: bool = False,
    one_row_inputs: bool = False,
    drop_last: bool = False,
) -> DataLoader:
    """The training loader of the regression task (and of the real-architecture corpus) with the loader switches
    of the fault library."""
    extra: dict[str, Any] = {}
    if num_workers:
        methods = multiprocessing.get_all_start_methods()
        extra = {
            "num_workers": num_workers,
            "persistent_workers": True,
            "multiprocessing_context": "fork" if "fork" in methods else None,
            "worker_init_fn": reseed_jitter if reseed_workers else None,
        }
    if one_row_inputs:
        extra["collate_fn"] = first_row_inputs
    g = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=g, drop_last=drop_last, **extra)
