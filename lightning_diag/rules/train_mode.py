"""``eval_mode_in_training`` (framework-free): Dropout or BatchNorm modules left in eval mode while they train.

Fed by :class:`~lightning_diag.AnomalyAlarm` on logging steps of training with what it found (a host read of
``module.training`` flags, nothing on the device): ``{module name: kind}`` where kind is

* ``"dropout"``: a Dropout with ``p > 0`` in eval mode whose parent module has trainable parameters (Dropout has
  no parameters of its own: a Dropout inside a frozen part of the model is left alone);
* ``"batchnorm"``: a BatchNorm in eval mode whose own parameters train (or, without affine parameters, whose
  parent has trainable parameters): it normalises with running statistics that no longer follow the data;
* ``"batchnorm_frozen"``: a BatchNorm in eval mode whose parameters are ``requires_grad=False`` (deliberately
  frozen, a common fine-tuning choice): at most an ``info``.

Warnings for all modules at one check make one alert naming them (latched until none is left); frozen BatchNorms
make one ``info`` per fit.
"""

from __future__ import annotations

from lightning_diag.core.record import Alert, Severity
from lightning_diag.core.registry import RuleSpec, register
from lightning_diag.rules.base import Rule, StepContext
from lightning_diag.rules.measures import Measure, Measures

__all__ = ["EVAL_MODE_IN_TRAINING", "EVAL_MODE_IN_TRAINING_SPEC", "EvalModeRule"]

# -- declaration (the docs' thresholds table and the report read it) -------------------------------------------
EVAL_MODE_IN_TRAINING_SPEC = register(RuleSpec(
    "eval_mode_in_training", "AnomalyAlarm", "warning", None,
    "a Dropout or BatchNorm module of a trained part of the model in eval mode during training steps "
    "(a frozen BatchNorm: info)",
))
EVAL_MODE_IN_TRAINING = EVAL_MODE_IN_TRAINING_SPEC.rule_id

_SHOWN = 4
_KIND_NAMES = {"dropout": "Dropout", "batchnorm": "BatchNorm"}


def _names(modules: list[str]) -> str:
    shown = ", ".join(f"`{m or '<root>'}`" for m in modules[:_SHOWN])
    return shown + (f" and {len(modules) - _SHOWN} more" if len(modules) > _SHOWN else "")


class EvalModeRule(Rule):
    """``eval_mode_in_training``: one check of the modules' train/eval flags during training.

    Example:
        >>> rule = EvalModeRule()
        >>> m = Measures(eval_mode={"head.drop": "dropout"})
        >>> [(a.rule, a.severity) for a in rule.judge(StepContext(1, 40), m)]
        [('eval_mode_in_training', <Severity.WARNING: 'warning'>)]
        >>> rule.judge(StepContext(1, 45), m)  # still in eval mode: latched
        []
    """

    specs = (EVAL_MODE_IN_TRAINING_SPEC,)
    state_keys = ("checks",)
    needs = frozenset({Measure.EVAL_MODE})

    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one check (``{module name: kind}`` of the modules in eval mode); return the alerts raised."""
        found = m.eval_mode or {}
        self.checks += 1
        trained = sorted(k for k, v in found.items() if v in ("dropout", "batchnorm"))
        frozen = sorted(k for k, v in found.items() if v == "batchnorm_frozen")
        alerts = []
        if self.latch.update("trained", bool(trained)):
            kinds = " and ".join(_KIND_NAMES[k] for k in sorted({found[k] for k in trained}))
            alerts.append(
                self._alert(
                    ctx,
                    f"{len(trained)} {kinds} module(s) of trained parts of the model are in eval mode during "
                    f"training steps: {_names(trained)}; Dropout is off and BatchNorm uses frozen running "
                    "statistics, so the model trains differently from what the code says. Look for "
                    "`model.eval()` (or `.train(False)`) in a training hook such as `on_train_epoch_start`, or a "
                    "submodule switched off; call `self.train()` there instead",
                    source=trained[0] or "<root>",
                    value=float(len(trained)),
                    threshold=None,
                )
            )
        # deliberate freezing: reported once per fit (latched for good), never a warning
        if frozen and "frozen" not in self.latch.active:
            self.latch.update("frozen", True)
            alerts.append(
                self._alert(
                    ctx,
                    f"{len(frozen)} BatchNorm module(s) with frozen parameters (`requires_grad=False`) are in eval "
                    f"mode during training: {_names(frozen)}; a deliberately frozen BatchNorm, reported once as "
                    "information",
                    source=frozen[0] or "<root>",
                    value=float(len(frozen)),
                    threshold=None,
                    severity=Severity.INFO,
                )
            )
        return alerts
