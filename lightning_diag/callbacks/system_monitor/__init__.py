"""SystemMonitor, its SystemProfiler and every module only they use.

* ``monitor.py``: :class:`SystemMonitor` (settings, declared rules and hooks).
* ``profiler.py``: :class:`SystemProfiler`, what Lightning does around the batches, through its profiler
  interface.
* ``hooks.py``: timing the lightning_diag callbacks' own hooks (and their attention recorders).
* ``steps.py``: what is recorded during the steps; ``interval.py``: one logging interval's values;
  ``windows.py``: the step-time windows the step-time tests judge.
"""

from lightning_diag.callbacks.system_monitor.monitor import SystemMonitor, SystemProfiler

__all__ = ["SystemMonitor", "SystemProfiler"]
