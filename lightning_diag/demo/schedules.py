"""Healthy training recipes people use, as small runs: learning-rate schedules, curricula, progressive unfreezing,
batch-size ramps, other losses, heavy-tailed regression, one-batch epochs and SWA.

They are the calibration harness's long healthy runs (``benchmarks/calibration.py``, ``docs/calibration.md``):
every run converges (its last epoch's mean training loss is below its first's) and is healthy by construction, so
any warning a rule raises on one is a false alarm. Each runs the demo networks of
:mod:`lightning_diag.demo.models` (the tiny transformer classifier, the GRU, the MLP, the causal LM) on the shipped
synthetic tasks of :mod:`lightning_diag.demo.synthetic`, or on small data generated here:

======================  ==========================================================================================
scenario                what it does
======================  ==========================================================================================
``warm_restarts``       AdamW with ``CosineAnnealingWarmRestarts`` (restarts after 2, 4, 8 epochs)
``one_cycle``           ``OneCycleLR`` over the whole run
``step_decay``          SGD with momentum, the learning rate x0.3 every 3 epochs (``StepLR``)
``cyclic_lr``           ``CyclicLR`` (triangular, 40x between its bounds, a cycle every 4 epochs)
``warmup_cosine``       a linear warm-up then a cosine decay, per step (the causal LM)
``curriculum``          from epoch 4, the training set adds sequences twice as long (harder: more filler)
``unfreezing``          the head trains alone, the encoder's last layer joins at epoch 2, the rest at epoch 4
``batch_ramp``          the batch size doubles every epoch, 8 to 256
``label_smoothing``     cross-entropy with ``label_smoothing=0.1``
``contrastive``         an MLP encoder trained with InfoNCE (SimCLR's loss) on two noisy views of each input
``distillation``        a GRU student matching a rule-based teacher's soft labels (temperature 2) and the labels
``heavy_tailed``        MSE regression whose target noise is Student-t (3 degrees of freedom)
``one_batch_epochs``    300 epochs of one batch each (a fresh batch of a larger set every epoch)
``swa``                 Lightning's ``StochasticWeightAveraging`` over the last 40% of the epochs
======================  ==========================================================================================

Example:
    >>> {"warm_restarts", "one_cycle", "swa", "one_batch_epochs"} <= set(SCENARIOS)
    True
    >>> SCENARIOS["batch_ramp"].batch_sizes[:3]
    (8, 16, 32)
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import warnings
from collections.abc import Sequence
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_diag.core.alerts import Alert
from lightning_diag.demo.models import DemoConfig, build_model
from lightning_diag.demo.synthetic import MARKERS, make_dataset, make_lm_dataset, make_regression_dataset

__all__ = [
    "SCENARIOS",
    "Scenario",
    "ScenarioData",
    "ScenarioModule",
    "ScenarioResult",
    "build_scenario",
    "run_scenario",
]


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One healthy recipe.

    Attributes:
        name: The scenario's name.
        description: What it does, in a sentence.
        model: The demo network (``"transformer"``, ``"gru"``, ``"mlp"``, ``"causal_lm"``).
        max_epochs: Epochs of the run.
        n_train: Training examples.
        batch_sizes: The training batch size of each epoch (the last repeats); one value: constant.
        schedule: ``"constant"``, ``"warm_restarts"``, ``"one_cycle"``, ``"step_decay"``, ``"cyclic"`` or
            ``"warmup_cosine"``.
        optimizer: ``"adamw"`` or ``"sgd"`` (momentum 0.9).
        lr: The (peak) learning rate.
        loss: ``"task"`` (the network's own loss), ``"label_smoothing"``, ``"contrastive"``, ``"distillation"``.
        noise: ``"gaussian"`` or ``"student_t"`` target noise (the MLP's regression).
        curriculum_epoch: From this epoch on the training set adds harder examples (``None``: never).
        unfreeze: ``(epoch, parameter-name prefixes)`` pairs: frozen before that epoch, trained from it.
        swa: Attach ``StochasticWeightAveraging`` (from 60% of the epochs, at a tenth of ``lr``).
        val_every: Validate every this many epochs.
        limit_batches: Training batches per epoch (``limit_train_batches``; ``None``: the whole set): each epoch
            is then a fresh draw of that many shuffled batches, as with a streamed data set.
    """

    name: str
    description: str
    model: str
    max_epochs: int
    n_train: int = 512
    batch_sizes: tuple[int, ...] = (32,)
    schedule: str = "constant"
    optimizer: str = "adamw"
    lr: float = 3e-3
    loss: str = "task"
    noise: str = "gaussian"
    curriculum_epoch: int | None = None
    unfreeze: tuple[tuple[int, tuple[str, ...]], ...] = ()
    swa: bool = False
    val_every: int = 1
    limit_batches: int | None = None

    def steps_in_epoch(self, epoch: int) -> int:
        """Optimizer steps of ``epoch`` (the curriculum's added examples included)."""
        n = self.n_train * (2 if self.curriculum_epoch is not None and epoch >= self.curriculum_epoch else 1)
        steps = -(-n // self.batch_size(epoch))
        return steps if self.limit_batches is None else min(steps, self.limit_batches)

    def batch_size(self, epoch: int) -> int:
        """The training batch size of ``epoch``."""
        return self.batch_sizes[min(epoch, len(self.batch_sizes) - 1)]

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run."""
        return sum(self.steps_in_epoch(e) for e in range(self.max_epochs))


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "warm_restarts",
            "AdamW, CosineAnnealingWarmRestarts (T_0 2 epochs, T_mult 2)",
            "transformer",
            14,
            schedule="warm_restarts",
        ),
        Scenario(
            "one_cycle", "OneCycleLR over the whole run (peak 5e-3)", "transformer", 8, schedule="one_cycle", lr=5e-3
        ),
        Scenario(
            "step_decay",
            "SGD with momentum 0.9 at 0.05, x0.3 every 3 epochs (StepLR)",
            "gru",
            10,
            schedule="step_decay",
            optimizer="sgd",
            lr=0.05,
        ),
        Scenario(
            "cyclic_lr",
            "CyclicLR, triangular between 1e-4 and 4e-3, a cycle every 4 epochs",
            "mlp",
            12,
            schedule="cyclic",
            lr=4e-3,
        ),
        Scenario(
            "warmup_cosine",
            "30 warm-up steps then a cosine decay to 10% (the causal LM)",
            "causal_lm",
            8,
            schedule="warmup_cosine",
        ),
        Scenario(
            "curriculum",
            "from epoch 4 the training set adds as many sequences again, twice as long",
            "transformer",
            10,
            curriculum_epoch=4,
        ),
        Scenario(
            "unfreezing",
            "the head alone, then the encoder's last layer (epoch 2), then everything (epoch 4)",
            "transformer",
            8,
            unfreeze=((2, ("encoder.layers.1.",)), (4, ("embed", "pos", "encoder.layers.0."))),
        ),
        Scenario(
            "batch_ramp",
            "the batch size doubles every epoch from 8 to 256 (1024 examples)",
            "mlp",
            8,
            n_train=1024,
            batch_sizes=(8, 16, 32, 64, 128, 256),
        ),
        Scenario("label_smoothing", "cross-entropy with label_smoothing=0.1", "transformer", 6, loss="label_smoothing"),
        Scenario(
            "contrastive",
            "InfoNCE (temperature 0.2) between two noisy views of each input, batch 64",
            "mlp",
            8,
            batch_sizes=(64,),
            n_train=1024,
            loss="contrastive",
        ),
        Scenario(
            "distillation",
            "a GRU student: half cross-entropy, half KL to a rule-based teacher at temperature 2",
            "gru",
            6,
            loss="distillation",
        ),
        Scenario(
            "heavy_tailed",
            "MSE regression, target noise Student-t with 3 degrees of freedom (scale 0.3)",
            "mlp",
            8,
            n_train=1024,
            noise="student_t",
        ),
        Scenario(
            "one_batch_epochs",
            "300 epochs of one batch of 32 each, drawn from 4096 examples (validated every 10)",
            "mlp",
            300,
            n_train=4096,
            limit_batches=1,
            val_every=10,
        ),
        Scenario("swa", "StochasticWeightAveraging from 60% of the epochs at lr 3e-4", "transformer", 8, swa=True),
    )
}


# ------------------------------------------------------------------------------------------------------- data


def _student_t_regression(n: int, seed: int) -> TensorDataset:
    """:func:`make_regression_dataset` without its noise, plus Student-t noise (3 degrees of freedom, scale 0.3)."""
    x, y = make_regression_dataset(n, seed, noise=0.0).tensors
    g = torch.Generator().manual_seed(seed + 7)
    normal = torch.randn(n, generator=g)
    chi2 = (torch.randn(n, 3, generator=g) ** 2).sum(1)
    return TensorDataset(x, y + 0.3 * normal / torch.sqrt(chi2 / 3.0))


class ScenarioData(pl.LightningDataModule):
    """The training and validation sets of a scenario; the loader is rebuilt every epoch (batch-size ramps and
    curricula change it), so the trainer runs with ``reload_dataloaders_every_n_epochs=1``."""

    def __init__(self, scenario: Scenario, seed: int = 0) -> None:
        super().__init__()
        self.scenario, self.seed = scenario, seed

    def _make(self, n: int, seed: int, hard: bool = False) -> TensorDataset:
        s = self.scenario
        if s.model in ("transformer", "gru"):
            return make_dataset(n, seed, min_len=16, max_len=30) if hard else make_dataset(n, seed)
        if s.model == "causal_lm":
            return make_lm_dataset(n, seed)
        return _student_t_regression(n, seed) if s.noise == "student_t" else make_regression_dataset(n, seed)

    def setup(self, stage: str | None = None) -> None:
        s = self.scenario
        self.train_set = self._make(s.n_train, self.seed)
        self.val_set = self._make(256, self.seed + 1)
        self.hard_set: TensorDataset | None = None
        if s.curriculum_epoch is not None:
            easy, hard = self.train_set.tensors, self._make(s.n_train, self.seed + 2, hard=True).tensors
            width = hard[0].shape[1]
            # the easy sequences padded to the hard ones' width: one dataset of both
            tokens = nn.functional.pad(easy[0], (0, width - easy[0].shape[1]), value=0)
            mask = nn.functional.pad(easy[1], (0, width - easy[1].shape[1]), value=True)
            self.hard_set = TensorDataset(
                torch.cat([tokens, hard[0]]), torch.cat([mask, hard[1]]), torch.cat([easy[2], hard[2]])
            )

    def train_dataloader(self) -> DataLoader:
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        s = self.scenario
        data = self.hard_set if self.hard_set is not None and epoch >= (s.curriculum_epoch or 0) else self.train_set
        g = torch.Generator().manual_seed(self.seed * 1000 + epoch)
        return DataLoader(data, batch_size=s.batch_size(epoch), shuffle=True, generator=g)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=64)


# ------------------------------------------------------------------------------------------------------ model


def _teacher_logits(tokens: torch.Tensor) -> torch.Tensor:
    """A rule-based teacher of the classification task: each class's logit is 1.5 x its marker's count (the label
    is the most frequent marker)."""
    return torch.stack([(tokens == m).sum(1).float() * 1.5 for m in MARKERS], dim=1)


def _info_nce(a: torch.Tensor, b: torch.Tensor, temperature: float = 0.2) -> torch.Tensor:
    """SimCLR's loss between two views' embeddings: each row's positive is the same row of the other view."""
    a, b = nn.functional.normalize(a, dim=1), nn.functional.normalize(b, dim=1)
    logits = a @ b.T / temperature
    targets = torch.arange(a.shape[0], device=a.device)
    return 0.5 * (nn.functional.cross_entropy(logits, targets) + nn.functional.cross_entropy(logits.T, targets))


class ScenarioModule(pl.LightningModule):
    """A demo network trained the scenario's way (its loss, optimizer, schedule and unfreezing).

    Logs ``train_loss`` (step and epoch) and ``val_loss``.
    """

    def __init__(self, scenario: Scenario, seed: int = 0) -> None:
        super().__init__()
        self.scenario = scenario
        mlp = scenario.model == "mlp"
        self.net: Any = build_model(
            DemoConfig(model=scenario.model, seed=seed, d_model=64 if mlp else 32, head_depth=2 if mlp else 1)
        )
        self.projection: nn.Module | None = None
        if scenario.loss == "contrastive":
            # the MLP's hidden layers are the encoder; a projection head maps to the contrastive space
            layers: Any = self.net.net
            self.net.net = layers[:-1]
            self.projection = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
        self._set_frozen(0)

    def _set_frozen(self, epoch: int) -> None:
        """Freeze the groups whose epoch has not come yet; train the others."""
        later = tuple(p for _, group in self.scenario.unfreeze for p in group)
        frozen = tuple(p for start, group in self.scenario.unfreeze if epoch < start for p in group)
        for name, p in self.net.named_parameters():
            if name.startswith(later):
                p.requires_grad_(not name.startswith(frozen))

    def on_train_epoch_start(self) -> None:
        self._set_frozen(self.current_epoch)

    def loss(self, batch: Any) -> torch.Tensor:
        """The scenario's loss of a batch."""
        kind = self.scenario.loss
        if kind == "contrastive":
            (x, _) = batch
            noise = 0.3 * torch.randn(2, *x.shape, device=x.device)
            assert self.projection is not None
            return _info_nce(self.projection(self.net.net(x + noise[0])), self.projection(self.net.net(x + noise[1])))
        if kind in ("label_smoothing", "distillation"):
            tokens, mask, labels = batch
            logits = self.net(tokens, mask)
            if kind == "label_smoothing":
                return nn.functional.cross_entropy(logits, labels, label_smoothing=0.1)
            t = 2.0
            soft = nn.functional.log_softmax(_teacher_logits(tokens) / t, dim=1)
            kl = nn.functional.kl_div(
                nn.functional.log_softmax(logits / t, dim=1), soft, log_target=True, reduction="batchmean"
            )
            return 0.5 * nn.functional.cross_entropy(logits, labels) + 0.5 * t * t * kl
        return self.net.compute_loss(batch)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch))

    def configure_optimizers(self) -> Any:
        s = self.scenario
        opt: torch.optim.Optimizer
        params = list(self.parameters())
        if s.optimizer == "sgd":
            opt = torch.optim.SGD(params, lr=s.lr, momentum=0.9)
        else:
            opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=0.01)
        per_epoch, total = s.steps_in_epoch(0), s.total_steps
        sched: Any
        if s.schedule == "constant":
            return opt
        if s.schedule == "warm_restarts":
            sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=2 * per_epoch, T_mult=2)
        elif s.schedule == "one_cycle":
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=s.lr, total_steps=total)
        elif s.schedule == "step_decay":
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.3)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}
        elif s.schedule == "cyclic":
            sched = torch.optim.lr_scheduler.CyclicLR(
                opt, base_lr=s.lr / 40, max_lr=s.lr, step_size_up=2 * per_epoch, cycle_momentum=False
            )
        elif s.schedule == "warmup_cosine":
            warm = 30

            def factor(step: int) -> float:
                if step < warm:
                    return (step + 1) / warm
                return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))

            sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        else:
            raise ValueError(
                f"Expected `schedule` to be one of constant, warm_restarts, one_cycle, step_decay, "
                f"cyclic, warmup_cosine, but got {s.schedule!r}"
            )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# ------------------------------------------------------------------------------------------------------- runs


def build_scenario(name: str, seed: int = 0) -> tuple[ScenarioModule, ScenarioData, Scenario, dict[str, Any]]:
    """The module, data module, scenario and the Trainer arguments it needs (callbacks excluded).

    Raises:
        ValueError: If ``name`` is not in :data:`SCENARIOS`.
    """
    if name not in SCENARIOS:
        raise ValueError(f"Expected argument `name` to be one of {sorted(SCENARIOS)}, but got {name!r}")
    s = SCENARIOS[name]
    trainer: dict[str, Any] = {
        "max_epochs": s.max_epochs,
        "reload_dataloaders_every_n_epochs": 1,
        "check_val_every_n_epoch": s.val_every,
        "limit_val_batches": 2,
        "num_sanity_val_steps": 0,
    }
    if s.limit_batches is not None:
        trainer["limit_train_batches"] = s.limit_batches
    return ScenarioModule(s, seed), ScenarioData(s, seed), s, trainer


@dataclasses.dataclass
class ScenarioResult:
    """What a scenario run produced: the alerts, and each epoch's mean training loss."""

    name: str
    alerts: list[Alert]
    global_step: int
    epoch_losses: list[float]
    seconds: float
    callbacks: list[Any]

    @property
    def serious(self) -> list[Alert]:
        """Warning and critical alerts."""
        return [a for a in self.alerts if a.severity != "info"]

    @property
    def converged(self) -> bool:
        """The last epoch's mean training loss is below the first's."""
        return len(self.epoch_losses) >= 2 and self.epoch_losses[-1] < self.epoch_losses[0]


def run_scenario(
    name: str,
    callbacks: Sequence[Any] = (),
    root: str | None = None,
    seed: int = 0,
    **trainer_kwargs: Any,
) -> ScenarioResult:
    """Train one scenario with ``callbacks`` (and SWA where the scenario has it).

    Args:
        name: A key of :data:`SCENARIOS`.
        callbacks: The diagnostics to attach.
        root: Directory for the Trainer's files (default ``./diag_runs``).
        seed: Seed of data, model and trainer.
        **trainer_kwargs: Passed on to :class:`pytorch_lightning.Trainer` (override the scenario's).
    """
    model, data, scenario, settings = build_scenario(name, seed)
    cbs = list(callbacks)
    if scenario.swa:
        from pytorch_lightning.callbacks import StochasticWeightAveraging

        cbs.append(StochasticWeightAveraging(swa_lrs=scenario.lr / 10, swa_epoch_start=0.6))
    epoch_losses: list[float] = []

    class _EpochLoss(pl.Callback):
        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            value = trainer.callback_metrics.get("train_loss_epoch")
            if value is not None:
                epoch_losses.append(float(value))

    pl.seed_everything(seed, verbose=False)
    kwargs: dict[str, Any] = {
        "default_root_dir": root or os.path.join(os.getcwd(), "diag_runs"),
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "log_every_n_steps": 5,
        "accelerator": "cpu",
        **settings,
        **trainer_kwargs,
        "callbacks": [*cbs, _EpochLoss()],
    }
    trainer = pl.Trainer(**kwargs)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*enable_nested_tensor.*")
        trainer.fit(model, datamodule=data)
    alerts = sorted((a for cb in callbacks for a in getattr(cb, "alerts", [])), key=lambda a: a.global_step)
    return ScenarioResult(name, alerts, trainer.global_step, epoch_losses, time.perf_counter() - start, list(cbs))
