"""Small images for TensorBoard drawn with numpy alone (no plotting library needed).

Example:
    >>> img = heatmap(np.eye(3), cell=2)
    >>> img.shape, img.dtype.name
    ((6, 6, 3), 'uint8')
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["colorize", "heatmap", "scatter", "tile"]

# A perceptually ordered dark-blue -> teal -> yellow ramp (anchor colours, linearly interpolated).
_RAMP = np.array(
    [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]],
    dtype=np.float64,
)
# A diverging blue -> white -> red ramp for correlations in [-1, 1].
_DIVERGING = np.array([[49, 54, 149], [171, 217, 233], [255, 255, 255], [253, 174, 97], [165, 0, 38]], dtype=np.float64)
_PALETTE = np.array(
    [[31, 119, 180], [255, 127, 14], [44, 160, 44], [214, 39, 40], [148, 103, 189], [140, 86, 75], [227, 119, 194]],
    dtype=np.uint8,
)


def colorize(values: np.ndarray, low: float, high: float, diverging: bool = False) -> np.ndarray:
    """Map values to RGB ``uint8`` (``[..., 3]``) on a colour ramp from ``low`` to ``high``; NaN is grey."""
    ramp = _DIVERGING if diverging else _RAMP
    v = np.asarray(values, dtype=np.float64)
    span = high - low if high > low else 1.0
    t = np.clip((np.nan_to_num(v, nan=low) - low) / span, 0.0, 1.0) * (len(ramp) - 1)
    i = np.minimum(t.astype(np.int64), len(ramp) - 2)
    frac = (t - i)[..., None]
    rgb = ramp[i] * (1 - frac) + ramp[i + 1] * frac
    rgb[np.isnan(v)] = 128
    return rgb.round().astype(np.uint8)


def heatmap(
    matrix: np.ndarray, cell: int = 4, low: float = 0.0, high: float | None = None, diverging: bool = False
) -> np.ndarray:
    """A ``[rows * cell, cols * cell, 3]`` image of a 2-D array, each entry a ``cell`` x ``cell`` square."""
    m = np.asarray(matrix, dtype=np.float64)
    top = float(np.nanmax(m)) if high is None and m.size else (high if high is not None else 1.0)
    rgb = colorize(m, low, top, diverging)
    return np.repeat(np.repeat(rgb, cell, axis=0), cell, axis=1)


def tile(images: Sequence[np.ndarray], gap: int = 2) -> np.ndarray:
    """Images side by side on a white background, separated by ``gap`` pixels, top-aligned."""
    if not images:
        return np.full((1, 1, 3), 255, dtype=np.uint8)
    height = max(im.shape[0] for im in images)
    width = sum(im.shape[1] for im in images) + gap * (len(images) - 1)
    out = np.full((height, width, 3), 255, dtype=np.uint8)
    x = 0
    for im in images:
        out[: im.shape[0], x : x + im.shape[1]] = im
        x += im.shape[1] + gap
    return out


def scatter(points: np.ndarray, groups: Sequence[int], size: int = 256, marker: int = 4) -> np.ndarray:
    """A ``[size, size, 3]`` scatter plot of 2-D ``points``; each group (layer) gets its own colour."""
    out = np.full((size, size, 3), 255, dtype=np.uint8)
    out[size // 2, :] = 220
    out[:, size // 2] = 220
    pts = np.asarray(points, dtype=np.float64)
    if pts.size == 0:
        return out
    scale = float(np.abs(pts).max()) or 1.0
    margin = marker + 2
    half = size / 2 - margin
    for (x, y), g in zip(pts, groups, strict=True):
        cx = round(size / 2 + x / scale * half)
        cy = round(size / 2 - y / scale * half)
        out[max(cy - marker, 0) : cy + marker + 1, max(cx - marker, 0) : cx + marker + 1] = _PALETTE[g % len(_PALETTE)]
    return out
