"""The settings the gradient-flow detectors share (framework-free): ``grad.patience`` (declared in
:mod:`lightning_diag.rules.grad_frozen`, the first gradient module to load) and ``grad.warmup_steps``.

``grad.warmup_steps`` qualifies ``grad_vanish`` (:mod:`lightning_diag.rules.grad_norm_band`) and
``grad_layer_spread`` (:mod:`lightning_diag.rules.grad_layer_spread`), which each read it in ``from_settings``. It is
declared here, below both, so that neither detector's module imports the other's; its declaration names no rules
(like ``grad.patience``, any gradient-flow title may use ``{warmup_steps}``; only ``grad_vanish``'s does), since naming
them would make this module import theirs, which import it.
"""

from __future__ import annotations

from lightning_diag.core.registry import STEPS, SettingSpec, register_setting
from lightning_diag.rules.grad_frozen import GRAD_PATIENCE_SETTING, GRADIENT_FLOW

__all__ = ["DEFAULT_GRAD_PATIENCE", "DEFAULT_GRAD_WARMUP_STEPS", "GRAD_WARMUP_SETTING"]

#: ``grad.warmup_steps``: ``grad_vanish`` / ``grad_layer_spread`` are not evaluated before this global step
#: (initialisation transients); one setting for both rules.
GRAD_WARMUP_SETTING = register_setting(SettingSpec("grad.warmup_steps", GRADIENT_FLOW, 50, None, (), STEPS))
#: Consecutive measurements a gradient condition must hold before it alerts.
DEFAULT_GRAD_PATIENCE = int(GRAD_PATIENCE_SETTING.default)
#: ``grad_vanish`` / ``grad_layer_spread`` are not evaluated before this global step (initialisation transients).
DEFAULT_GRAD_WARMUP_STEPS = int(GRAD_WARMUP_SETTING.default)
