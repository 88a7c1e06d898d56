"""A diagnostic never changes the run: the weights are bitwise identical with and without each callback, also
when the dataset draws its augmentation from a generator it holds itself (issue 35)."""

from __future__ import annotations

import random
from unittest import mock

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_diag
from lightning_diag import DataDiagnostics
from lightning_diag.instrument.rng import HeldGenerators
from lightning_diag.output.writer import DiagWriter

FAST = dict(
    accelerator="cpu",
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
    logger=False,
)
N, FEATURES = 64, 6


class Noisy(Dataset):
    """Features plus noise drawn from a generator the dataset holds (``kind``), or from the global ones."""

    def __init__(self, kind: str, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(N, FEATURES, generator=g)
        self.y = torch.randint(0, 3, (N,), generator=g)
        self.kind = kind
        if kind == "numpy":
            self.rng = np.random.default_rng(seed)
        elif kind == "legacy":
            self.rng = np.random.RandomState(seed)
        elif kind == "torch":
            self.rng = torch.Generator().manual_seed(seed)
        elif kind == "random":
            self.transform = Jitter(random.Random(seed))  # one level down: found by walking the attributes

    def __len__(self) -> int:
        return N

    def _noise(self) -> float:
        if self.kind == "numpy":
            return float(self.rng.normal())
        if self.kind == "legacy":
            return float(self.rng.randn())
        if self.kind == "torch":
            return float(torch.randn((), generator=self.rng))
        if self.kind == "random":
            return self.transform()
        return float(torch.randn(())) + float(np.random.randn()) + random.random()  # the global generators

    def __getitem__(self, i: int):
        return self.x[i] + self._noise(), self.y[i]


class Jitter:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def __call__(self) -> float:
        return self.rng.gauss(0.0, 1.0)


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.Dropout(0.1), nn.ReLU(), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y))
        return logits  # ErrorAnalysis and RobustnessProbe read the predictions

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


KINDS = ["numpy", "legacy", "torch", "random", "global"]


def train(tmp_path, kind: str, callbacks: list, workers: int = 0) -> list[torch.Tensor]:
    pl.seed_everything(5, verbose=False)
    extra = {"num_workers": workers, "multiprocessing_context": "fork"} if workers else {}
    train_loader = DataLoader(Noisy(kind, 0), batch_size=8, shuffle=True, **extra)
    val_loader = DataLoader(Noisy(kind, 1), batch_size=8)
    model = Classifier()
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        callbacks=callbacks,
        max_steps=8,
        limit_val_batches=4,
        log_every_n_steps=2,
        val_check_interval=4,
        num_sanity_val_steps=1,
        **FAST,
    )
    trainer.fit(model, train_loader, val_loader)
    return [p.detach().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("kind", KINDS)
def test_data_diagnostics_leaves_dataset_generators_untouched(tmp_path, kind):
    reference = train(tmp_path, kind, [])
    cb = DataDiagnostics(max_batches=3)
    assert _same(reference, train(tmp_path, kind, [cb])), kind
    assert cb.last["train/samples"] == 24  # it did read the dataset


@pytest.mark.parametrize("kind", ["numpy", "legacy", "torch", "random"])
def test_data_diagnostics_leaves_dataset_generators_untouched_with_workers(tmp_path, kind):
    reference = train(tmp_path, kind, [], workers=2)
    assert _same(reference, train(tmp_path, kind, [DataDiagnostics(max_batches=3)], workers=2)), kind


def _jitter_features(batch, kind, rate, generator):
    x, y = batch
    return x + rate * torch.randn(x.shape, generator=generator), y


def _callbacks() -> dict[str, object]:
    return {
        "SystemMonitor": lambda: lightning_diag.SystemMonitor(),
        "AnomalyAlarm": lambda: lightning_diag.AnomalyAlarm(),
        "GradientFlowMonitor": lambda: lightning_diag.GradientFlowMonitor(),
        "ErrorAnalysis": lambda: lightning_diag.ErrorAnalysis(embed=lambda module, batch: batch[0]),
        "RobustnessProbe": lambda: lightning_diag.RobustnessProbe(perturb=_jitter_features),
        "SharpnessProbe": lambda: lightning_diag.SharpnessProbe(),
        "QuantizationProbe": lambda: lightning_diag.QuantizationProbe(),
    }


@pytest.mark.parametrize("name", sorted(_callbacks()))
@pytest.mark.parametrize("kind", ["numpy", "global"])
def test_every_other_callback_leaves_the_run_bitwise_identical(tmp_path, name, kind):
    reference = train(tmp_path, kind, [])
    logged: list[str] = []
    original = DiagWriter.scalars

    def spy(self, values, step):
        logged.extend(values)
        return original(self, values, step)

    with mock.patch.object(DiagWriter, "scalars", spy):
        weights = train(tmp_path, kind, [_callbacks()[name]()])
    assert _same(reference, weights), (name, kind)
    assert logged, f"{name} measured nothing: the comparison would prove nothing"


def test_held_generators_are_found_through_attributes_closures_and_containers():
    rng = np.random.default_rng(0)
    gen = torch.Generator()

    def transform(x):
        return x + rng.normal()

    class Pipeline:
        __slots__ = ("steps",)

        def __init__(self) -> None:
            self.steps = [transform, {"jitter": Jitter(random.Random(1))}]

    class Data:
        def __init__(self) -> None:
            self.pipeline = Pipeline()
            self.gen = gen
            self.global_state = np.random  # the module: not entered
            self.secure = random.SystemRandom()  # no state to copy

    found = HeldGenerators.capture(("dataset", Data())).generators
    expected = ["dataset.gen", "dataset.pipeline.steps[0].<rng>", "dataset.pipeline.steps[1]['jitter'].rng"]
    assert sorted(found) == expected


def test_restore_drops_a_generator_created_while_reading():
    class Lazy:
        def __init__(self) -> None:
            self.rng = None

        def __getitem__(self, i):
            if self.rng is None:
                self.rng = np.random.default_rng(i)
            return self.rng.random()

    data = Lazy()
    held = HeldGenerators.capture(("dataset", data))
    data[0]
    held.restore()
    assert data.rng is None  # a worker forked later creates its own, as without the read


def test_objects_that_refuse_to_be_read_are_left_out():
    class Hostile:
        def __getattribute__(self, name):
            if name == "__dict__":
                raise RuntimeError("no")
            return object.__getattribute__(self, name)

    class Data:
        def __init__(self) -> None:
            self.bad = Hostile()
            self.rng = random.Random(0)

    held = HeldGenerators.capture(("dataset", Data()))
    assert list(held.generators) == ["dataset.rng"]
    held.restore()
