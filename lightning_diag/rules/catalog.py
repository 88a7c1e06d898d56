"""The declarations: every checklist row and every rule of the library, one block per callback.

The machinery (:class:`~lightning_diag.core.registry.RuleSpec`, :func:`~lightning_diag.core.registry.register`,
the queries) is in :mod:`lightning_diag.core.registry`, which imports this module once, at its end, so that
importing the registry always gives the complete catalogue. Standard library only, like the registry.

A callback that adds rules appends one block at the end: ``register(RuleSpec(...))`` per rule id, and
``register_check(CheckSpec(...))`` for a checklist row of its own.
"""

from __future__ import annotations

from lightning_diag.core.registry import (
    CheckSpec,
    RuleSpec,
    SettingSpec,
    register,
    register_check,
    register_setting,
)

# -- checklist rows -------------------------------------------------------------------------------------
# Seed 000 §7.1's layered checklist plus the training-process checks, in report order. A rule joins a row with
# `RuleSpec(check=...)`; rows no rule decides yet are "not measured" with the seed's criterion.

register_check(CheckSpec("data_label_balance", "Data", "Label distribution standard deviation < 0.1", "< 0.1", 0.1))
register_check(CheckSpec("data_train_test_overlap", "Data", "Train/test Jaccard similarity < 0.15", "< 0.15", 0.15))
register_check(CheckSpec("grad_norm_band", "Model",
                         "Gradient of every layer within {grad_vanish:g} (||g||/||W||) .. {grad_explode:g} "
                         "(RMS per element)"))
register_check(CheckSpec("grad_spread", "Model",
                         "Relative gradients of one role across blocks within a ratio of {grad_layer_spread:g}"))
register_check(CheckSpec("grad_collapse", "Model",
                         "Blocks' gradient norm above {grad_collapse:g} of its early baseline"))
register_check(CheckSpec(
    "attn_entropy_band", "Model",
    "Attention entropy of every head above {attn_entropy_low:g} nats, and not above {attn_entropy_high:g} nats "
    "while near uniform ({attn_entropy_high__uniform_fraction:g} of it) "
    "after step {attn_entropy_high__warmup_steps:g}",
))
register_check(CheckSpec("attn_sink", "Model",
                         "No layer whose every head puts more than {attn_sink:g} of its mass on [CLS]/[SEP]"))
register_check(CheckSpec("nonfinite", "Training", "No NaN/Inf in the loss or the gradients"))
register_check(CheckSpec(
    "loss_swing", "Training",
    "Training loss does not swing by more than {loss_swing:.0%} on {loss_swing__patience:g} consecutive points",
))
register_check(CheckSpec("val_decline", "Training",
                         "Validation metric does not worsen on {val_decline:g} consecutive runs"))
register_check(CheckSpec(
    "val_fluctuation", "Training", "Validation fluctuation at most {val_fluctuation:g}x the training fluctuation"
))
register_check(CheckSpec("deploy_quantization_error", "Deployment",
                         "Quantization error < {quantization_error:.0%} (INT8 end-to-end loss change; no layer's "
                         "output MSE above {quantization_error__layer_ratio:g}x the median layer's)"))
register_check(CheckSpec("deploy_latency_fluctuation", "Deployment", "Latency fluctuation < 15%", "< 15%", 0.15))

# -- declarations ---------------------------------------------------------------------------------------------
# One block per callback. Defaults are the seeds' numbers (DESIGN.md's thresholds table); the rules/ modules'
# DEFAULT_* constants are these values, read from here.

_ALARM = "AnomalyAlarm"
register(RuleSpec("nonfinite_loss", _ALARM, "critical", None, "NaN/Inf in the loss", check="nonfinite",
                  source="seed 000 §4.2"))
register(RuleSpec("nonfinite_grad", _ALARM, "critical", None, "NaN/Inf in a gradient before the optimizer step",
                  settings={"max_scaler_overflows": 5}, check="nonfinite", source="seed 000 §4.2",
                  arguments={"max_scaler_overflows": "max_scaler_overflows"}))
register(RuleSpec("loss_swing", _ALARM, "warning", 0.10,
                  "training loss swings by more than {threshold:.0%} on {patience:g} consecutive epochs",
                  settings={"patience": 3, "min_delta": 1e-3}, check="loss_swing", source="seed 001 §1.2",
                  arguments={"threshold": "swing_threshold", "patience": "swing_patience",
                             "min_delta": "swing_min_delta"}))
register(RuleSpec("val_decline", _ALARM, "warning", 5.0,
                  "validation metric worsens on {threshold:g} consecutive validation runs",
                  settings={"min_delta": 0.0}, check="val_decline", source="seed 001 §1.2",
                  arguments={"threshold": "val_decline_patience", "min_delta": "val_decline_min_delta"}))
register(RuleSpec("val_fluctuation", _ALARM, "warning", 2.0,
                  "validation-loss fluctuation above {threshold:g}x the training-loss fluctuation",
                  settings={"window": 5, "min": 0.15, "min_range": 0.01}, check="val_fluctuation",
                  source="seed 000 §4.1",
                  arguments={"threshold": "val_fluctuation_ratio", "window": "val_fluctuation_window",
                             "min": "val_fluctuation_min", "min_range": "val_fluctuation_min_range"}))
register(RuleSpec("loss_stagnant", _ALARM, "warning", 0.10,
                  "training loss has not fallen {threshold:.0%} below its initial value after {patience:g} points",
                  settings={"patience": 4, "baseline_steps": 5},
                  arguments={"threshold": "stagnant_min_drop", "patience": "stagnant_patience",
                             "baseline_steps": "stagnant_baseline_steps"}))

_GRAD = "GradientFlowMonitor"
register(RuleSpec("grad_vanish", _GRAD, "warning", 1e-3,
                  "a weight matrix's ||g||/||W|| below {threshold:g} and {relative:g}x below the best-fed block "
                  "matrix, after step {warmup_steps:g}",
                  settings={"relative": 100.0, "warmup_steps": 50}, check="grad_norm_band", source="seed 000 §3.1",
                  arguments={"threshold": "vanish_threshold", "warmup_steps": "warmup_steps"}))
register(RuleSpec("grad_explode", _GRAD, "warning", 1e1, "a layer's RMS gradient per element above {threshold:g}",
                  check="grad_norm_band", source="seed 000 §3.1", arguments={"threshold": "explode_threshold"}))
register(RuleSpec("grad_layer_spread", _GRAD, "warning", 100.0,
                  "largest / smallest ||g||/||W|| of one role across blocks above {threshold:g}",
                  settings={"warmup_steps": 50}, check="grad_spread", source="seed 000 §3.1",
                  arguments={"threshold": "spread_ratio", "warmup_steps": "warmup_steps"}))
register(RuleSpec("grad_collapse", _GRAD, "warning", 0.01,
                  "blocks' gradient norm below {threshold:g} of its early baseline (converged: info; dead or "
                  "vanished: warning)",
                  settings={"baseline_measurements": 5, "converged_fraction": 0.1}, check="grad_collapse",
                  source="seed 001 §1.2",
                  arguments={"threshold": "collapse_ratio", "baseline_measurements": "baseline_measurements",
                             "converged_fraction": "converged_fraction"}))
register(RuleSpec("grad_frozen", _GRAD, "warning", None,
                  "a trainable parameter that cannot learn (in no optimizer, or never gets a gradient); "
                  "requires_grad=False is an info"))
register_setting(SettingSpec("grad.patience", _GRAD, 3, "patience",
                             ("grad_vanish", "grad_layer_spread", "grad_collapse", "grad_frozen")))

_ATTN = "AttentionEntropyMonitor"
register(RuleSpec("attn_entropy_low", _ATTN, "warning", 0.5, "a head's attention entropy below {threshold:g} nats",
                  check="attn_entropy_band", source="seed 000 §3.2", arguments={"threshold": "entropy_low"}))
register(RuleSpec("attn_entropy_high", _ATTN, "info", 2.5,
                  "a head's attention entropy above {threshold:g} nats and {uniform_fraction:g} of uniform",
                  settings={"uniform_fraction": 0.9, "warmup_steps": 200}, check="attn_entropy_band",
                  source="seed 000 §3.2",
                  arguments={"threshold": "entropy_high", "uniform_fraction": "uniform_fraction",
                             "warmup_steps": "warmup_steps"}))
register(RuleSpec("attn_sink", _ATTN, "warning", 0.5,
                  "every head of a layer puts more than {threshold:g} of its mass on special tokens",
                  check="attn_sink", source="seed 000 §3.2", arguments={"threshold": "sink_mass"}))
register_setting(SettingSpec("attn.patience", _ATTN, 2, "patience",
                             ("attn_entropy_low", "attn_entropy_high", "attn_sink")))

_DATA = "DataDiagnostics"
register(RuleSpec("data_vocab_shift", _DATA, "warning", 0.3,
                  "KL divergence of validation vs training token frequencies above {threshold:g} nats",
                  settings={"min_count": 5}, source="seed 000 §2.1",
                  arguments={"threshold": "vocab_kl", "min_count": "min_count"}))
register(RuleSpec("data_leakage", _DATA, "warning", 0.15,
                  "share of validation samples copying a training sample (shingle Jaccard >= {near_duplicate:g}) "
                  "at or above {threshold:g}",
                  settings={"near_duplicate": 0.5, "shingle_size": 3}, check="data_train_test_overlap",
                  source="seed 000 §2.2, §7.1",
                  arguments={"threshold": "leakage", "near_duplicate": "near_duplicate",
                             "shingle_size": "shingle_size"}))
register(RuleSpec("label_imbalance", _DATA, "warning", 0.1,
                  "standard deviation of the class proportions above {threshold:g}", check="data_label_balance",
                  source="seed 000 §7.1", arguments={"threshold": "label_std"}))
register(RuleSpec("data_nonfinite", _DATA, "critical", None, "NaN/Inf in a floating tensor of a sampled batch",
                  source="seed 000 §2.1"))

_SHARP = "SharpnessProbe"
register_check(CheckSpec("loss_surface", "Training",
                         "Loss surface: SAM gap L(w+ε) − L(w) not above {sharp_minimum:g} on "
                         "{sharp_minimum__patience:g} consecutive probes (rho {sharp_minimum__rho:g})"))
register(RuleSpec("sharp_minimum", _SHARP, "warning", 0.3,
                  "SAM gap L(w+ε) − L(w) above {threshold:g} (rho {rho:g}) on {patience:g} consecutive probes",
                  settings={"rho": 0.05, "patience": 3}, check="loss_surface", source="seed 000 §4.1",
                  arguments={"threshold": "threshold", "rho": "rho", "patience": "patience"}))
_QUANT = "QuantizationProbe"
register(RuleSpec("quantization_error", _QUANT, "warning", 0.05,
                  "INT8 end-to-end relative loss change above {threshold:.0%}, or a layer's output MSE above "
                  "{layer_ratio:g}x the median layer's",
                  settings={"layer_ratio": 10.0, "min_layer_error": 1e-3}, check="deploy_quantization_error",
                  source="seed 000 §5.1, §7.1",
                  arguments={"threshold": "threshold", "layer_ratio": "layer_ratio",
                             "min_layer_error": "min_layer_error"}))

# AnomalyAlarm(on_nonfinite="rollback") (issue 12): the rollback warning; settings are the rollback arguments.
register(RuleSpec("nonfinite_rollback", _ALARM, "warning", None,
                  "a non-finite step rolled back to a snapshot, learning rates x{lr_factor:g} per rollback",
                  settings={"every_n_steps": 50, "lr_factor": 0.5, "max_rollbacks": 3}, check="nonfinite",
                  arguments={"every_n_steps": "rollback_every_n_steps", "lr_factor": "rollback_lr_factor",
                             "max_rollbacks": "max_rollbacks"}))

_SYSTEM = "SystemMonitor"
register(RuleSpec("dataloader_bound", _SYSTEM, "warning", 0.25,
                  "waiting for data above {threshold:.0%} of the step time on {patience:g} consecutive intervals",
                  settings={"patience": 3, "min_wait_s": 0.005},
                  arguments={"threshold": "dataloader_share", "patience": "dataloader_patience",
                             "min_wait_s": "dataloader_min_wait_s"}))
register(RuleSpec("step_time_periodic", _SYSTEM, "warning", 0.05,
                  "slow steps (more than {slow_ratio:.0%} above the median) recurring with a fixed period and costing"
                  " above {threshold:.0%} of the time",
                  settings={"slow_ratio": 0.5, "window": 200}, source="seed 001 §1.2",
                  arguments={"threshold": "periodic_share", "slow_ratio": "slow_ratio", "window": "window"}))
register(RuleSpec("step_time_fluctuation", _SYSTEM, "warning", 0.15,
                  "step-time fluctuation (median absolute deviation / median of {block_steps:g}-step block medians)"
                  " above {threshold:.0%}",
                  settings={"patience": 3, "warmup_steps": 20, "block_steps": 10}, check="deploy_latency_fluctuation",
                  source="seed 000 §7.1",
                  arguments={"threshold": "fluctuation_threshold", "patience": "fluctuation_patience",
                             "warmup_steps": "warmup_steps", "block_steps": "block_steps"}))
register(RuleSpec("memory_growth", _SYSTEM, "warning", 0.1,
                  "host or device memory growing by more than {threshold:.0%} over {window:g} intervals",
                  settings={"window": 8, "rising_fraction": 0.7},
                  arguments={"threshold": "memory_growth", "window": "memory_window",
                             "rising_fraction": "memory_rising_fraction"}))

# -- silent training errors (issue 22; DESIGN.md's issue 19) ---------------------------------------------------
# The rule ids are spelled here once; rules/, callbacks/ and the fault library import these constants.
UPDATE_NONE = "update_none"
UPDATE_STALE = "update_stale"
GRAD_NOT_ZEROED = "grad_not_zeroed"
DDP_DESYNC = "ddp_desync"
EVAL_MODE_IN_TRAINING = "eval_mode_in_training"
LOSS_ON_PADDING = "loss_on_padding"
POSITION_OVERFLOW = "position_overflow"

register_check(CheckSpec("updates_applied", "Training",
                         "Optimizer steps change every trained parameter (no sampled layer left unchanged; at most "
                         "{update_stale:.0%} of a low-precision layer's sampled elements unchanged)"))
register_check(CheckSpec("replicas_agree", "Training",
                         "Data-parallel replicas hold the same parameters (checksum relative difference at most "
                         "{ddp_desync:g}, every {ddp_desync__every_n_steps:g} steps)"))

register(RuleSpec(UPDATE_NONE, _GRAD, "warning", None,
                  "a parameter with non-zero gradients that {patience:g} consecutive measured optimizer steps leave "
                  "unchanged (every one of its {sample_size:g} sampled elements)",
                  settings={"patience": 3, "sample_size": 32}, check="updates_applied",
                  arguments={"patience": "patience", "sample_size": "update_sample_size"}))

register(RuleSpec(UPDATE_STALE, _GRAD, "warning", 0.5,
                  "a bf16/fp16 parameter whose measured optimizer steps leave more than {threshold:.0%} of the "
                  "sampled elements with a non-zero gradient unchanged (updates round to zero), on {patience:g} "
                  "consecutive measurements",
                  settings={"patience": 3}, check="updates_applied",
                  arguments={"threshold": "stale_fraction", "patience": "patience"}))

register(RuleSpec(GRAD_NOT_ZEROED, _GRAD, "warning", None,
                  "the gradients an optimizer step applied are still in `.grad` at the next backward (no "
                  "`zero_grad` between them)"))

register(RuleSpec(DDP_DESYNC, _ALARM, "critical", 1e-6,
                  "a parameter's checksum differs across data-parallel replicas by more than {threshold:g} "
                  "(relative), checked every {every_n_steps:g} optimizer steps",
                  settings={"every_n_steps": 100}, check="replicas_agree",
                  arguments={"threshold": "desync_tolerance", "every_n_steps": "desync_every_n_steps"}))

register(RuleSpec(EVAL_MODE_IN_TRAINING, _ALARM, "warning", None,
                  "a Dropout or BatchNorm module of a trained part of the model in eval mode during training steps "
                  "(a frozen BatchNorm: info)"))

register(RuleSpec(LOSS_ON_PADDING, _DATA, "warning", 0.0,
                  "share of the label positions of sampled training batches that are padding (attention mask 0) "
                  "yet carry a label other than -100, above {threshold:g}",
                  arguments={"threshold": "padding_labels"}))

register(RuleSpec(POSITION_OVERFLOW, _DATA, "warning", 1.0,
                  "sequences longer than {threshold:g}x the longest training sequence seen (validation, or a later "
                  "training measurement), or longer than the model's position capacity",
                  arguments={"threshold": "length_ratio"}))
