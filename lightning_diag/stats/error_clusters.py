"""Embedding clusters as slice features, for inputs that have no discrete feature (``ErrorAnalysis(embed=...)``).

A hard group of samples that shares no token, label or metadata value may still share a region of the model's
embedding space. K-Means gives those regions: it is fitted on the *wrong* samples together with as many *right*
ones (evenly spaced subsets; the right samples give centres to the regions the model handles well, so that a hard
group's centre is not shared with the easy samples around it), for **every** k in a range rather than one chosen
by silhouette: a small hard group may have a centre of its own at k = 6 and be merged into a larger region at
k = 2. Every validation sample is assigned to its nearest centre at each k, and each (k, cluster) becomes a slice
feature ``"embedding=k<k>/c<c>"`` that :func:`lightning_diag.stats.error_slices.find_slices` judges like any
other (the extra slices are counted in its correction). K-Means rather than HDBSCAN: it assigns every sample, and
with a fixed seed it is deterministic, so every rank computes the same clusters.

scikit-learn (the ``errors`` extra), imported when the function runs.
"""

from __future__ import annotations

import numpy as np

from lightning_diag.stats.error_slices import SliceFeatures, stack_features, value_features

__all__ = ["embedding_clusters"]


def embedding_clusters(
    embeddings: np.ndarray, wrong: np.ndarray, k_range: tuple[int, int] = (2, 8), seed: int = 0, max_fit: int = 2000
) -> SliceFeatures | None:
    """One slice feature per cluster of K-Means fitted for each k in ``k_range`` on standardised ``embeddings``.

    Args:
        embeddings: ``[samples, dims]`` rows (standardised here, column by column).
        wrong: The samples counted wrong; K-Means is fitted on at most ``max_fit`` of them and as many right ones.
        k_range: ``(low, high)`` numbers of clusters, each fitted (capped by the distinct rows available).
        seed: K-Means seed.
        max_fit: Most wrong (and right) samples fitted.

    Returns:
        The features, or ``None`` when there are too few distinct rows for ``low`` clusters.

    Example:
        >>> rng = np.random.default_rng(0)
        >>> x = np.concatenate([rng.normal(0, 1, (40, 2)), rng.normal(8, 1, (20, 2))])
        >>> f = embedding_clusters(x, np.arange(60) >= 40, k_range=(2, 2))
        >>> f.names, sorted(np.asarray(f.members.sum(axis=0)).ravel().astype(int).tolist())
        (['embedding=k2/c0', 'embedding=k2/c1'], [20, 40])
    """
    from sklearn.cluster import KMeans

    x = np.asarray(embeddings, dtype=np.float64).reshape(len(embeddings), -1)
    x = (x - x.mean(0)) / (x.std(0) + 1e-8)

    def spaced(rows: np.ndarray, n: int) -> np.ndarray:
        return rows if len(rows) <= n else rows[np.linspace(0, len(rows) - 1, n).astype(int)]

    bad = spaced(np.flatnonzero(wrong), max_fit)
    fit = x[np.concatenate([bad, spaced(np.flatnonzero(~wrong), len(bad))])]
    distinct = len(np.unique(fit.round(6), axis=0))
    low, high = k_range[0], min(k_range[1], distinct)
    parts = []
    for k in range(low, high + 1):
        assigned = KMeans(n_clusters=k, n_init=3, random_state=seed).fit(fit).predict(x)
        part = value_features([f"k{k}/c{c}" for c in assigned.tolist()], "embedding")
        parts.append(part)
    return stack_features(parts) if parts else None
