"""AnomalyAlarm and every module only it uses.

* ``alarm.py``: :class:`AnomalyAlarm` (settings, declared rules and hooks, wiring the parts below) and
  :class:`NonFiniteError`.
* ``quiet.py``: its quiet batches (a base class of the alarm).
* ``nonfinite_guard.py``: the check before every update and the policy's verdicts; ``guard_pass.py``: its pass
  over one optimizer's parameters; ``nonfinite_recovery.py``: localisation, replay and rollback.
* ``loss_trend.py``: training-loss periods and validation trends; ``lr_logging.py``: the learning rates logged.
* ``runtime_checks.py``: the run-time checks, feeding ``zero_output_check.py``, ``output_collapse_check.py`` (both
  a ``sampled_check.py`` SampledCheck: a watch on sampled steps); ``silent_checks.py``: ``ddp_desync`` and
  ``eval_mode_in_training``.
"""

from lightning_diag.callbacks.anomaly_alarm.alarm import AnomalyAlarm, NonFiniteError

__all__ = ["AnomalyAlarm", "NonFiniteError"]
