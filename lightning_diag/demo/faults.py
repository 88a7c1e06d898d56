"""The fault library: named training faults, each with its onset and the rules expected to catch it.

Used by ``lightning-diag demo``, the scenario tests and the benchmarks. A fault is a change to the healthy
:class:`~lightning_diag.demo.models.DemoConfig` and data module; an entry without expected rules is a healthy
baseline (``"none"`` is the healthy transformer classifier). Entries with ``config["model"]`` train another
shape: an MLP regressing noisy targets, a small causal language model, a GRU classifier.

Example:
    >>> {"attention", "bf16_tiny_lr", "collapse", "eval_mode"} <= set(FAULTS)
    True
    >>> FAULTS["nan"].expected_rules
    ('nonfinite_loss',)
    >>> [f.name for f in FAULTS.values() if f.healthy][:3]
    ['none', 'healthy_sgd', 'healthy_deep']
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytorch_lightning as pl

from lightning_diag.demo import problem_models  # noqa: F401  (registers the shapes of the published problems)
from lightning_diag.demo.models import DemoConfig, DemoModule, build_model
from lightning_diag.demo.output_models import OUTPUT_SHAPES
from lightning_diag.demo.synthetic import DATA_MODULES
from lightning_diag.rules.catalog import (
    ACTIVATION_SATURATION,
    AMP_NOT_APPLIED,
    ATTN_ENTROPY_LOW,
    ATTN_LOGIT_GROWTH,
    BATCH_SIZE_MISMATCH,
    DATA_LEAKAGE,
    DEAD_UNITS,
    EVAL_MODE_IN_TRAINING,
    EVAL_RANDOMNESS,
    GRAD_COLLAPSE,
    GRAD_EXPLODE,
    GRAD_FROZEN,
    GRAD_NOT_ZEROED,
    GRAD_VANISH,
    LOSS_ON_PADDING,
    LOSS_OUTLIER,
    LOSS_STAGNANT,
    LOSS_SWING,
    NONFINITE_LOSS,
    OUTPUT_COLLAPSE,
    POSITION_OVERFLOW,
    STEP_TIME_PERIODIC,
    TRAIN_OVERRIDE_BYPASSED,
    UPDATE_NONE,
    UPDATE_STALE,
    UPDATE_TOO_SMALL,
    VAL_DECLINE,
    WORKER_RNG_SHARED,
    ZERO_OUTPUT,
)

__all__ = ["FAULTS", "Fault", "build_fault"]


@dataclasses.dataclass(frozen=True)
class Fault:
    """One entry of the fault library.

    Attributes:
        name: The name ``--fault`` takes.
        description: What goes wrong, in a sentence.
        expected_rules: Rule ids that must fire (empty for a healthy run).
        onset_step: Global step where the fault begins, if it begins at a step.
        onset_epoch: Epoch where the fault begins, if it begins at an epoch.
        window: How many steps (``onset_step``) or epochs (``onset_epoch``) after onset the expected rules must
            have fired by.
        max_epochs: Epochs the demo trains for.
        config: Overrides of :class:`DemoConfig`.
        data: Overrides of :class:`SyntheticDataModule` arguments.
        trainer: Overrides of :class:`pytorch_lightning.Trainer` arguments (``precision``).
        callbacks: Callbacks the fault needs beyond :func:`~lightning_diag.demo.run.default_callbacks`, as
            ``(class name, keyword arguments)`` pairs (``DataDiagnostics`` for the data faults).
    """

    name: str
    description: str
    expected_rules: tuple[str, ...]
    onset_step: int | None = None
    onset_epoch: int | None = None
    window: int = 0
    max_epochs: int = 6
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    trainer: dict[str, Any] = dataclasses.field(default_factory=dict)
    callbacks: tuple[tuple[str, dict[str, Any]], ...] = ()

    @property
    def healthy(self) -> bool:
        """Whether this entry is a healthy baseline (no rule may fire)."""
        return not self.expected_rules

    @property
    def model(self) -> str:
        """The model's shape (a key of :data:`~lightning_diag.demo.models.MODELS`)."""
        return str(self.config.get("model", "transformer"))


#: DataDiagnostics for the language-model entries. The demo LM task is a deterministic rule over 64 patterns, so
#: its validation set repeats the training set by construction: leakage counts exact copies only, at 100%.
_LM_DATA: dict[str, Any] = {"rules": {DATA_LEAKAGE: {"threshold": 1.0, "near_duplicate": 1.0}}}

FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        Fault("none", "a healthy run: no fault", (), max_epochs=6),
        Fault(
            "nan",
            "the loss becomes NaN at global step 30",
            (NONFINITE_LOSS,),
            onset_step=30,
            max_epochs=6,
            config={"nan_at_step": 30},
        ),
        Fault(
            "swing",
            "plain SGD on the noisy-regression MLP, the learning rate alternating every epoch between 0.01 and 0.2:"
            " the loss level swings with it",
            (LOSS_SWING,),
            onset_epoch=1,
            window=5,
            max_epochs=8,
            config={
                "model": "mlp",
                "d_model": 64,
                "head_depth": 2,
                "optimizer": "sgd",
                "lr": 0.01,
                "lr_schedule": "oscillate",
                "oscillate_factor": 20.0,
            },
            data={"n_train": 512, "batch_size": 8},
        ),
        Fault(
            "explode",
            "plain SGD with a learning rate of 6: gradients explode within a few steps",
            (GRAD_EXPLODE,),
            onset_step=0,
            window=10,
            max_epochs=2,
            config={"optimizer": "sgd", "lr": 6.0},
        ),
        Fault(
            "healthy_sgd",
            "healthy counterpart of `explode`: plain SGD with a learning rate of 0.05",
            (),
            max_epochs=6,
            config={"optimizer": "sgd", "lr": 0.05},
        ),
        Fault(
            "vanish",
            "a classifier head of 10 sigmoid layers: the gradients reaching the encoder vanish",
            (GRAD_VANISH,),
            onset_step=0,
            window=65,
            max_epochs=5,
            config={"head_depth": 10, "hidden_activation": "sigmoid"},
        ),
        Fault(
            "healthy_deep",
            "healthy counterpart of `vanish`: a classifier head of 4 tanh layers",
            (),
            max_epochs=6,
            config={"head_depth": 4, "hidden_activation": "tanh"},
        ),
        Fault(
            "collapse",
            "every unit dies at global step 40: all gradients become 0",
            (GRAD_COLLAPSE,),
            onset_step=40,
            window=15,
            max_epochs=4,
            config={"kill_hidden_at_step": 40},
        ),
        Fault(
            "attention",
            "from global step 30 every query attends only to [CLS]: attention collapses onto one token",
            (ATTN_ENTROPY_LOW,),
            onset_step=30,
            window=15,
            max_epochs=3,
            config={"attention_collapse_at_step": 30},
        ),
        Fault(
            "overfit",
            "a tiny training set with random labels: the model memorises and validation worsens",
            (VAL_DECLINE,),
            onset_epoch=0,
            window=25,
            max_epochs=30,
            config={"lr": 3e-3, "d_model": 48},
            data={"n_train": 64, "batch_size": 16, "random_labels": True},
        ),
        Fault(
            "inf_input",
            "an Inf enters the input embeddings of one example at global step 30: the loss becomes non-finite",
            (NONFINITE_LOSS,),
            onset_step=30,
            max_epochs=3,
            config={"inf_input_at_step": 30},
        ),
        Fault(
            "frozen",
            "the second encoder layer is trainable but left out of the optimizer: it never trains",
            (GRAD_FROZEN,),
            onset_step=0,
            window=4,  # the first measurement: step 4, the user's first logging step (log_every_n_steps=5)
            max_epochs=2,
            config={"exclude_from_optimizer": ("encoder.layers.1.",)},
        ),
        Fault(
            "shuffled_labels",
            "the training targets are permuted against their inputs: the loss never falls below chance level",
            (LOSS_STAGNANT,),
            onset_epoch=0,
            window=4,
            max_epochs=5,
            data={"shuffle_targets": True},
        ),
        Fault(
            "healthy_regression",
            "healthy baseline: an MLP (2 hidden layers of 64) regressing a smooth function with noisy targets",
            (),
            max_epochs=6,
            config={"model": "mlp", "d_model": 64, "head_depth": 2},
        ),
        Fault(
            "target_drift",
            "the regression MLP's training targets drift by 0.5 more every epoch (a target transform that changes "
            "between epochs): validation, on the clean targets, worsens at every epoch at any epoch length",
            (VAL_DECLINE,),
            onset_epoch=1,
            window=7,  # 5 worsening validation runs after the first drifted epoch
            max_epochs=8,
            config={"model": "mlp", "d_model": 64, "head_depth": 2, "target_drift": 0.5},
        ),
        Fault(
            "healthy_lm",
            "healthy baseline: a 2-layer causal transformer language model on modular-arithmetic sequences",
            (),
            max_epochs=6,
            config={"model": "causal_lm"},
        ),
        Fault(
            "healthy_gru",
            "healthy baseline: a GRU classifier on the synthetic classification task",
            (),
            max_epochs=6,
            config={"model": "gru"},
        ),
        # -- silent errors (issue 22) ----------------------------------------------------------------------
        Fault(
            "optimizer_copy",
            "the optimizer is built over copies of the parameters: it steps tensors nobody uses, the model never "
            "changes",
            (UPDATE_NONE,),
            onset_step=0,
            window=15,
            max_epochs=1,
            config={"optimizer_over_copy": True},
        ),
        Fault(
            "bf16_tiny_lr",
            "bf16 weights (precision='bf16-true') with a learning rate of 1e-6: the updates round to zero",
            (UPDATE_STALE,),
            onset_step=0,
            window=15,
            max_epochs=1,
            config={"model": "mlp", "d_model": 64, "head_depth": 2, "lr": 1e-6},
            trainer={"precision": "bf16-true"},
        ),
        Fault(
            "healthy_bf16",
            "healthy counterpart of `bf16_tiny_lr`: bf16 weights with a learning rate of 3e-3",
            (),
            max_epochs=2,
            config={"model": "mlp", "d_model": 64, "head_depth": 2, "lr": 3e-3},
            trainer={"precision": "bf16-true"},
        ),
        Fault(
            "no_zero_grad",
            "manual optimization that never calls zero_grad: every step applies the sum of all earlier gradients",
            (GRAD_NOT_ZEROED,),
            onset_step=0,
            window=10,
            max_epochs=1,
            config={"manual": "no_zero_grad"},
        ),
        Fault(
            "healthy_manual_accumulation",
            "healthy counterpart of `no_zero_grad`: manual optimization, backward on every batch, step and "
            "zero_grad every second batch",
            (),
            max_epochs=2,
            config={"manual": "accumulate"},
        ),
        Fault(
            "eval_mode",
            "model.eval() in on_train_epoch_start: the transformer's Dropout (0.1) is off during training",
            (EVAL_MODE_IN_TRAINING,),
            onset_epoch=0,
            window=0,
            max_epochs=1,
            config={"dropout": 0.1, "eval_at_epoch_start": True},
        ),
        Fault(
            "healthy_dropout",
            "healthy counterpart of `eval_mode`: the transformer with Dropout 0.1, in train mode",
            (),
            max_epochs=2,
            config={"dropout": 0.1},
        ),
        Fault(
            "train_override",
            "the model overrides train() to freeze its embeddings (plain-PyTorch code that calls model.train() every "
            "epoch); Lightning never calls train(), so the embeddings keep training",
            (TRAIN_OVERRIDE_BYPASSED,),
            onset_step=0,
            window=0,
            max_epochs=1,
            config={"freeze_in_train": ("embed",)},
        ),
        Fault(
            "healthy_train_override",
            "healthy counterpart of `train_override`: the same override, run by self.train() in on_train_epoch_start",
            (),
            max_epochs=1,
            config={"freeze_in_train": ("embed",), "train_at_epoch_start": True},
        ),
        Fault(
            "eval_dropout",
            "F.dropout(x, 0.1) in the forward with its default training=True: dropout stays on in validation",
            (EVAL_RANDOMNESS,),
            onset_step=0,
            window=0,
            max_epochs=1,
            config={"eval_dropout": 0.1},
        ),
        Fault(
            "autocast_off",
            "precision='bf16-mixed', but the forward runs in autocast(enabled=False): every matmul stays float32",
            (AMP_NOT_APPLIED,),
            onset_step=0,
            window=1,
            max_epochs=1,
            config={"autocast_off": True},
            trainer={"precision": "bf16-mixed"},
        ),
        Fault(
            "healthy_bf16_mixed",
            "healthy counterpart of `autocast_off`: the transformer under precision='bf16-mixed'",
            (),
            max_epochs=2,
            trainer={"precision": "bf16-mixed"},
        ),
        Fault(
            "zero_input",
            "from step 60, every 20th step's tokens arrive as zeros (a transient corruption of a copy): single "
            "steps whose loss jumps back to the untrained level, which epoch means average away",
            (LOSS_OUTLIER,),
            onset_step=60,
            window=5,
            max_epochs=6,
            config={"zero_input_every": 20, "zero_input_from": 60},
        ),
        Fault(
            "zero_transfer",
            "from step 63, every 3rd step the output of the first encoder layer (the hand-off to the second, as "
            "between two devices) arrives as zeros: the module's output is all zeros on those steps only",
            (ZERO_OUTPUT,),
            onset_step=63,
            window=15,  # measured every 5 steps (4, 9, ...): the corrupted steps 63, 66 are not sampled, 69 is
            max_epochs=5,
            config={"zero_transfer_every": 3, "zero_transfer_from": 63},
        ),
        Fault(
            "healthy_zero_init",
            "healthy counterpart of `zero_transfer`: a bottleneck adapter whose up-projection starts at zero "
            "(all-zero output until the first update, then trained away from zero)",
            (),
            max_epochs=3,
            config={"zero_init_adapter": True},
        ),
        Fault(
            "stall",
            "every 10th step also sleeps 1 s (about 80% of the time or more): a periodic I/O or synchronisation "
            "stall, watched by SystemMonitor",
            (STEP_TIME_PERIODIC,),
            onset_step=10,
            window=15,  # a pattern needs its second stall (step 20); SystemMonitor judges every 5 steps: step 25
            max_epochs=2,
            config={"stall_every": 10, "stall_seconds": 1.0},
            callbacks=(("SystemMonitor", {}),),
        ),
        Fault(
            "padding_labels",
            "a causal LM on right-padded batches whose padding keeps its labels (not -100): the loss trains the "
            "padding token",
            (LOSS_ON_PADDING,),
            onset_step=0,
            window=0,
            max_epochs=1,
            config={"model": "causal_lm"},
            data={"padded": True, "mask_padding_labels": False},
            callbacks=(("DataDiagnostics", _LM_DATA),),
        ),
        Fault(
            "healthy_padded_lm",
            "healthy counterpart of `padding_labels` and `val_longer`: right-padded batches, padding labels -100",
            (),
            max_epochs=2,
            config={"model": "causal_lm"},
            data={"padded": True},
            callbacks=(("DataDiagnostics", _LM_DATA),),
        ),
        Fault(
            "val_longer",
            "a causal LM validated on sequences of 41 tokens after training on 25: positions 25-40 were never trained",
            (POSITION_OVERFLOW,),
            onset_step=0,
            window=0,
            max_epochs=1,
            config={"model": "causal_lm"},
            data={"val_length": 40},
            callbacks=(("DataDiagnostics", _LM_DATA),),
        ),
        # -- loader faults (issue 35) ----------------------------------------------------------------------
        Fault(
            "batch_rows",
            "the collate_fn keeps the first row of the inputs and all 32 targets: one prediction is broadcast "
            "against every target, the MLP learns their mean",
            (BATCH_SIZE_MISMATCH,),
            onset_step=0,
            window=0,
            max_epochs=1,
            config={"model": "mlp", "d_model": 64, "head_depth": 2},
            data={"one_row_inputs": True},
            callbacks=(("DataDiagnostics", {}),),
        ),
        Fault(
            "worker_rng",
            "the dataset jitters its inputs with a numpy generator it holds, read by 2 workers without a "
            "worker_init_fn: both workers draw the same jitter",
            (WORKER_RNG_SHARED,),
            onset_step=0,
            window=0,
            max_epochs=1,
            config={"model": "mlp", "d_model": 64, "head_depth": 2},
            data={"jitter": 0.1, "num_workers": 2},
            callbacks=(("DataDiagnostics", {}),),
        ),
        Fault(
            "healthy_loader",
            "healthy counterpart of `batch_rows` and `worker_rng`: the jittering dataset read by 2 workers whose "
            "worker_init_fn reseeds its generator, collated whole",
            (),
            max_epochs=1,
            config={"model": "mlp", "d_model": 64, "head_depth": 2},
            data={"jitter": 0.1, "num_workers": 2, "reseed_workers": True},
            callbacks=(("DataDiagnostics", {}),),
        ),
        # -- training problems of the published detectors (issue 45, items 1-4) -----------------------------
        Fault(
            "vanish_plain",
            "a plain stack of 8 narrow sigmoid layers (width 16) on a binary task, AdamW at 1e-3: the first layer's "
            "relative gradient is 1e-7 of the last's, accuracy stays at the majority class",
            (GRAD_VANISH,),
            onset_step=0,
            window=20,
            max_epochs=2,
            config={"model": "plain_mlp", "head_depth": 8, "d_model": 16, "hidden_activation": "sigmoid", "lr": 1e-3},
        ),
        Fault(
            "healthy_plain_deep",
            "healthy counterpart of `vanish_plain`: the same 8 narrow layers with tanh",
            (),
            max_epochs=3,
            config={"model": "plain_mlp", "head_depth": 8, "d_model": 16, "hidden_activation": "tanh", "lr": 1e-3},
        ),
        Fault(
            "dead_relu",
            "a 34-layer ReLU MLP whose hidden biases start at -1: most units are inactive for every input and the "
            "gradient of most weights is exactly zero; accuracy stays at the majority class",
            (DEAD_UNITS,),
            onset_step=0,
            window=20,
            max_epochs=2,
            config={"model": "dead_relu_mlp", "head_depth": 34, "d_model": 32, "hidden_activation": "relu"},
        ),
        Fault(
            "healthy_deep_relu",
            "healthy counterpart of `dead_relu`: 34 residual ReLU blocks of the same width",
            (),
            max_epochs=2,
            config={"model": "residual_mlp", "head_depth": 34, "d_model": 32, "hidden_activation": "relu"},
        ),
        Fault(
            "healthy_sparse_relu",
            "healthy counterpart of `dead_relu`: a 4-layer ReLU MLP (width 64) whose activations are 30-50% zero",
            (),
            max_epochs=3,
            config={"model": "plain_mlp", "head_depth": 4, "d_model": 64, "hidden_activation": "relu"},
        ),
        Fault(
            "saturated_tanh",
            "a 3-layer tanh MLP fed inputs on a scale of 100 (not standardized): over 90% of the first tanh's inputs "
            "are beyond ±5",
            (ACTIVATION_SATURATION,),
            onset_step=0,
            window=20,
            max_epochs=2,
            config={"model": "plain_mlp", "head_depth": 3, "d_model": 32, "hidden_activation": "tanh"},
            data={"scale": 100.0},
        ),
        Fault(
            "healthy_tanh",
            "healthy counterpart of `saturated_tanh`: the same tanh MLP on standardized inputs",
            (),
            max_epochs=3,
            config={"model": "plain_mlp", "head_depth": 3, "d_model": 32, "hidden_activation": "tanh"},
        ),
        Fault(
            "tiny_lr",
            "a 2-layer ReLU MLP trained by AdamW at a learning rate of 1e-7 where it learns at 1e-3: each step moves "
            "the weights by 1e-7 of their norm, the loss does not fall",
            (UPDATE_TOO_SMALL,),
            onset_step=0,
            window=30,
            max_epochs=2,
            config={"model": "plain_mlp", "head_depth": 2, "d_model": 32, "hidden_activation": "relu", "lr": 1e-7},
        ),
        Fault(
            "healthy_lr",
            "healthy counterpart of `tiny_lr`: the same MLP at a learning rate of 1e-3",
            (),
            max_epochs=3,
            config={"model": "plain_mlp", "head_depth": 2, "d_model": 32, "hidden_activation": "relu", "lr": 1e-3},
        ),
        # -- the published problem classes of the outputs (issue 45) ---------------------------------------
        Fault(
            "label_scale",
            "a softmax classifier trained under an MSE against the class ids divided by 255: its units die and it "
            "predicts the same near-uniform output for every input, accuracy at chance",
            (OUTPUT_COLLAPSE,),
            onset_step=0,  # the labels are wrong from the first step: the outputs collapse from there (by step
            window=60,  # 15 to 55 depending on the data order: measured every 5 steps, 3 measurements in a row)
            max_epochs=4,
            config={"model": "blobs_label_scale", "d_model": 64, "head_depth": 2, "lr": 3e-2},
        ),
        Fault(
            "healthy_onehot_mse",
            "healthy counterpart of `label_scale`: the same softmax classifier under an MSE against one-hot labels",
            (),
            max_epochs=4,
            config={"model": "blobs_onehot_mse", "d_model": 64, "head_depth": 2, "lr": 3e-3},
        ),
        Fault(
            "single_softmax",
            "a binary classifier whose one output unit goes through a softmax: every prediction is exactly 1",
            (OUTPUT_COLLAPSE,),
            onset_step=0,
            window=14,  # measured at steps 4, 9, 14 (the logging cadence's; 0, 5, 10 before issue 43's hook set)
            max_epochs=2,
            config={"model": "blobs_single_softmax", "d_model": 64, "head_depth": 2},
        ),
        Fault(
            "healthy_sigmoid",
            "healthy counterpart of `single_softmax`: the one output unit goes through a sigmoid",
            (),
            max_epochs=4,
            config={"model": "blobs_sigmoid", "d_model": 64, "head_depth": 2},
        ),
        Fault(
            "healthy_confident",
            "healthy baseline: an MLP classifier trained to confidence near convergence (10 epochs)",
            (),
            max_epochs=10,
            config={"model": "blobs", "d_model": 64, "head_depth": 2},
        ),
        Fault(
            "healthy_denoiser",
            "healthy baseline: a generative model whose outputs vary little across a batch (a denoiser of a narrow "
            "cloud around a large offset)",
            (),
            max_epochs=4,
            config={"model": "blobs_denoiser", "d_model": 64, "head_depth": 2},
        ),
        Fault(
            "oscillation_bs1",
            "batch size 1, SGD with momentum 0.9 at a learning rate far too high (0.1) on a tanh MLP classifier: the "
            "loss and the accuracy swing from epoch to epoch",
            (LOSS_SWING,),
            onset_epoch=0,
            window=5,  # loss_swing needs 3 swinging epoch means in a row: 4 epochs at the earliest
            max_epochs=6,
            config={
                "model": "blobs",
                "d_model": 64,
                "head_depth": 2,
                "hidden_activation": "tanh",
                "optimizer": "sgd_momentum",
                "lr": 0.1,
            },
            data={"n_train": 64, "batch_size": 1},
        ),
        Fault(
            "healthy_bs1",
            "healthy counterpart of `oscillation_bs1`: batch size 1, SGD with momentum 0.9 at a learning rate of "
            "1e-3",
            (),
            max_epochs=6,
            config={
                "model": "blobs",
                "d_model": 64,
                "head_depth": 2,
                "hidden_activation": "tanh",
                "optimizer": "sgd_momentum",
                "lr": 1e-3,
            },
            data={"n_train": 64, "batch_size": 1},
        ),
        Fault(
            "attn_logit_growth",
            "a causal transformer LM without qk-layernorm at a learning rate of 0.1: the attention logits grow "
            "into the hundreds and the attention turns one-hot",
            (ATTN_LOGIT_GROWTH,),
            onset_step=0,
            window=15,
            max_epochs=2,
            config={"model": "lm_no_qk_norm", "lr": 0.1},
        ),
        Fault(
            "healthy_qk_norm",
            "healthy counterpart of `attn_logit_growth`: the same LM and learning rate with qk-layernorm",
            (),
            max_epochs=2,
            config={"model": "lm_qk_norm", "lr": 0.1},
        ),
    )
}


def build_fault(name: str, seed: int = 0) -> tuple[DemoModule, pl.LightningDataModule, Fault]:
    """The model, data module and fault entry for ``name``.

    Raises:
        ValueError: If ``name`` is not in :data:`FAULTS`.
    """
    if name not in FAULTS:
        raise ValueError(f"Expected argument `fault` to be one of {sorted(FAULTS)}, but got {name!r}")
    fault = FAULTS[name]
    config = dataclasses.replace(DemoConfig(seed=seed), **fault.config)
    if config.model in OUTPUT_SHAPES:  # the shapes of demo/output_models.py
        model_class, data_class = OUTPUT_SHAPES[config.model]
        return model_class(config), data_class(seed=seed, **fault.data), fault
    return build_model(config), DATA_MODULES[config.model](seed=seed, **fault.data), fault
