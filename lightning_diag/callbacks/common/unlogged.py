"""Running the user's ``training_step`` outside the loop without its ``self.log`` reaching the run's results.

The non-finite replay (``nonfinite_recovery.py``) and the validation-end probes (``_probe.py``) compute the loss
of the user's ``training_step`` once more. ``LightningModule.log`` would write into the trainer's result
collection (or through the Fabric), so that step's values would land in the user's logged rows. Instead of
assigning anything on the user's module, the step runs on :func:`unlogged_copy`: a shallow copy that the library
creates and owns. It shares every parameter, buffer, submodule and hook of the live module (the same
``_parameters``, ``_modules`` and hook dictionaries), so its forward is the live module's forward, and only the
copy's own ``log`` and ``log_dict`` are silenced. Attributes the step assigns on ``self`` land on the copy and are
dropped with it. Only the step runs on the copy: registries keyed by the module object (FSDP2's state of a
``fully_shard``-ed root, reached by ``reshard()``/``unshard()``) know the live module alone, so everything else a
caller does (resharding, gathering full weights, restoring modes) goes through the live module.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl

__all__ = ["unlogged_copy"]

#: The ``LightningModule`` methods silenced on the copy.
_SILENCED = ("log", "log_dict")


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None


def unlogged_copy(pl_module: pl.LightningModule) -> pl.LightningModule:
    """A shallow copy of ``pl_module`` whose ``log`` and ``log_dict`` do nothing.

    ``object.__new__`` makes the copy without running any ``__new__``/``__init__`` of the user's class (FSDP2's
    ``FSDPModule.__new__`` would build a fresh module) nor Lightning's ``__getstate__`` (which drops the trainer
    reference the step may read). Nothing is assigned on ``pl_module`` or its class.

    Args:
        pl_module: The live module.

    Returns:
        The copy: same class, a new instance dictionary holding the live one's values, plus the two no-ops.
    """
    copy = object.__new__(type(pl_module))
    vars(copy).update(vars(pl_module))
    for name in _SILENCED:
        vars(copy)[name] = _no_log
    return copy
