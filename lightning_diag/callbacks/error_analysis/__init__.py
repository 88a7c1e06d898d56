"""ErrorAnalysis and every module only it uses.

* ``analysis.py``: :class:`ErrorAnalysis`, judging the slices of the validation samples.
* ``samples.py``: reading and keeping those samples from the validation batches (``default_predictions`` is also
  how :class:`~lightning_diag.RobustnessProbe` reads a batch's predictions).
"""

from lightning_diag.callbacks.error_analysis.analysis import ErrorAnalysis

__all__ = ["ErrorAnalysis"]
