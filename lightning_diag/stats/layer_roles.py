"""How a layer's name reads as a place in a stack of blocks (framework-free): its role (``h.*.mlp.fc``), which the
gradient-flow detectors compare layers within (``grad_layer_spread``, ``grad_vanish``'s depth test), and its block
position. Used by the measurement (:mod:`lightning_diag.instrument.grad_measure`) and the report's replay too.
"""

from __future__ import annotations

__all__ = ["block_position", "role_of"]


def block_position(layer: str) -> tuple[int, ...]:
    """A layer's block indices, in the order of its name (the order of a stack).

    Example:
        >>> sorted(["net.10", "net.2", "net.0"], key=block_position)
        ['net.0', 'net.2', 'net.10']
    """
    return tuple(int(part) for part in layer.split(".") if part.isdigit())


def role_of(layer: str) -> str:
    """A layer's role: its name with block indices replaced by ``*``.

    Example:
        >>> role_of("h.3.mlp.fc")
        'h.*.mlp.fc'
    """
    return ".".join("*" if part.isdigit() else part for part in layer.split("."))

