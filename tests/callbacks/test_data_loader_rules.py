"""``batch_size_mismatch`` and ``worker_rng_shared`` (issue 35, classes 6 and 4), their faults and their oracles."""

from __future__ import annotations

import dataclasses
import random
import time

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate, get_worker_info

from lightning_diag import DataDiagnostics
from lightning_diag.callbacks.data_diagnostics.batch import shape_signature
from lightning_diag.demo import FAULTS, build_fault, run_demo
from lightning_diag.instrument.batches import size_mismatch

FAST = dict(
    accelerator="cpu",
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
    num_sanity_val_steps=0,
    logger=False,
)


# -- the batch-size check ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Batch:
    input_ids: torch.Tensor
    labels: torch.Tensor


def test_size_mismatch_reads_every_usual_batch_shape():
    ids1, ids16 = torch.zeros(1, 7, dtype=torch.long), torch.zeros(16, 7, dtype=torch.long)
    pixels, labels = torch.zeros(16, 3, 4, 4), torch.zeros(16, dtype=torch.long)
    assert size_mismatch({"input_ids": ids1, "pixel_values": pixels, "labels": labels}) == {
        "input_ids": 1,
        "pixel_values": 16,
        "labels": 16,
    }
    assert size_mismatch(((ids1, pixels), labels)) == {"[0][0]": 1, "[0][1]": 16, "[1]": 16}
    assert size_mismatch([ids1, labels]) == {"[0]": 1, "[1]": 16}
    assert size_mismatch(Batch(ids1, labels)) == {"input_ids": 1, "labels": 16}
    assert size_mismatch({"inner": {"input_ids": ids1}, "labels": labels}) == {"inner.input_ids": 1, "labels": 16}
    transformers = pytest.importorskip("transformers")
    encoding = transformers.BatchEncoding({"input_ids": ids1, "attention_mask": ids16})
    assert size_mismatch(encoding) == {"input_ids": 1, "attention_mask": 16}


def test_size_mismatch_stays_quiet_on_healthy_batches():
    ids, labels = torch.zeros(16, 7, dtype=torch.long), torch.zeros(16, dtype=torch.long)
    assert size_mismatch({"input_ids": ids, "labels": labels, "num_items_in_batch": torch.tensor(90)}) is None
    assert size_mismatch((ids, labels, torch.tensor(0.5))) is None  # a scalar is no batch tensor
    assert size_mismatch((torch.zeros(20, 16, dtype=torch.long), labels)) is None  # time-major [T, B] tokens
    assert size_mismatch(ids) is None and size_mismatch({"labels": labels}) is None
    # Qwen2-VL: pixel_values are the flattened patches of every image, with each image's grid
    qwen = {"input_ids": ids, "pixel_values": torch.zeros(1280, 1176), "image_grid_thw": torch.zeros(16, 3)}
    assert size_mismatch(qwen) is None
    packed = {"input_ids": torch.zeros(1, 300), "position_ids": torch.zeros(1, 300), "cu_seqlens": torch.zeros(9)}
    assert size_mismatch(packed) is None


class Captioned(Dataset):
    def __init__(self, n: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, 16, (n, 6), generator=g)
        self.pixels = torch.randn(n, 3, 4, 4, generator=g)
        self.labels = torch.randint(0, 4, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i], "pixel_values": self.pixels[i], "labels": self.labels[i]}


def one_prompt_collate(items):
    """The bug: the prompts are tokenized once for the batch (one row), images and labels are stacked."""
    batch = default_collate(items)
    batch["input_ids"] = batch["input_ids"][:1]
    return batch


class VisionLanguage(pl.LightningModule):
    def __init__(self, break_at_step: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.vision, self.head = nn.Embedding(16, 8), nn.Linear(48, 8), nn.Linear(8, 4)
        self.break_at_step = break_at_step

    def on_after_batch_transfer(self, batch, dataloader_idx):
        if self.trainer.training and self.break_at_step is not None and self.trainer.global_step >= self.break_at_step:
            batch = {**batch, "input_ids": batch["input_ids"][:1]}
        return batch

    def _loss(self, batch):
        h = self.embed(batch["input_ids"]).mean(1) + self.vision(batch["pixel_values"].flatten(1))  # broadcasts
        return nn.functional.cross_entropy(self.head(h), batch["labels"])

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        return self._loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit_captions(tmp_path, collate=None, model=None, max_steps=3) -> DataDiagnostics:
    cb = DataDiagnostics(max_batches=2)
    trainer = pl.Trainer(default_root_dir=tmp_path, callbacks=[cb], max_steps=max_steps, limit_val_batches=1, **FAST)
    train = DataLoader(Captioned(), batch_size=16, shuffle=True, collate_fn=collate)
    trainer.fit(model or VisionLanguage(), train, DataLoader(Captioned(32, 1), batch_size=16, collate_fn=collate))
    return cb


def test_one_row_of_prompts_beside_sixteen_images_is_flagged_once_per_split(tmp_path):
    cb = fit_captions(tmp_path, collate=one_prompt_collate)
    hits = [a for a in cb.alerts if a.rule == "batch_size_mismatch"]
    assert sorted(a.source for a in hits) == ["train", "val"], [a.format() for a in cb.alerts]
    assert all(a.severity == "warning" and a.global_step == 0 for a in hits)
    assert "`pixel_values`, `labels` have 16 rows; `input_ids` has 1 row" in hits[0].message
    assert [a for a in cb.alerts if a.severity != "info" and a.rule != "batch_size_mismatch"] == []


def test_healthy_multimodal_batches_raise_nothing(tmp_path):
    cb = fit_captions(tmp_path)
    assert [a.format() for a in cb.alerts if a.severity != "info"] == []


def test_a_batch_broken_after_the_loader_is_caught_on_the_trainer_batch(tmp_path):
    cb = fit_captions(tmp_path, model=VisionLanguage(break_at_step=2), max_steps=5)
    hits = [a for a in cb.alerts if a.rule == "batch_size_mismatch"]
    assert [(a.source, a.global_step) for a in hits] == [("train", 2)]
    assert "(training step 2)" in hits[0].message


def test_batches_shaped_like_the_last_checked_one_are_not_checked_again(tmp_path, monkeypatch):
    # the quiet step compares a shape signature; the full check runs on the first batch and on a batch whose
    # structure or shapes changed (the break at step 4 is still caught at step 4)
    import lightning_diag.callbacks.data_diagnostics.diagnostics as module

    checked = []

    def counting(batch):
        checked.append(batch)
        return size_mismatch(batch)

    monkeypatch.setattr(module, "size_mismatch", counting)
    cb = fit_captions(tmp_path, model=VisionLanguage(break_at_step=4), max_steps=6)
    sampled = 4  # the sample's batches (max_batches=2, two splits) are checked at the start, always
    assert len(checked) - sampled == 2, len(checked)  # step 0 (first) and step 4 (changed); steps 1-3 skipped
    assert [(a.source, a.global_step) for a in cb.alerts if a.rule == "batch_size_mismatch"] == [("train", 4)]


def test_the_shape_signature_tells_structures_and_shapes_apart():
    ids, labels = torch.zeros(16, 8, dtype=torch.long), torch.zeros(16)
    same = shape_signature({"input_ids": ids, "labels": labels})
    assert same == shape_signature({"input_ids": ids.clone(), "labels": labels.clone()})
    assert same != shape_signature({"input_ids": ids[:1], "labels": labels})  # a shape changed
    assert same != shape_signature({"labels": labels, "input_ids": ids})  # keys reordered: check again
    assert same != shape_signature({"input_ids": ids, "labels": labels, "extra": ids})  # a tensor added
    assert shape_signature(((ids, ids), labels)) == ((ids.shape, ids.shape), labels.shape)
    assert shape_signature([ids, "caption", None]) == (ids.shape, str, type(None))
    assert shape_signature(Batch(ids, labels)) is None  # a dataclass: not compared, checked every time
    assert shape_signature({"a": {"b": {"c": {"d": {"e": {"f": ids}}}}}}) is None  # deeper than 4


def test_the_per_step_check_costs_microseconds():
    batch = {
        "input_ids": torch.zeros(16, 128, dtype=torch.long),
        "attention_mask": torch.ones(16, 128),
        "pixel_values": torch.zeros(16, 3, 32, 32),
        "labels": torch.zeros(16, dtype=torch.long),
    }
    size_mismatch(batch)
    start = time.perf_counter()
    for _ in range(2000):
        size_mismatch(batch)
    per_call = (time.perf_counter() - start) / 2000
    assert per_call < 200e-6, per_call  # measured ~10 us on the shared 2-core machine


# -- workers sharing one stream ----------------------------------------------------------------------------
class Jittered(Dataset):
    """Features with a random jitter drawn from a generator the dataset holds (``kind``)."""

    def __init__(self, kind: str, used: bool = True) -> None:
        self.x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
        self.y = torch.randint(0, 2, (64,), generator=torch.Generator().manual_seed(1))
        self.kind, self.used = kind, used
        self.rng = {
            "numpy": lambda: np.random.default_rng(0),
            "legacy": lambda: np.random.RandomState(0),
            "torch": lambda: torch.Generator().manual_seed(0),
            "random": lambda: random.Random(0),
            "global": lambda: np.random.mtrand._rand,  # numpy's global state: torch reseeds it per worker
        }[kind]()

    def __len__(self) -> int:
        return 64

    def _noise(self) -> float:
        if not self.used:
            return 0.0
        if self.kind == "torch":
            return float(torch.rand((), generator=self.rng))
        if self.kind == "random":
            return self.rng.random()
        return float(self.rng.random_sample() if self.kind in ("legacy", "global") else self.rng.random())

    def __getitem__(self, i: int):
        return self.x[i] + self._noise(), self.y[i]


class ReseededPerItem(Dataset):
    """Deterministic augmentation: the generator is reseeded from the index before each draw (no shared stream)."""

    def __init__(self) -> None:
        self.x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
        self.y = torch.randint(0, 2, (64,), generator=torch.Generator().manual_seed(1))
        self.g = torch.Generator()

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        self.g.manual_seed(1000 + i)
        return self.x[i] + torch.rand((), generator=self.g), self.y[i]


def reseed(worker_id: int) -> None:
    info = get_worker_info()
    info.dataset.rng = np.random.default_rng(info.seed)


class Tabular(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit_workers(tmp_path, dataset, workers=2, init=None, seed_workers=False) -> DataDiagnostics:
    if seed_workers:
        pl.seed_everything(0, workers=True, verbose=False)
    cb = DataDiagnostics(max_batches=2)
    extra = {"num_workers": workers, "multiprocessing_context": "fork", "worker_init_fn": init} if workers else {}
    trainer = pl.Trainer(default_root_dir=tmp_path, callbacks=[cb], max_steps=2, limit_val_batches=0, **FAST)
    trainer.fit(Tabular(), DataLoader(dataset, batch_size=8, shuffle=True, **extra))
    return cb


def _shared(cb):
    return [a for a in cb.alerts if a.rule == "worker_rng_shared"]


@pytest.mark.parametrize("kind", ["numpy", "legacy", "torch", "random"])
def test_a_generator_the_dataset_holds_read_by_two_workers_is_flagged(tmp_path, kind):
    hits = _shared(fit_workers(tmp_path, Jittered(kind)))
    assert [(a.source, a.severity, a.global_step) for a in hits] == [("train", "warning", 0)]
    assert "`dataset.rng`" in hits[0].message and "2 workers" in hits[0].message


def test_lightning_worker_init_does_not_reseed_what_the_dataset_holds(tmp_path):
    hits = _shared(fit_workers(tmp_path, Jittered("numpy"), seed_workers=True))
    assert len(hits) == 1 and "pl_worker_init_function" in hits[0].message


@pytest.mark.parametrize(
    "case",
    ["reseeded", "in_process", "unused_generator", "global_generator", "reseeded_per_item"],
)
def test_shared_stream_healthy_twins_stay_quiet(tmp_path, case):
    dataset = Jittered("global" if case == "global_generator" else "numpy", used=case != "unused_generator")
    if case == "reseeded_per_item":
        dataset = ReseededPerItem()
    cb = fit_workers(
        tmp_path, dataset, workers=0 if case == "in_process" else 2, init=reseed if case == "reseeded" else None
    )
    assert [a.format() for a in cb.alerts if a.severity != "info"] == []


# -- the fault library's entries and their oracles -----------------------------------------------------------
def test_batch_rows_oracle_one_input_is_broadcast_against_every_target():
    model, data, _ = build_fault("batch_rows")
    data.setup("fit")
    x, y = next(iter(data.train_dataloader()))
    assert x.shape[0] == 1 and y.shape[0] == data.batch_size
    with torch.no_grad(), pytest.warns(UserWarning, match="target size"):
        loss = model.compute_loss((x, y))
    # the loss is the one prediction against every target: its gradient pulls the model to the targets' mean
    assert torch.allclose(loss, ((model(x).expand_as(y) - y) ** 2).mean())
    _, healthy, _ = build_fault("healthy_loader")
    healthy.setup("fit")
    hx, hy = next(iter(healthy.train_dataloader()))
    assert hx.shape[0] == hy.shape[0] == healthy.batch_size


def _worker_noise(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    _, data, _ = build_fault(name)
    data.shuffle = False  # batch k holds items k*B .. (k+1)*B - 1, from worker k % 2
    data.setup("fit")
    clean = data.train_set.tensors[0]
    b = data.batch_size
    batches = iter(data.train_dataloader())
    first, second = next(batches)[0], next(batches)[0]
    return first - clean[:b], second - clean[b : 2 * b]


def test_worker_rng_oracle_the_two_workers_draw_the_same_jitter():
    a, b = _worker_noise("worker_rng")
    assert torch.allclose(a, b, atol=1e-6) and a.abs().mean() > 0.05  # worker 1 repeats worker 0's jitter
    a, b = _worker_noise("healthy_loader")
    assert not torch.allclose(a, b, atol=1e-2)


@pytest.mark.parametrize("name", ["batch_rows", "worker_rng"])
def test_loader_faults_fire_at_onset(tmp_path, name):
    fault = FAULTS[name]
    result = run_demo(name, root=str(tmp_path))
    hits = [a for a in result.alerts if a.rule in fault.expected_rules]
    assert hits and hits[0].global_step == fault.onset_step, [a.format() for a in result.alerts]
    assert [a for a in result.alerts if a.severity != "info" and a.rule not in fault.expected_rules] == []


def test_healthy_loader_twin_raises_no_warning(tmp_path):
    result = run_demo("healthy_loader", root=str(tmp_path))
    assert [a.format() for a in result.alerts if a.severity != "info"] == []
