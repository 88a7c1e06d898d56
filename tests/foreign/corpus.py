"""The foreign-code corpus: LightningModules that other projects wrote, trained the way their docs do, with the
library's callbacks attached as a new user would.

Each entry builds one model of a real Lightning-based library (pytorch-forecasting, pytorch-tabular,
neuralforecast, darts, Lightning's own demo transformer) on synthetic data made here or by the library itself (no
download at run time) and fits it through the library's own entry point, handing the callbacks to it. The
libraries are imported inside the entries only, so this module imports without them.

:func:`run_entry` runs one entry, healthy or with a NaN injected at step ``nan_step`` (the output of the first
``nn.Linear`` that runs in that training step is multiplied by NaN, once), and returns a :class:`ForeignResult`:
the alerts, the per-step training losses, the ``diag/attn_entropy/`` tags written, and for a NaN run whether the
parameters after ``fit`` are bitwise the ones before the poisoned step.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib
import importlib.metadata
import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

#: What a healthy run attaches: the defaults of ``lightning_diag.demo.run.default_callbacks`` plus the two
#: callbacks that read the data and the machine.
HEALTHY_CALLBACKS = (
    "GradientFlowMonitor",
    "AnomalyAlarm",
    "AttentionEntropyMonitor",
    "DataDiagnostics",
    "SystemMonitor",
)
#: What a NaN run attaches: the defaults.
NAN_CALLBACKS = ("GradientFlowMonitor", "AnomalyAlarm", "AttentionEntropyMonitor")
ATTN_PREFIX = "diag/attn_entropy/"
#: SystemMonitor's rules judged on wall-clock time: their verdict follows the machine's load (8 jobs on 2 cores
#: or a quiet CI runner), not the model, so the tests list them but do not assert them.
TIMING_RULES = ("dataloader_bound", "step_time_periodic", "step_time_fluctuation")


@dataclasses.dataclass
class ForeignResult:
    """What one run of a corpus entry produced."""

    name: str
    alerts: list[Any]
    losses: list[float]
    global_step: int
    attention_tags: list[str]
    seconds: float = 0.0
    poisoned: str | None = None
    params_unchanged: bool | None = None
    params_finite: bool | None = None
    #: The callbacks the trainer ran (the library's copies where it deep-copies them): their ``rule_peaks()``.
    trainer_callbacks: list[Any] = dataclasses.field(default_factory=list)
    #: The trainer that ran the fit (the library's own; the harness's oracles read its module and data).
    trainer: Any = None

    @property
    def serious(self) -> list[Any]:
        """Warning and critical alerts."""
        return [a for a in self.alerts if a.severity != "info"]

    @property
    def judged(self) -> list[Any]:
        """Warning and critical alerts of the rules that judge the model (all but :data:`TIMING_RULES`)."""
        return [a for a in self.serious if a.rule not in TIMING_RULES]

    def loss_span(self, n: int = 5) -> tuple[float, float]:
        """Mean training loss of the first and of the last ``n`` steps."""
        k = max(1, min(n, len(self.losses) // 2))
        return float(np.mean(self.losses[:k])), float(np.mean(self.losses[-k:]))

    @property
    def attention_modules(self) -> list[str]:
        """The modules with a ``diag/attn_entropy/<module>/mean`` series."""
        return sorted({t[len(ATTN_PREFIX) : -len("/mean")] for t in self.attention_tags if t.endswith("/mean")})


@dataclasses.dataclass(frozen=True)
class Entry:
    """One model of the corpus."""

    library: str  #: the PyPI distribution
    module: str  #: the import name, checked before running
    model: str
    flavour: str  #: "lightning" (``lightning.pytorch``) or "pl" (``pytorch_lightning``)
    max_steps: int
    has_attention: bool
    attention_kind: str  #: how the model computes attention ("" when it has none)
    train: Callable[..., Any]  #: train(callbacks, logger, max_steps): fits the model through its library
    nan_step: int = 6
    #: "forward": the NaN is in a module's output, so in the loss; "grad": in the gradient of a module's output
    #: only (pytorch-forecasting replaces a non-finite loss by a constant 1e9 without a graph, and then its own
    #: backward raises, with or without any callback; neuralforecast's training_step raises on a NaN loss itself;
    #: scvi-tools' distributions reject NaN parameters: their NaN can only reach an update through the gradients).
    nan_mode: str = "forward"


def installed(entry: Entry) -> str | None:
    """``None`` when the entry's library imports, else why not (the exception)."""
    try:
        importlib.import_module(entry.module)
    except Exception as err:  # any import failure is a reason to report, not a crash
        return f"{entry.library} is not importable: {type(err).__name__}: {err}"
    return None


def version(entry: Entry) -> str:
    """The installed version of the entry's library."""
    return importlib.metadata.version(entry.library)


# --------------------------------------------------------------------------------------------- synthetic data


def _ar_frame(n_series: int = 24, timesteps: int = 160, seed: int = 0) -> Any:
    """pytorch-forecasting's own synthetic generator (``generate_ar_data``): seasonal AR series with a trend."""
    from pytorch_forecasting.data.examples import generate_ar_data

    data = generate_ar_data(seasonality=10.0, timesteps=timesteps, n_series=n_series, seed=seed)
    data["series"] = data["series"].astype(str).astype("category")
    data["date"] = np.datetime64("2020-01-01") + data["time_idx"].to_numpy().astype("timedelta64[D]")
    return data


def _tabular_frame(n: int = 1024, seed: int = 0) -> Any:
    """A classification table: 6 numeric and 2 categorical columns, the label a noisy rule over both."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    num = rng.normal(size=(n, 6)).astype(np.float32)
    cat_a = rng.integers(0, 5, size=n)
    cat_b = rng.integers(0, 3, size=n)
    score = num[:, 0] - 0.8 * num[:, 1] + 0.5 * num[:, 2] * num[:, 3] + 0.7 * (cat_a % 2) - 0.6 * (cat_b == 1)
    label = (score + 0.3 * rng.normal(size=n) > 0).astype(int)
    frame = pd.DataFrame(num, columns=[f"x{i}" for i in range(6)])
    frame["a"] = [f"a{v}" for v in cat_a]
    frame["b"] = [f"b{v}" for v in cat_b]
    frame["label"] = label
    return frame


def _series_frame(n_series: int = 8, length: int = 240, seed: int = 0) -> Any:
    """neuralforecast's long format (``unique_id``, ``ds``, ``y``): noisy daily series with two seasonalities."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    t = np.arange(length)
    frames = []
    for i in range(n_series):
        y = (
            10
            + 3 * np.sin(2 * np.pi * t / 7 + i)
            + 2 * np.sin(2 * np.pi * t / 30 + 0.5 * i)
            + 0.01 * (i + 1) * t
            + 0.3 * rng.normal(size=length)
        )
        frames.append(pd.DataFrame({"unique_id": f"s{i}", "ds": pd.date_range("2020-01-01", periods=length), "y": y}))
    return pd.concat(frames, ignore_index=True)


def _darts_series(length: int = 400, seed: int = 0) -> Any:
    """darts' own generators: a sine plus a linear trend plus Gaussian noise, as float32."""
    from darts.utils import timeseries_generation as tg

    series = (
        tg.sine_timeseries(length=length, value_frequency=0.05, value_amplitude=1.0)
        + tg.linear_timeseries(length=length, start_value=0.0, end_value=1.0)
        + tg.gaussian_timeseries(length=length, std=0.1)
    )
    return series.astype(np.float32)


# ------------------------------------------------------------------------------------------ the entries' fits


def _pf_fit(kind: str) -> Callable[..., Any]:
    """A pytorch-forecasting model fitted as its tutorials do: a ``TimeSeriesDataSet``, ``Model.from_dataset``,
    a ``lightning.pytorch.Trainer`` with gradient clipping."""

    def train(callbacks: list[Any], logger: Any, max_steps: int) -> None:
        import lightning.pytorch as lp
        from pytorch_forecasting import DeepAR, NBeats, NHiTS, TemporalFusionTransformer, TimeSeriesDataSet
        from pytorch_forecasting.data import GroupNormalizer, NaNLabelEncoder
        from pytorch_forecasting.metrics import QuantileLoss

        data = _ar_frame()
        encoder, horizon = (30, 10)
        cutoff = data["time_idx"].max() - horizon
        common: dict[str, Any] = {
            "time_idx": "time_idx",
            "target": "value",
            "group_ids": ["series"],
            "categorical_encoders": {"series": NaNLabelEncoder().fit(data.series)},
            "max_encoder_length": encoder,
            "max_prediction_length": horizon,
            "time_varying_unknown_reals": ["value"],
        }
        if kind in ("tft", "deepar"):
            common.update(
                static_categoricals=["series"],
                time_varying_known_reals=["time_idx"],
                target_normalizer=GroupNormalizer(groups=["series"]),
                add_relative_time_idx=kind == "tft",
                add_target_scales=kind == "tft",
            )
        training = TimeSeriesDataSet(data[lambda x: x.time_idx <= cutoff], **common)
        validation = TimeSeriesDataSet.from_dataset(training, data, min_prediction_idx=cutoff + 1)
        train_loader = training.to_dataloader(train=True, batch_size=64, num_workers=0)
        val_loader = validation.to_dataloader(train=False, batch_size=64, num_workers=0)
        if kind == "tft":
            model = TemporalFusionTransformer.from_dataset(
                training, learning_rate=0.03, hidden_size=16, attention_head_size=2, dropout=0.1,
                hidden_continuous_size=8, loss=QuantileLoss(), log_interval=-1,
            )  # fmt: skip
        elif kind == "nbeats":
            model = NBeats.from_dataset(
                training, learning_rate=3e-2, weight_decay=1e-2, widths=[32, 128], backcast_loss_ratio=0.1,
                log_interval=-1,
            )  # fmt: skip
        elif kind == "deepar":
            model = DeepAR.from_dataset(training, learning_rate=1e-2, hidden_size=30, rnn_layers=2, log_interval=-1)
        else:
            model = NHiTS.from_dataset(
                training, learning_rate=5e-3, weight_decay=1e-2, hidden_size=64, log_interval=-1
            )  # fmt: skip
        trainer = lp.Trainer(
            max_steps=max_steps, max_epochs=-1, accelerator="cpu", gradient_clip_val=0.1, callbacks=callbacks,
            logger=logger, limit_val_batches=2, val_check_interval=25, check_val_every_n_epoch=None,
            num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=False, log_every_n_steps=5,
        )  # fmt: skip
        trainer.fit(model, train_dataloaders=train_loader, val_dataloaders=val_loader)

    return train


def _tabular_fit(kind: str) -> Callable[..., Any]:
    """A pytorch-tabular model fitted as its docs do: ``DataConfig``, a model config, ``TabularModel.fit`` on a
    DataFrame, with the callbacks handed to ``fit``. The library makes its own TensorBoard logger
    (``ExperimentConfig``), put where ``logger`` would write, and keeps a version file under ``./.pt_tmp``: the
    fit runs from the log directory so that nothing lands in the caller's working directory."""

    def train(callbacks: list[Any], logger: Any, max_steps: int) -> None:
        from pytorch_tabular import TabularModel
        from pytorch_tabular.config import DataConfig, ExperimentConfig, OptimizerConfig, TrainerConfig
        from pytorch_tabular.models import (
            CategoryEmbeddingModelConfig,
            FTTransformerConfig,
            GANDALFConfig,
            TabTransformerConfig,
        )

        frame = _tabular_frame()
        train_frame, val_frame = frame.iloc[:896], frame.iloc[896:]
        data_config = DataConfig(
            target=["label"], continuous_cols=[f"x{i}" for i in range(6)], categorical_cols=["a", "b"]
        )
        common = {"task": "classification", "learning_rate": 1e-3}
        if kind == "ft":
            model_config: Any = FTTransformerConfig(
                **common, input_embed_dim=32, num_heads=4, num_attn_blocks=2, attn_dropout=0.1
            )
        elif kind == "tab":
            model_config = TabTransformerConfig(
                **common, input_embed_dim=32, num_heads=4, num_attn_blocks=2, attn_dropout=0.1
            )
        elif kind == "gandalf":
            model_config = GANDALFConfig(**common, gflu_stages=4)
        else:
            model_config = CategoryEmbeddingModelConfig(**common, layers="64-32")
        trainer_config = TrainerConfig(
            batch_size=64, max_epochs=1000, accelerator="cpu", early_stopping=None,
            checkpoints=None, load_best=False, progress_bar="none",
            trainer_kwargs={"max_steps": max_steps, "enable_model_summary": False, "log_every_n_steps": 5},
        )  # fmt: skip
        root = os.path.abspath(logger.save_dir)
        experiment = ExperimentConfig(project_name=root, run_name=logger.name, log_target="tensorboard")
        cwd = os.getcwd()
        os.chdir(root)
        try:
            model = TabularModel(
                data_config=data_config, model_config=model_config, optimizer_config=OptimizerConfig(),
                trainer_config=trainer_config, experiment_config=experiment, verbose=False,
            )  # fmt: skip
            model.fit(train=train_frame, validation=val_frame, callbacks=callbacks)
        finally:
            os.chdir(cwd)

    return train


def _nf_fit(kind: str) -> Callable[..., Any]:
    """A neuralforecast model fitted as its docs do: ``NeuralForecast(models=[...], freq=...).fit(df)``, the
    Lightning arguments (callbacks, logger) passed to the model as trainer keyword arguments."""

    def train(callbacks: list[Any], logger: Any, max_steps: int) -> None:
        from neuralforecast import NeuralForecast
        from neuralforecast.models import NHITS, TFT

        trainer_kwargs = {
            "callbacks": callbacks, "logger": logger, "accelerator": "cpu", "enable_progress_bar": False,
            "enable_model_summary": False, "log_every_n_steps": 5,
        }  # fmt: skip
        common = {
            "h": 14, "input_size": 28, "max_steps": max_steps, "batch_size": 8, "windows_batch_size": 128,
            "random_seed": 0,
        }  # fmt: skip
        if kind == "nhits":
            model: Any = NHITS(**common, learning_rate=1e-3, **trainer_kwargs)
        else:
            model = TFT(**common, hidden_size=32, n_head=4, learning_rate=5e-3, **trainer_kwargs)
        NeuralForecast(models=[model], freq="D").fit(_series_frame())

    return train


def _darts_fit(kind: str) -> Callable[..., Any]:
    """A darts torch model fitted as its docs do: ``Model(input_chunk_length, output_chunk_length, ...,
    pl_trainer_kwargs=...)`` and ``model.fit(series)``."""

    def train(callbacks: list[Any], logger: Any, max_steps: int) -> None:
        from darts.models import NBEATSModel, TransformerModel

        series = _darts_series()
        kwargs = {
            "input_chunk_length": 24, "output_chunk_length": 6, "batch_size": 32, "random_state": 0,
            "n_epochs": 1000,
            "pl_trainer_kwargs": {
                "callbacks": callbacks, "logger": logger, "accelerator": "cpu", "max_steps": max_steps,
                "enable_progress_bar": False, "enable_model_summary": False, "log_every_n_steps": 5,
            },
        }  # fmt: skip
        if kind == "transformer":
            model: Any = TransformerModel(
                **kwargs, d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=64,
                dropout=0.1,
            )  # fmt: skip
        else:
            model = NBEATSModel(**kwargs, num_stacks=4, num_blocks=1, num_layers=2, layer_widths=64)
        model.fit(series, verbose=False)

    return train


def _scvi_fit(callbacks: list[Any], logger: Any, max_steps: int) -> None:
    """scvi-tools' SCVI (a variational autoencoder of single-cell counts, its KL term warmed up over epochs)
    fitted as its tutorials do: ``SCVI.setup_anndata``, ``SCVI(adata)``, ``model.train(...)``, on the library's
    own synthetic counts (``scvi.data.synthetic_iid``: 400 cells, 100 genes, two batches)."""
    import scvi

    scvi.settings.seed = 0
    adata = scvi.data.synthetic_iid()
    scvi.model.SCVI.setup_anndata(adata, batch_key="batch")
    model = scvi.model.SCVI(adata, n_latent=10)
    model.train(
        max_epochs=1000, max_steps=max_steps, batch_size=128, accelerator="cpu", callbacks=callbacks, logger=logger,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=5, check_val_every_n_epoch=10,
    )  # fmt: skip


def _lightning_demo_fit(callbacks: list[Any], logger: Any, max_steps: int) -> None:
    """Lightning's demo ``LightningTransformer`` (``nn.Transformer``, SGD at 0.1) trained as its docs do, on
    synthetic tokens instead of WikiText-2: each sequence counts up from a random start by a random stride, so
    the next token is predictable from the ones before. Its ``prepare_data`` (a WikiText-2 download) is
    replaced by nothing, the one change, since the data are passed to ``fit``."""
    import lightning.pytorch as lp
    from lightning.pytorch.demos import LightningTransformer

    class Demo(LightningTransformer):
        def prepare_data(self) -> None:
            pass

    vocab, length, n = 64, 16, 1024
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    tokens = (start + stride * torch.arange(length + 1)) % vocab
    dataset = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    loader = torch.utils.data.DataLoader(dataset, batch_size=16, shuffle=True, generator=g)
    model = Demo(vocab_size=vocab)
    trainer = lp.Trainer(
        max_steps=max_steps, max_epochs=-1, accelerator="cpu", gradient_clip_val=0.25, callbacks=callbacks,
        logger=logger, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        log_every_n_steps=5,
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=loader)


_PFL, _PTL = ("pytorch-forecasting", "pytorch_forecasting"), ("pytorch-tabular", "pytorch_tabular")
_NFL, _DAL = ("neuralforecast", "neuralforecast"), ("darts", "darts")
_HAND = "hand-written (softmax of q·kᵀ, then weights values)"
_MHA = "nn.Transformer (nn.MultiheadAttention)"

ENTRIES: dict[str, Entry] = {
    "pf_tft": Entry(*_PFL, "TemporalFusionTransformer", "lightning", 120, True, _HAND, _pf_fit("tft"), nan_mode="grad"),
    "pf_nbeats": Entry(*_PFL, "NBeats", "lightning", 120, False, "", _pf_fit("nbeats"), nan_mode="grad"),
    "pf_deepar": Entry(*_PFL, "DeepAR", "lightning", 120, False, "", _pf_fit("deepar"), nan_mode="grad"),
    "pf_nhits": Entry(*_PFL, "NHiTS", "lightning", 120, False, "", _pf_fit("nhits"), nan_mode="grad"),
    "pt_ft_transformer": Entry(*_PTL, "FTTransformer", "pl", 150, True, _HAND, _tabular_fit("ft")),
    "pt_tab_transformer": Entry(*_PTL, "TabTransformer", "pl", 150, True, _HAND, _tabular_fit("tab")),
    "pt_category_embedding": Entry(*_PTL, "CategoryEmbedding", "pl", 150, False, "", _tabular_fit("ce")),
    "pt_gandalf": Entry(*_PTL, "GANDALF", "pl", 150, False, "", _tabular_fit("gandalf")),
    "nf_nhits": Entry(*_NFL, "NHITS", "pl", 100, False, "", _nf_fit("nhits"), nan_mode="grad"),
    "nf_tft": Entry(*_NFL, "TFT", "pl", 100, True, _HAND, _nf_fit("tft"), nan_mode="grad"),
    "darts_transformer": Entry(*_DAL, "TransformerModel", "pl", 150, True, _MHA, _darts_fit("transformer")),
    "darts_nbeats": Entry(*_DAL, "NBEATSModel", "pl", 150, False, "", _darts_fit("nbeats")),
    "scvi": Entry("scvi-tools", "scvi", "SCVI", "lightning", 150, False, "", _scvi_fit, nan_mode="grad"),
    "lightning_transformer": Entry(
        "lightning", "lightning", "demos.LightningTransformer", "lightning", 150, True, _MHA, _lightning_demo_fit
    ),
}


# ------------------------------------------------------------------------------------------------- the runs


def _callbacks(flavour: str, names: tuple[str, ...]) -> list[Any]:
    source = importlib.import_module("lightning_diag.lightning" if flavour == "lightning" else "lightning_diag")
    return [getattr(source, name)() for name in names]


def _base(flavour: str) -> tuple[type, Any]:
    """The ``Callback`` class and the logger module of the entry's Lightning."""
    if flavour == "lightning":
        import lightning.pytorch as lp
        from lightning.pytorch import loggers

        return lp.Callback, loggers
    import pytorch_lightning as pl
    from pytorch_lightning import loggers as pl_loggers

    return pl.Callback, pl_loggers


def _recorder(base: type, losses: list[float], state: dict[str, Any]) -> Any:
    class LossRecorder(base):  # type: ignore[misc, valid-type]
        """Every training step's loss, as the step returned it, and the trainer (some libraries fit a copy of
        the model they were given, so the trainer is not reachable from it afterwards)."""

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            state["trainer"] = trainer

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if isinstance(loss, torch.Tensor):
                losses.append(float(loss.detach()))

    return LossRecorder()


def _poisoner(base: type, step: int, mode: str, state: dict[str, Any]) -> Any:
    class NaNInjector(base):  # type: ignore[misc, valid-type]
        """At training step ``step``, multiplies by NaN the output (``mode="forward"``) or the gradient of the
        output (``mode="grad"``) of the first ``nn.Linear`` that runs, and keeps a copy of the parameters as they
        were before that step."""

        def __init__(self) -> None:
            self.handles: list[Any] = []
            self.armed = False

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            for name, module in pl_module.named_modules():
                if isinstance(module, torch.nn.Linear):
                    self.handles.append(module.register_forward_hook(self._hook(name)))

        def _hook(self, name: str) -> Callable[..., Any]:
            def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
                if self.armed and module.training and isinstance(output, torch.Tensor) and output.requires_grad:
                    self.armed = False
                    state["poisoned"] = name
                    if mode == "grad":
                        output.register_hook(lambda grad: grad * float("nan"))
                        return None
                    return output * float("nan")
                return None

            return hook

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, i: int) -> None:
            if trainer.global_step == step and "before" not in state:
                state["before"] = {k: v.detach().clone() for k, v in pl_module.named_parameters()}
                state["module"] = pl_module
                self.armed = True

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            for handle in self.handles:
                handle.remove()

    return NaNInjector()


def run_alerts(root: str) -> list[Any]:
    """Every alert in the ``diag/alerts.jsonl`` files under ``root``, by step. Read from the files, not from the
    callbacks: a library that deep-copies the model and its trainer arguments (neuralforecast) runs copies of
    the callbacks it was given."""
    from lightning_diag.core.alerts import read_alerts

    paths = glob.glob(os.path.join(root, "**", "alerts.jsonl"), recursive=True)
    return sorted((a for path in paths for a in read_alerts(path)), key=lambda a: a.global_step)


def attention_tags(root: str) -> list[str]:
    """Every ``diag/attn_entropy/`` scalar tag in the TensorBoard event files under ``root``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: set[str] = set()
    for path in glob.glob(os.path.join(root, "**", "events.out.tfevents.*"), recursive=True):
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        tags.update(t for t in acc.Tags().get("scalars", []) if t.startswith(ATTN_PREFIX))
    return sorted(tags)


def run_entry(
    name: str,
    root: str,
    nan_step: int | None = None,
    max_steps: int | None = None,
    callbacks: tuple[str, ...] | None = None,
) -> ForeignResult:
    """Train one entry with the healthy callbacks (``nan_step=None``) or the defaults and a NaN at ``nan_step``.

    Args:
        name: A key of :data:`ENTRIES`.
        root: Directory for the TensorBoard logs.
        nan_step: The training step whose forward pass gets the NaN; ``None`` for a healthy run.
        max_steps: Steps to train (default: the entry's).
        callbacks: Names of the callbacks to attach instead of :data:`HEALTHY_CALLBACKS` / :data:`NAN_CALLBACKS`.
    """
    import time

    entry = ENTRIES[name]
    os.makedirs(root, exist_ok=True)
    base, loggers = _base(entry.flavour)
    if callbacks is None:
        callbacks = HEALTHY_CALLBACKS if nan_step is None else NAN_CALLBACKS
    cbs = _callbacks(entry.flavour, callbacks)
    losses: list[float] = []
    state: dict[str, Any] = {}
    extra = [_recorder(base, losses, state)]
    if nan_step is not None:
        extra.append(_poisoner(base, nan_step, entry.nan_mode, state))
    logger = loggers.TensorBoardLogger(root, name=name)
    torch.manual_seed(0)
    np.random.seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the libraries' own deprecation and worker notices
            entry.train([*cbs, *extra], logger, max_steps or entry.max_steps)
    finally:
        torch.set_num_threads(threads)
    seconds = time.perf_counter() - start
    alerts = run_alerts(root)
    result = ForeignResult(name, alerts, losses, state["trainer"].global_step, attention_tags(root), seconds)
    result.trainer_callbacks = list(state["trainer"].callbacks)
    result.trainer = state["trainer"]
    if nan_step is not None:
        result.poisoned = state.get("poisoned")
        before = state.get("before", {})
        after = dict(state["module"].named_parameters()) if "module" in state else {}
        result.params_finite = all(bool(torch.isfinite(p).all()) for p in after.values())
        result.params_unchanged = bool(before) and all(torch.equal(before[k], after[k].detach()) for k in before)
    return result


def nan_stopped(result: ForeignResult, step: int) -> bool:
    """The NaN run's verdict: a critical non-finite alert (loss or gradient) at ``step``, ``fit`` returned, and
    the parameters after it are finite and bitwise those before the bad step: no update was applied from the bad
    step on. (The fit ends at the bad step, or at the end of the epoch where the library's ``min_epochs=1`` makes
    Lightning ignore the stop request: pytorch-tabular; the alarm drops every update until then.)"""
    hits = [a for a in result.alerts if a.rule in ("nonfinite_loss", "nonfinite_grad") and a.severity == "critical"]
    return (
        bool(hits)
        and hits[0].global_step == step
        and bool(result.params_unchanged)
        and bool(result.params_finite)
        and all(math.isfinite(x) for x in result.losses[:step])
    )
