"""GradientFlowMonitor and every module only it uses.

* ``monitor.py``: :class:`GradientFlowMonitor` (settings, declared rules, cadence and hooks).
* ``params.py``: which parameters it measures (``params=``) and which cannot learn (``grad_frozen``).
* ``writes.py``: a measurement's ``diag/`` scalars and histograms, the update ratios after the step.
* ``silent_updates.py``: the ``update_none`` / ``update_stale`` / ``grad_not_zeroed`` sampling (a mixin).
"""

from lightning_diag.callbacks.gradient_flow.monitor import GradientFlowMonitor

__all__ = ["GradientFlowMonitor"]
