"""The complete catalogue: every rule-declaring module, loaded in one place, and the checklist rows.

Each rule is declared once, next to the class that implements it (``register(RuleSpec(...))`` at the top of its
``lightning_diag.rules`` module, set as the class's ``specs``); the machinery is in
:mod:`lightning_diag.core.registry`. Importing this module loads every declaring module, so the registry is
complete: :data:`ALL_RULES` is read here, and the report imports it. It then declares the checklist rows of
``lightning-diag report``, in report order; a row that is named after the rule deciding it takes that rule's id
from its declaration.

No module below it imports it (the registry does not): the import graph has no cycle. Neither torch nor Lightning
is imported (the rules modules import the standard library, numpy and scipy only).

A callback that adds rules declares them in its rules module and adds that module to the imports below (and a
``register_check(CheckSpec(...))`` here for a checklist row of its own).
"""

from __future__ import annotations

from collections.abc import Mapping

from lightning_diag.core.registry import OWNERS, CheckSpec, register_check
from lightning_diag.rules.anomaly import LOSS_STAGNANT, LOSS_SWING, VAL_DECLINE, VAL_FLUCTUATION
from lightning_diag.rules.attention_specs import ATTN_ENTROPY_HIGH, ATTN_ENTROPY_LOW, ATTN_SINK
from lightning_diag.rules.data import (
    BATCH_SIZE_MISMATCH,
    DATA_LEAKAGE,
    DATA_NONFINITE,
    DATA_VOCAB_SHIFT,
    LABEL_IMBALANCE,
    WORKER_RNG_SHARED,
)
from lightning_diag.rules.data_sequences import LOSS_ON_PADDING, POSITION_OVERFLOW
from lightning_diag.rules.errors import ERROR_CLUSTER
from lightning_diag.rules.grad import GRAD_COLLAPSE, GRAD_EXPLODE, GRAD_LAYER_SPREAD, GRAD_VANISH
from lightning_diag.rules.grad_frozen import GRAD_FROZEN

# isort: off  (the registry keeps declaration order: the order below is the order of ALL_RULES)
from lightning_diag.rules.nonfinite import NONFINITE_GRAD, NONFINITE_LOSS
from lightning_diag.rules.probes import QUANTIZATION_ERROR, SHARP_MINIMUM
from lightning_diag.rules.replicas import DDP_DESYNC
from lightning_diag.rules.robustness import ROBUSTNESS_DROP
from lightning_diag.rules.rollback import NONFINITE_ROLLBACK
from lightning_diag.rules.runtime import (
    AMP_NOT_APPLIED,
    EVAL_BEFORE_TRAINING,
    EVAL_RANDOMNESS,
    LOSS_OUTLIER,
    TRAIN_OVERRIDE_BYPASSED,
    ZERO_OUTPUT,
)
from lightning_diag.rules.system import DATALOADER_BOUND, MEMORY_GROWTH, STEP_TIME_FLUCTUATION, STEP_TIME_PERIODIC
from lightning_diag.rules.train_mode import EVAL_MODE_IN_TRAINING
from lightning_diag.rules.updates import GRAD_NOT_ZEROED, UPDATE_NONE, UPDATE_STALE

# isort: on

__all__ = [
    "ALL_RULES",
    "AMP_NOT_APPLIED",
    "ATTN_ENTROPY_HIGH",
    "ATTN_ENTROPY_LOW",
    "ATTN_SINK",
    "BATCH_SIZE_MISMATCH",
    "DATALOADER_BOUND",
    "DATA_LEAKAGE",
    "DATA_NONFINITE",
    "DATA_VOCAB_SHIFT",
    "DDP_DESYNC",
    "ERROR_CLUSTER",
    "EVAL_BEFORE_TRAINING",
    "EVAL_MODE_IN_TRAINING",
    "EVAL_RANDOMNESS",
    "GRAD_COLLAPSE",
    "GRAD_EXPLODE",
    "GRAD_FROZEN",
    "GRAD_LAYER_SPREAD",
    "GRAD_NOT_ZEROED",
    "GRAD_VANISH",
    "LABEL_IMBALANCE",
    "LOSS_ON_PADDING",
    "LOSS_OUTLIER",
    "LOSS_STAGNANT",
    "LOSS_SWING",
    "MEMORY_GROWTH",
    "NONFINITE_GRAD",
    "NONFINITE_LOSS",
    "NONFINITE_ROLLBACK",
    "POSITION_OVERFLOW",
    "QUANTIZATION_ERROR",
    "ROBUSTNESS_DROP",
    "SHARP_MINIMUM",
    "STEP_TIME_FLUCTUATION",
    "STEP_TIME_PERIODIC",
    "TRAIN_OVERRIDE_BYPASSED",
    "UPDATE_NONE",
    "UPDATE_STALE",
    "VAL_DECLINE",
    "VAL_FLUCTUATION",
    "WORKER_RNG_SHARED",
    "ZERO_OUTPUT",
]

#: Every rule id, mapped to the callback that raises it: a live view of the rule registry
#: (:mod:`lightning_diag.core.registry`), complete since this module loads every declaring module.
ALL_RULES: Mapping[str, str] = OWNERS

# -- checklist rows -------------------------------------------------------------------------------------
# Seed 000 §7.1's layered checklist plus the training-process checks, in report order. A rule joins a row with
# `RuleSpec(check=...)`; a row no rule decides yet is "not measured" with the seed's criterion
# (`CheckSpec(threshold=..., threshold_value=...)`). Titles are templates over the thresholds in effect.

register_check(CheckSpec("data_label_balance", "Data",
                         "Label distribution standard deviation < {label_imbalance:g}"))
register_check(CheckSpec("data_train_test_overlap", "Data",
                         "Train/test Jaccard similarity < {data_leakage:g}"))
register_check(CheckSpec("grad_norm_band", "Model",
                         "Gradient of every layer within {grad_vanish:g} (||g||/||W||) .. {grad_explode:g} "
                         "(RMS per element)"))
register_check(CheckSpec("grad_spread", "Model",
                         "Relative gradients of one role across blocks within a ratio of {grad_layer_spread:g}"))
register_check(CheckSpec(GRAD_COLLAPSE, "Model",
                         "Blocks' gradient norm above {grad_collapse:g} of its early baseline"))
register_check(CheckSpec(
    "attn_entropy_band", "Model",
    "Attention entropy of every head above {attn_entropy_low:g} nats, and not above {attn_entropy_high:g} nats "
    "while near uniform ({attn_entropy_high__uniform_fraction:g} of it) "
    "after step {attn_entropy_high__warmup_steps:g}",
))
register_check(CheckSpec(ATTN_SINK, "Model",
                         "No layer whose every head puts more than {attn_sink:g} of its mass on [CLS]/[SEP]"))
register_check(CheckSpec("attn_range", "Model",
                         "Attention range: the heads that read long-range and the purely local ones (information)"))
register_check(CheckSpec("nonfinite", "Training", "No NaN/Inf in the loss or the gradients"))
register_check(CheckSpec(
    LOSS_SWING, "Training",
    "Training loss does not swing by more than {loss_swing:.0%} on {loss_swing__patience:g} consecutive points",
))
register_check(CheckSpec(VAL_DECLINE, "Training",
                         "Validation metric does not worsen on {val_decline:g} consecutive runs"))
register_check(CheckSpec(
    VAL_FLUCTUATION, "Training", "Validation fluctuation at most {val_fluctuation:g}x the training fluctuation"
))
register_check(CheckSpec("deploy_quantization_error", "Deployment",
                         "Quantization error < {quantization_error:.0%} (INT8 end-to-end loss change; no layer's "
                         "output MSE above {quantization_error__layer_ratio:g}x the median layer's)"))
register_check(CheckSpec("deploy_latency_fluctuation", "Deployment",
                         "Latency fluctuation < {step_time_fluctuation:.0%}"))
register_check(CheckSpec("loss_surface", "Training",
                         "Loss surface: SAM gap L(w+ε) − L(w) not above {sharp_minimum:g} on "
                         "{sharp_minimum__patience:g} consecutive probes (rho {sharp_minimum__rho:g})"))
register_check(CheckSpec("error_concentration", "Model",
                         "Error concentration: no cluster of validation samples with an error rate at least "
                         "{error_cluster:g}x the overall rate holding {error_cluster__min_share:.0%} of them"))
register_check(CheckSpec("robustness", "Model",
                         "Robustness ({robustness_drop__rate:.0%} perturbation): the validation metric drops by at "
                         "most {robustness_drop:.0%}"))
register_check(CheckSpec("updates_applied", "Training",
                         "Optimizer steps change every trained parameter (no sampled layer left unchanged; at most "
                         "{update_stale:.0%} of a low-precision layer's sampled elements unchanged)"))
register_check(CheckSpec("replicas_agree", "Training",
                         "Data-parallel replicas hold the same parameters (checksum relative difference at most "
                         "{ddp_desync:g}, every {ddp_desync__every_n_steps:g} steps)"))
