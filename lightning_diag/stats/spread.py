"""The spread of a model's outputs across a batch relative to their level (pure Python, no torch).

The number behind ``output_collapse``: the measuring part turns its module's input spread into it, the rule the
output's.
"""

from __future__ import annotations

import math

__all__ = ["relative_spread"]


def relative_spread(spread: float, level: float) -> float:
    """``spread / (spread + |level|)``: 0 for outputs equal across the batch; ``nan`` where both are 0 (an
    all-zero output, e.g. a zero-initialised last layer, says nothing) or not finite.

    Example:
        >>> relative_spread(0.0, 1.0), relative_spread(1.0, 0.0), math.isnan(relative_spread(0.0, 0.0))
        (0.0, 1.0, True)
    """
    total = spread + abs(level)
    if not (math.isfinite(spread) and math.isfinite(level)) or total <= 0:
        return math.nan
    return spread / total
