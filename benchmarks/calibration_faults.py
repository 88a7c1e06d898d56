"""A realistic fault for every rule the fault matrices do not exercise (issue 44: "every fault caught, with its delay").

The detection matrices (:mod:`lightning_diag.demo.faults`, :mod:`lightning_diag.demo.corpus`) expect the rules they
were written for; the rules below had no fault there, so the calibration harness could not say whether, or how soon,
they catch anything. Each entry here is the fault as a user meets it, built from the scenario code the rule's tests
already use (imported from ``tests/``, as the harness imports ``tests/foreign/corpus.py``), with an onset, so the
harness measures the delay:

* the data rules (``DataDiagnostics``, judged once before the first step, onset step 0): a validation split that
  copies 30% of the training samples, 95/5 labels, missing values (NaN) in a feature column of a few batches, and
  a validation set from another vocabulary;
* the non-finite rules: a custom autograd function that returns NaN gradients from one step on while the loss stays
  finite, and a burst of huge batches that sends SGD to NaN under ``on_nonfinite="rollback"``;
* ``eval_before_training``: a GAN-style critic with a spectral norm validated (``trainer.validate``) before its
  first training step, to get a baseline;
* ``attn_sink``: the fault library's attention collapse, every head of a bidirectional encoder on [CLS];
* ``grad_layer_spread``: a deep sigmoid MLP, the gradient of its first hidden layers orders of magnitude below the
  last's;
* ``val_fluctuation``: BatchNorm ported from Keras with its momentum (0.99 there keeps the running mean, in PyTorch
  it replaces it by each batch's): the validation loss follows the last training batch's statistics;
* the probes: a minimum made sharp by rescaling a layer (Dinh et al. 2017: the same function) for
  ``sharp_minimum``, and one outlier weight that INT8 per-tensor quantization cannot hold for
  ``quantization_error``;
* ``SystemMonitor``: a dataset that sleeps in ``__getitem__`` (``dataloader_bound``), steps whose compute changes in
  blocks of 10 (``step_time_fluctuation``), and a loss kept with its graph every step (``memory_growth``).

Rules without a fault here, and why, are in :data:`NO_FAULT`. :func:`run_fault` is what the calibration harness
calls (kind ``"rulefault"``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_diag.demo.faults import FAULTS as LIBRARY

#: Rules with no fault in this module (nor in the matrices), and why.
NO_FAULT: dict[str, str] = {
    "ddp_desync": "needs two processes (replicas whose weights drift apart): the multi-process matrix's",
    "attn_entropy_high": "an `info` by design (diffuse attention is a legitimate solution): never a warning to catch",
}

#: ``(trainer settings, seed) -> the fitted trainer``, with the callbacks already in the settings.
Runner = Callable[[dict[str, Any], int], pl.Trainer]


@dataclasses.dataclass(frozen=True)
class RuleFault:
    """One fault.

    Attributes:
        name: Key in :data:`FAULTS`.
        description: What it is, as the user meets it.
        expected: Rules that must fire.
        run: Trains it (see :data:`Runner`).
        onset_step: Global step where the fault begins (step faults).
        onset_epoch: Epoch where the fault begins (epoch faults).
        callbacks: ``(class name, keyword arguments)`` of the callbacks it needs beyond the defaults; one of a
            default's class replaces the default.
    """

    name: str
    description: str
    expected: tuple[str, ...]
    run: Runner
    onset_step: int | None = None
    onset_epoch: int | None = None
    callbacks: tuple[tuple[str, dict[str, Any]], ...] = ()


def _fit(kwargs: dict[str, Any], seed: int, model: pl.LightningModule, *loaders: Any, **settings: Any) -> pl.Trainer:
    pl.seed_everything(seed, verbose=False)
    trainer = pl.Trainer(**{**kwargs, **settings})
    trainer.fit(model, *loaders)
    return trainer


# ------------------------------------------------------------------------------------------------ data


def _token_fit(kwargs: dict[str, Any], seed: int, xt: Any, yt: Any, xv: Any, yv: Any, **model: Any) -> pl.Trainer:
    from tests.callbacks.test_data_diagnostics import TokenModel, loaders

    return _fit(kwargs, seed, TokenModel(**model), *loaders(xt, yt, xv, yv), max_steps=20, max_epochs=-1)


def _leaked_split(kwargs: dict[str, Any], seed: int) -> pl.Trainer:
    from tests.callbacks.test_data_diagnostics import labels, tokens

    xt, yt, xv, yv = tokens(3000, seed + 1), labels(3000, seed + 1), tokens(600, seed + 2), labels(600, seed + 2)
    copied = torch.randperm(3000, generator=torch.Generator().manual_seed(seed))[:180]
    xv[:180], yv[:180] = xt[copied], yt[copied]  # 30% copies (a split made before deduplication)
    return _token_fit(kwargs, seed, xt, yt, xv, yv)


def _imbalanced(kwargs: dict[str, Any], seed: int) -> pl.Trainer:
    from tests.callbacks.test_data_diagnostics import labels, tokens

    weights = (95, 5, 0, 0)  # a rare-event task: 95% negatives
    xt, xv = tokens(3000, seed + 1), tokens(600, seed + 2)
    return _token_fit(kwargs, seed, xt, labels(3000, seed + 1, weights), xv, labels(600, seed + 2, weights))


def _missing_values(kwargs: dict[str, Any], seed: int) -> pl.Trainer:
    from tests.callbacks.test_data_diagnostics import labels

    g = torch.Generator().manual_seed(seed)
    xt, xv = torch.randn(2048, 5, generator=g), torch.randn(256, 5, generator=g)
    rows = torch.randperm(2048, generator=g)[:8]
    xt[rows, 2] = math.nan  # a sensor column with a few missing readings, read as NaN (the model nan_to_num's them)
    return _token_fit(kwargs, seed, xt, labels(2048, seed + 1), xv, labels(256, seed + 2), features=5)


def _vocab_shift(kwargs: dict[str, Any], seed: int) -> pl.Trainer:
    from tests.callbacks.test_data_diagnostics import VOCAB, labels, tokens

    xv = tokens(600, seed + 2, low=VOCAB // 2, high=VOCAB + 10)  # another domain: half the vocabulary, unseen ids
    return _token_fit(kwargs, seed, tokens(3000, seed + 1), labels(3000, seed + 1), xv, labels(600, seed + 2))


# ------------------------------------------------------------------------------------------------ non-finite

_NAN_GRAD_FROM = 20
_BURST = (40, 41, 42)


def _nan_gradients(kwargs: dict[str, Any], seed: int) -> pl.Trainer:
    from tests.callbacks.nonfinite_models import Regression

    steps = tuple(range(_NAN_GRAD_FROM, 10_000))  # a broken custom backward: NaN gradients, a finite loss
    return _fit(kwargs, seed, Regression(fault="backward", fault_steps=steps), max_steps=40, max_epochs=-1)


def _burst_rollback(kwargs: dict[str, Any], seed: int) -> pl.Trainer:
    from tests.callbacks.nonfinite_models import Regression

    return _fit(kwargs, seed, Regression(burst=_BURST), max_epochs=3)  # 3 x 32 steps


# ------------------------------------------------------------------------------------------------ runtime


class SpectralCritic(pl.LightningModule):
    """A GAN-style critic: ``Linear(8, 8)`` under ``spectral_norm`` (its power iteration converges during training
    forwards), ReLU, ``Linear(8, 1)``; regression, SGD."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.utils.spectral_norm(nn.Linear(8, 8))
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def critic_loader(seed: int = 0, n: int = 32) -> DataLoader:
    """``n`` random features regressed onto their first one, batches of 8."""
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    return DataLoader(TensorDataset(x, x[:, :1]), batch_size=8)


def _validate_first(kwargs: dict[str, Any], seed: int) -> pl.Trainer:
    model, loader = SpectralCritic(seed), critic_loader(seed, 256)
    pl.seed_everything(seed, verbose=False)
    # a baseline before training: the power iteration has never run
    pl.Trainer(**kwargs).validate(model, loader, verbose=False)
    seen = {id(cb): list(getattr(cb, "alerts", [])) for cb in kwargs["callbacks"]}
    trainer = _fit(kwargs, seed, model, loader, loader, max_epochs=1)
    for cb in kwargs["callbacks"]:  # a fit starts with no alerts: the record keeps the validation's in front
        if seen.get(id(cb)):
            cb.alerts = [*seen[id(cb)], *cb.alerts]
    return trainer


# ------------------------------------------------------------------------------------------------ models


def _library(name: str, **settings: Any) -> Runner:
    """Train the fault library's entry ``name`` (its model, data and trainer settings)."""

    def run(kwargs: dict[str, Any], seed: int) -> pl.Trainer:
        from lightning_diag.demo.faults import build_fault

        model, data, entry = build_fault(name, seed=seed)
        return _fit({**kwargs, "max_epochs": entry.max_epochs, **entry.trainer}, seed, model, data, **settings)

    return run


def _deep_sigmoid(kwargs: dict[str, Any], seed: int) -> pl.Trainer:
    from lightning_diag.demo.models import DemoConfig, build_model
    from lightning_diag.demo.synthetic import RegressionDataModule

    config = DemoConfig(model="mlp", d_model=64, head_depth=8, hidden_activation="sigmoid", optimizer="sgd",
                        lr=0.05, seed=seed)  # fmt: skip
    return _fit(kwargs, seed, build_model(config), RegressionDataModule(seed=seed), max_steps=60, max_epochs=-1)


def _keras_batchnorm(kwargs: dict[str, Any], seed: int) -> pl.Trainer:
    from tests.callbacks.probe_models import ReluNet, dataset

    model = ReluNet(lr=3e-3, batchnorm=True, seed=seed)
    norm = model.net[1]
    assert isinstance(norm, nn.BatchNorm1d)
    norm.momentum = 0.99  # Keras' momentum=0.99 keeps 99% of the running mean; PyTorch's takes 99% of the batch
    train = DataLoader(dataset(512, seed), batch_size=8, shuffle=True)
    return _fit(kwargs, seed, model, train, DataLoader(dataset(256, seed + 1), batch_size=256), max_epochs=8)


def _sharp(kwargs: dict[str, Any], seed: int) -> pl.Trainer:
    from tests.callbacks.probe_models import pretrained, reparametrise

    model = reparametrise(pretrained(seed=seed))  # first layer x100, second /100: the same function, far sharper
    model.lr = 1e-6  # fine-tuned gently from the exported checkpoint: it stays at that minimum
    return _fit(kwargs, seed, model, max_epochs=4)


def _outlier_weight(kwargs: dict[str, Any], seed: int) -> pl.Trainer:
    from tests.callbacks.probe_models import pretrained, with_outlier

    model = with_outlier(pretrained(seed=seed))  # one weight 200x its layer's largest
    model.lr = 1e-6
    return _fit(kwargs, seed, model, max_epochs=2)


# ------------------------------------------------------------------------------------------------ system


def _sleepy_loader(kwargs: dict[str, Any], seed: int) -> pl.Trainer:
    from tests.callbacks.system_models import MLP

    model = MLP(sleep_s=0.005, batch=4)  # every sample read sleeps 5 ms (a slow disk or decoder, no workers)
    return _fit(kwargs, seed, model, max_steps=40, max_epochs=-1, limit_val_batches=0)


def _compute_blocks(kwargs: dict[str, Any], seed: int) -> pl.Trainer:
    from tests.callbacks.system_models import MLP, BusyBlocks

    kwargs = {**kwargs, "callbacks": [*kwargs["callbacks"], BusyBlocks(seed=seed)]}  # 0-40 ms, per block of 10
    # 160 steps: the rule counts a check toward its patience only a block (10 steps) after the last, so its
    # earliest alert is at step 90-100 after the 20 warm-up steps; a shorter run would cut its delay short
    return _fit(kwargs, seed, MLP(), max_steps=160, max_epochs=-1, limit_val_batches=0)


def _kept_graphs(kwargs: dict[str, Any], seed: int) -> pl.Trainer:
    from tests.callbacks.system_models import MLP, leak_batch

    model = MLP(features=64, hidden=256, batch=leak_batch(), leak=True, samples=16384)  # ~1.2% of the RSS a step
    trainer = _fit(kwargs, seed, model, max_steps=50, max_epochs=-1, limit_val_batches=0)
    model.kept.clear()
    return trainer


_DATA: tuple[tuple[str, dict[str, Any]], ...] = (("DataDiagnostics", {}),)
_SYSTEM: tuple[tuple[str, dict[str, Any]], ...] = (("SystemMonitor", {}),)
_ROLLBACK: tuple[tuple[str, dict[str, Any]], ...] = (("AnomalyAlarm", {"on_nonfinite": "rollback"}),)

FAULTS: dict[str, RuleFault] = {
    f.name: f
    for f in (
        RuleFault(
            "leaked_split",
            "30% of the validation samples are copies of training samples",
            ("data_leakage",),
            _leaked_split,
            onset_step=0,
            callbacks=_DATA,
        ),
        RuleFault(
            "imbalanced_labels",
            "95/5 labels (a rare-event task)",
            ("label_imbalance",),
            _imbalanced,
            onset_step=0,
            callbacks=_DATA,
        ),
        RuleFault(
            "missing_values",
            "NaN readings in a feature column of 8 training rows",
            ("data_nonfinite",),
            _missing_values,
            onset_step=0,
            callbacks=_DATA,
        ),
        RuleFault(
            "vocab_shift",
            "a validation set from another domain: half the vocabulary and unseen ids",
            ("data_vocab_shift",),
            _vocab_shift,
            onset_step=0,
            callbacks=_DATA,
        ),
        RuleFault(
            "nan_gradients",
            f"a custom backward returns NaN gradients from step {_NAN_GRAD_FROM}, the loss stays finite",
            ("nonfinite_grad",),
            _nan_gradients,
            onset_step=_NAN_GRAD_FROM,
        ),
        RuleFault(
            "burst_rollback",
            f"huge batches at steps {_BURST} send plain SGD to NaN; `on_nonfinite='rollback'` restores a snapshot",
            ("nonfinite_rollback",),
            _burst_rollback,
            onset_step=_BURST[0],
            callbacks=_ROLLBACK,
        ),
        RuleFault(
            "validate_before_fit",
            "a spectral-norm critic validated before its first training step",
            ("eval_before_training",),
            _validate_first,
            onset_step=0,
        ),
        RuleFault(
            "cls_sink",
            "every head of a bidirectional encoder puts its attention on [CLS] (the fault library's `attention`)",
            ("attn_sink",),
            _library("attention"),
            onset_step=LIBRARY["attention"].onset_step,
        ),
        RuleFault(
            "deep_sigmoid",
            "a regression MLP of 8 sigmoid layers: the first layers' gradients vanish relative to the last's",
            ("grad_layer_spread",),
            _deep_sigmoid,
            onset_step=0,
        ),
        RuleFault(
            "keras_batchnorm",
            "BatchNorm with Keras' momentum (0.99) and batches of 8: validation uses the last batch's statistics",
            ("val_fluctuation",),
            _keras_batchnorm,
            onset_epoch=0,
        ),
        RuleFault(
            "rescaled_minimum",
            "a checkpoint whose first layer is x100 and second /100 (the same function, a far sharper minimum)",
            ("sharp_minimum",),
            _sharp,
            onset_epoch=0,
            callbacks=(("SharpnessProbe", {}),),
        ),
        RuleFault(
            "outlier_weight",
            "one weight 200x its layer's largest: per-tensor INT8 loses the layer",
            ("quantization_error",),
            _outlier_weight,
            onset_epoch=0,
            callbacks=(("QuantizationProbe", {}),),
        ),
        RuleFault(
            "sleepy_dataset",
            "the dataset sleeps 5 ms a sample (no workers)",
            ("dataloader_bound",),
            _sleepy_loader,
            onset_step=0,
            callbacks=_SYSTEM,
        ),
        RuleFault(
            "compute_blocks",
            "every 10 steps the step's compute changes (0 to 40 ms more)",
            ("step_time_fluctuation",),
            _compute_blocks,
            onset_step=0,
            callbacks=_SYSTEM,
        ),
        RuleFault(
            "kept_graphs",
            "a loss kept with its graph every step (`.item()` forgotten)",
            ("memory_growth",),
            _kept_graphs,
            onset_step=0,
            callbacks=_SYSTEM,
        ),
    )
}


def callbacks_for(name: str) -> list[Any]:
    """The default callbacks with the fault's own (one of a default's class replaces the default)."""
    import lightning_diag
    from lightning_diag.demo.run import default_callbacks

    own = [getattr(lightning_diag, cls)(**kwargs) for cls, kwargs in FAULTS[name].callbacks]
    kinds = {type(cb) for cb in own}
    return [*(cb for cb in default_callbacks() if type(cb) not in kinds), *own]


def run_fault(name: str, callbacks: list[Any], trainer_kwargs: dict[str, Any], seed: int) -> pl.Trainer:
    """Fit fault ``name`` with ``seed`` and ``callbacks``; ``trainer_kwargs`` are the harness's trainer settings."""
    return FAULTS[name].run({**trainer_kwargs, "callbacks": callbacks}, seed)


__all__ = ["FAULTS", "NO_FAULT", "RuleFault", "SpectralCritic", "callbacks_for", "critic_loader", "run_fault"]
