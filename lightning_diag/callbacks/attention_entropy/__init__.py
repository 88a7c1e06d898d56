"""AttentionEntropyMonitor and every module only it uses.

* ``monitor.py``: :class:`AttentionEntropyMonitor` (settings, declared rules, sampling and hooks).
* ``measure.py``: what it does with a sampled step's records (host copy, reduction, distances, images).
"""

from lightning_diag.callbacks.attention_entropy.monitor import AttentionEntropyMonitor

__all__ = ["AttentionEntropyMonitor"]
