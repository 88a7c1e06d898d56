"""Clustering the validation samples a model gets wrong, and what each cluster shares (seed 001 §2.2).

Pure numpy and scikit-learn (an optional dependency: ``pip install lightning-diag[errors]``), imported when a
function runs, never at module import. The procedure:

1. Features: TF-IDF over token ids, unigrams and bigrams (:func:`tfidf_features`), or the caller's embeddings.
2. K-Means fitted on the *wrong* samples together with as many *right* ones (evenly spaced), with k chosen by the
   silhouette score within a range (:func:`fit_error_clusters`). The right samples give centres to the regions the
   model handles well, so that a hard subgroup's centre is not shared with the easy samples around it (fitted on the
   wrong samples alone, every centre would pull in its easy neighbours). K-Means rather than HDBSCAN: it assigns
   every sample (HDBSCAN leaves noise points unassigned, and a cluster's error rate needs every validation sample
   near it), it works on sparse TF-IDF directly, and with a fixed seed it is deterministic, so every rank computes
   the same clusters.
3. Every validation sample, right or wrong, is assigned to its nearest centre, and each cluster's error rate is
   computed against all the samples assigned to it (:func:`cluster_stats`): a cluster that is merely large
   has the overall rate, a hard subgroup has several times that.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["ClusterStat", "ErrorClusters", "cluster_stats", "fit_error_clusters", "tfidf_features"]


def _id_ngrams(ids: Sequence[int]) -> list[str]:
    grams = [str(int(i)) for i in ids]
    return grams + [f"{a} {b}" for a, b in itertools.pairwise(grams)]


def tfidf_features(sequences: Sequence[np.ndarray]) -> tuple[Any, list[str]]:
    """TF-IDF rows over token-id unigrams and bigrams, and the feature names (``"12"``, ``"12 57"``).

    Example:
        >>> x, names = tfidf_features([np.array([1, 2]), np.array([2, 3])])
        >>> x.shape, sorted(names)
        ((2, 5), ['1', '1 2', '2', '2 3', '3'])
    """
    from sklearn.feature_extraction.text import TfidfVectorizer

    vectorizer = TfidfVectorizer(analyzer=_id_ngrams, sublinear_tf=True)
    features = vectorizer.fit_transform([np.asarray(s).tolist() for s in sequences])
    return features, [str(n) for n in vectorizer.get_feature_names_out()]


@dataclasses.dataclass(frozen=True)
class ErrorClusters:
    """K-Means fitted on the wrong samples.

    Attributes:
        model: The fitted ``sklearn.cluster.KMeans``.
        k: Its number of clusters.
        silhouette: The silhouette score of the chosen ``k`` on the wrong samples.
    """

    model: Any
    k: int
    silhouette: float


def fit_error_clusters(
    features: Any, wrong: np.ndarray, k_range: tuple[int, int] = (2, 8), seed: int = 0, max_fit: int = 2000
) -> ErrorClusters | None:
    """Fit K-Means on the rows of ``features`` flagged ``wrong`` and as many right ones, k chosen by silhouette
    in ``k_range``.

    The silhouette uses the cosine distance on sparse (TF-IDF) features and the Euclidean one on dense
    features (standardise them first). At most ``max_fit`` wrong samples and as many right ones are used
    (evenly spaced subsets). Returns ``None`` when there are fewer than ``k_range[0] + 1`` distinct rows.
    """
    from sklearn.cluster import KMeans
    from sklearn.metrics import silhouette_score

    def spaced(rows: np.ndarray, n: int) -> np.ndarray:
        return rows if len(rows) <= n else rows[np.linspace(0, len(rows) - 1, n).astype(int)]

    bad = spaced(np.flatnonzero(wrong), max_fit)
    rows = np.concatenate([bad, spaced(np.flatnonzero(~wrong), len(bad))])
    x = features[rows]
    sparse = hasattr(x, "tocsr")
    metric = "cosine" if sparse else "euclidean"
    distinct = len({tuple(r) for r in (x.toarray() if sparse else x).round(6)})
    low, high = k_range
    high = min(high, distinct - 1)
    best: ErrorClusters | None = None
    for k in range(low, high + 1):
        model = KMeans(n_clusters=k, n_init=3, random_state=seed).fit(x)
        labels = model.labels_
        if len(set(labels.tolist())) < 2:
            continue
        score = float(silhouette_score(x, labels, metric=metric, sample_size=min(len(rows), 1000), random_state=seed))
        if best is None or score > best.silhouette:
            best = ErrorClusters(model, k, score)
    return best


@dataclasses.dataclass(frozen=True)
class ClusterStat:
    """One cluster, measured on every validation sample assigned to it.

    Attributes:
        cluster: Its index.
        size: Validation samples assigned to it.
        share: ``size`` over all validation samples.
        error_rate: Mean error of its samples (the fraction wrong; for token tasks the mean token error rate).
        wrong: Its samples counted wrong.
        top_features: The features that most distinguish it (its mean TF-IDF minus the overall mean), with
            that difference; token-id n-grams (``"12"``, ``"12 57"``) for TF-IDF features, ``dim_<i>`` for
            embeddings.
        majority_label: The most common true label of its wrong samples (classification), else ``None``.
        majority_prediction: The most common prediction of its wrong samples (classification), else ``None``.
    """

    cluster: int
    size: int
    share: float
    error_rate: float
    wrong: int
    top_features: tuple[tuple[str, float], ...]
    majority_label: int | None = None
    majority_prediction: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        out = dataclasses.asdict(self)
        out["top_features"] = [[name, score] for name, score in self.top_features]
        return out


def cluster_stats(
    clusters: ErrorClusters,
    features: Any,
    errors: np.ndarray,
    wrong: np.ndarray,
    feature_names: Sequence[str] | None = None,
    labels: np.ndarray | None = None,
    predictions: np.ndarray | None = None,
    top_n: int = 5,
) -> list[ClusterStat]:
    """Assign every sample to its nearest centre and measure each cluster, largest error rate first."""
    assigned = clusters.model.predict(features)
    dense_mean = np.asarray(features.mean(axis=0)).ravel()
    total = len(errors)
    out = []
    for c in range(clusters.k):
        members = assigned == c
        size = int(members.sum())
        if size == 0:
            continue
        centre = np.asarray(features[members].mean(axis=0)).ravel() - dense_mean
        order = np.argsort(-centre)[:top_n]
        names = feature_names if feature_names is not None else [f"dim_{i}" for i in range(len(centre))]
        top = tuple((str(names[i]), float(centre[i])) for i in order if centre[i] > 0)
        label = pred = None
        bad = members & wrong
        if labels is not None and predictions is not None and bad.any():
            label = int(Counter(labels[bad].tolist()).most_common(1)[0][0])
            pred = int(Counter(predictions[bad].tolist()).most_common(1)[0][0])
        out.append(ClusterStat(c, size, size / total, float(errors[members].mean()), int(bad.sum()), top, label, pred))
    return sorted(out, key=lambda s: -s.error_rate)
