"""The validation-end probes and the base they share.

* ``probe.py``: ``ValidationProbe``, what the probes share (captured batches, the sandbox, rank-zero measurement).
* ``quantization.py``: :class:`QuantizationProbe`; ``sharpness.py``: :class:`SharpnessProbe`;
  ``robustness.py``: :class:`RobustnessProbe`.
"""

from lightning_diag.callbacks.probes.quantization import QuantizationProbe
from lightning_diag.callbacks.probes.robustness import RobustnessProbe
from lightning_diag.callbacks.probes.sharpness import SharpnessProbe

__all__ = ["QuantizationProbe", "RobustnessProbe", "SharpnessProbe"]
