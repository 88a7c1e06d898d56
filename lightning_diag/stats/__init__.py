"""Pure functions on tensors and series: fused gradient norms, entropy, trend tests. Never imports Lightning."""

from lightning_diag.stats.norms import all_finite, max_abs, total_norm
from lightning_diag.stats.trend import fluctuation, relative_change

__all__ = ["all_finite", "fluctuation", "max_abs", "relative_change", "total_norm"]
