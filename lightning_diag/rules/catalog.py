"""The complete catalogue: every rule-declaring module, loaded in one place, and the checklist rows.

Each rule is declared once, next to the class that implements it (``register(RuleSpec(...))`` at the top of its
``lightning_diag.rules`` module, set as the class's ``specs``); the machinery is in
:mod:`lightning_diag.core.registry`. Importing this module loads every declaring module, so the registry is
complete: :data:`ALL_RULES` is read here, and the report imports it. Its order (and every registry view's) is the
declaring modules' names, then the declaration order inside each module (:mod:`lightning_diag.core.registry`): it
does not depend on which module the process imported first (``tests/test_registry_order.py``). It then
registers the checklist rows of ``lightning-diag report`` in report order: a row that rules decide is declared
beside them (``*_CHECK`` in their module, its title a template over their thresholds), the rows no rule decides
here. Importing the rule modules also registers their rows' measure and replay functions
(:mod:`lightning_diag.rules.rows`): ``attn_entropy_band``'s are in :mod:`lightning_diag.rules.attention_entropy`,
beside the rule they replay (its row is declared in ``attention_specs``, which that module imports).

No module below it imports it (the registry does not): the import graph has no cycle. Neither torch nor Lightning
is imported (the rules modules import the standard library, numpy and scipy only).

A callback that adds rules declares them in its rules module and adds that module to the imports below (and its
``*_CHECK`` to the rows registered below, for a checklist row of its own).
"""

from __future__ import annotations

from collections.abc import Mapping

from lightning_diag.core.registry import OWNERS, CheckSpec, register_check
from lightning_diag.rules import attention_entropy as _attention_entropy  # noqa: F401  (attn_entropy_band's row)
from lightning_diag.rules.activations import (
    ACTIVATION_SATURATION,
    ACTIVATIONS_IN_RANGE_CHECK,
    DEAD_UNITS,
    UNITS_ALIVE_CHECK,
)
from lightning_diag.rules.amp_not_applied import AMP_NOT_APPLIED
from lightning_diag.rules.attention_logits import ATTN_LOGIT_GROWTH, ATTN_LOGITS_CHECK
from lightning_diag.rules.attention_specs import (
    ATTN_ENTROPY_BAND_CHECK,
    ATTN_ENTROPY_HIGH,
    ATTN_ENTROPY_LOW,
    ATTN_SINK,
    ATTN_SINK_CHECK,
)
from lightning_diag.rules.data_loader import BATCH_SIZE_MISMATCH, WORKER_RNG_SHARED
from lightning_diag.rules.data_sample import (
    DATA_LEAKAGE,
    DATA_NONFINITE,
    DATA_VOCAB_SHIFT,
    LABEL_BALANCE_CHECK,
    LABEL_IMBALANCE,
    TRAIN_TEST_OVERLAP_CHECK,
)
from lightning_diag.rules.data_sequences import LOSS_ON_PADDING, POSITION_OVERFLOW
from lightning_diag.rules.dataloader_bound import DATALOADER_BOUND
from lightning_diag.rules.errors import ERROR_CLUSTER, ERROR_CONCENTRATION_CHECK
from lightning_diag.rules.eval_before_training import EVAL_BEFORE_TRAINING
from lightning_diag.rules.eval_randomness import EVAL_RANDOMNESS
from lightning_diag.rules.grad_collapse import GRAD_COLLAPSE, GRAD_COLLAPSE_CHECK
from lightning_diag.rules.grad_frozen import GRAD_FROZEN
from lightning_diag.rules.grad_layer_spread import GRAD_LAYER_SPREAD, GRAD_SPREAD_CHECK
from lightning_diag.rules.grad_norm_band import GRAD_EXPLODE, GRAD_NORM_BAND_CHECK, GRAD_VANISH
from lightning_diag.rules.grad_not_zeroed import GRAD_NOT_ZEROED
from lightning_diag.rules.loss_outlier import LOSS_OUTLIER
from lightning_diag.rules.loss_stagnant import LOSS_STAGNANT
from lightning_diag.rules.loss_swing import LOSS_SWING, LOSS_SWING_CHECK
from lightning_diag.rules.memory_growth import MEMORY_GROWTH
from lightning_diag.rules.nonfinite import NONFINITE_GRAD, NONFINITE_LOSS
from lightning_diag.rules.output_collapse import OUTPUT_COLLAPSE, OUTPUTS_VARY_CHECK
from lightning_diag.rules.quantization_error import QUANTIZATION_CHECK, QUANTIZATION_ERROR
from lightning_diag.rules.replicas import DDP_DESYNC, REPLICAS_AGREE_CHECK
from lightning_diag.rules.robustness import ROBUSTNESS_CHECK, ROBUSTNESS_DROP
from lightning_diag.rules.rollback import NONFINITE_ROLLBACK
from lightning_diag.rules.sharp_minimum import LOSS_SURFACE_CHECK, SHARP_MINIMUM
from lightning_diag.rules.step_time_fluctuation import LATENCY_FLUCTUATION_CHECK, STEP_TIME_FLUCTUATION
from lightning_diag.rules.step_time_periodic import STEP_TIME_PERIODIC
from lightning_diag.rules.train_mode import EVAL_MODE_IN_TRAINING
from lightning_diag.rules.train_override_bypassed import TRAIN_OVERRIDE_BYPASSED
from lightning_diag.rules.update_size import UPDATE_SIZE_CHECK, UPDATE_TOO_SMALL
from lightning_diag.rules.updates_applied import UPDATE_NONE, UPDATE_STALE, UPDATES_APPLIED_CHECK
from lightning_diag.rules.val_decline import VAL_DECLINE, VAL_DECLINE_CHECK
from lightning_diag.rules.val_fluctuation import VAL_FLUCTUATION, VAL_FLUCTUATION_CHECK
from lightning_diag.rules.zero_output import ZERO_OUTPUT

__all__ = [
    "ACTIVATION_SATURATION",
    "ALL_RULES",
    "AMP_NOT_APPLIED",
    "ATTN_ENTROPY_HIGH",
    "ATTN_ENTROPY_LOW",
    "ATTN_LOGIT_GROWTH",
    "ATTN_SINK",
    "BATCH_SIZE_MISMATCH",
    "DATALOADER_BOUND",
    "DATA_LEAKAGE",
    "DATA_NONFINITE",
    "DATA_VOCAB_SHIFT",
    "DDP_DESYNC",
    "DEAD_UNITS",
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
    "OUTPUT_COLLAPSE",
    "POSITION_OVERFLOW",
    "QUANTIZATION_ERROR",
    "ROBUSTNESS_DROP",
    "SHARP_MINIMUM",
    "STEP_TIME_FLUCTUATION",
    "STEP_TIME_PERIODIC",
    "TRAIN_OVERRIDE_BYPASSED",
    "UPDATE_NONE",
    "UPDATE_STALE",
    "UPDATE_TOO_SMALL",
    "VAL_DECLINE",
    "VAL_FLUCTUATION",
    "WORKER_RNG_SHARED",
    "ZERO_OUTPUT",
]

#: Every rule id, mapped to the callback that raises it: a live view of the rule registry
#: (:mod:`lightning_diag.core.registry`), complete since this module loads every declaring module.
ALL_RULES: Mapping[str, str] = OWNERS

# -- checklist rows -------------------------------------------------------------------------------------
# Seed 000 §7.1's layered checklist plus the training-process checks, in report order. A row that rules decide is
# declared next to them (its title is a template over their thresholds in effect, written where they are
# declared); a rule joins its row with `RuleSpec(check=...)`. The rows no rule decides are declared here.

for _row in (
    LABEL_BALANCE_CHECK,
    TRAIN_TEST_OVERLAP_CHECK,
    GRAD_NORM_BAND_CHECK,
    GRAD_SPREAD_CHECK,
    GRAD_COLLAPSE_CHECK,
    UNITS_ALIVE_CHECK,
    ACTIVATIONS_IN_RANGE_CHECK,
    OUTPUTS_VARY_CHECK,
    ATTN_ENTROPY_BAND_CHECK,
    ATTN_SINK_CHECK,
    ATTN_LOGITS_CHECK,
    CheckSpec(
        "attn_range", "Model", "Attention range: the heads that read long-range and the purely local ones (information)"
    ),
    CheckSpec("nonfinite", "Training", "No NaN/Inf in the loss or the gradients"),
    LOSS_SWING_CHECK,
    VAL_DECLINE_CHECK,
    VAL_FLUCTUATION_CHECK,
    UPDATE_SIZE_CHECK,
    QUANTIZATION_CHECK,
    LATENCY_FLUCTUATION_CHECK,
    LOSS_SURFACE_CHECK,
    ERROR_CONCENTRATION_CHECK,
    ROBUSTNESS_CHECK,
    UPDATES_APPLIED_CHECK,
    REPLICAS_AGREE_CHECK,
):
    register_check(_row)
