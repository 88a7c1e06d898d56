"""DataDiagnostics and every module only it uses.

* ``diagnostics.py``: :class:`DataDiagnostics` (settings, declared rules, the checks before training).
* ``batch.py``: reading a loader's data without touching the training run.
* ``sample.py``: what it keeps of one split's sample, and the measurement made from two.
"""

from lightning_diag.callbacks.data_diagnostics.diagnostics import DataDiagnostics

__all__ = ["DataDiagnostics"]
