"""Data statistics (numpy only): token-frequency shift, OOV share, long tail, near-duplicate search, label balance.

Everything here is a pure function of arrays; :class:`~lightning_diag.DataDiagnostics` feeds it the samples it
read. Definitions (docs/data_diagnostics.md says the same in words):

* **Vocabulary shift** (:func:`vocab_kl`): ``KL(P_val || P_train)`` in nats between the two token-frequency
  distributions, estimated from finite samples. Types seen fewer than ``min_count`` times in both samples
  together are pooled into one "rare" bin, every bin gets ``alpha`` pseudo-counts (a type missing from one
  sample does not make the divergence infinite), and the expected value of the estimate for two samples of one
  and the same distribution, ``(K - 1) / 2 * (1/N_val + 1/N_train)`` over ``K`` bins, is subtracted (clipped at
  0): a healthy split reads close to 0 at any sample size.
* **Near-duplicates** (:func:`minhash`, :func:`find_near_duplicates`): the similarity of two token sequences is
  the Jaccard index of their sets of token ``n``-gram shingles. MinHash signatures (``num_perm`` hash
  functions) estimate it; locality-sensitive hashing over bands of ``rows`` signature entries finds candidate
  pairs in time linear in the number of samples (no all-pairs comparison); a candidate's similarity is the share
  of signature entries the two samples share. Exact copies are found through a hash of the whole sequence.

Example:
    >>> train = np.bincount([1, 1, 2, 3, 3, 3], minlength=5)
    >>> round(vocab_kl(train, train, min_count=1, bias_correction=False), 6)
    0.0
    >>> round(proportion_std(np.array([50, 50])), 3), round(proportion_std(np.array([80, 20])), 3)
    (0.0, 0.3)
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import numpy as np

__all__ = [
    "LeakMatches",
    "aligned",
    "bytes_hashes",
    "combined_hashes",
    "find_near_duplicates",
    "jaccard",
    "minhash",
    "oov_share",
    "proportion_std",
    "rare_share",
    "salted",
    "sequence_hashes",
    "shingle_hashes",
    "tail_summary",
    "total_variation",
    "vocab_kl",
]

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_EMPTY = np.iinfo(np.uint64).max


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective, well-mixing map of uint64 arrays (wraps modulo 2^64)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def salted(values: np.ndarray, salt: np.ndarray) -> np.ndarray:
    """``values`` (``[N]`` or ``[N, K]`` uint64) remapped per row by a bijection chosen by the row's ``salt``
    (``[N]`` uint64): two rows with the same salt keep every equality between their entries, two rows with
    different salts (almost surely) share none. Folds a sample's other parts (its image) into its text hash and
    MinHash signature, so that two samples match only when those parts are equal.

    Example:
        >>> a = np.array([[5, 6], [5, 6], [5, 6]], np.uint64)
        >>> out = salted(a, np.array([1, 1, 2], np.uint64))
        >>> bool((out[0] == out[1]).all()), bool((out[0] == out[2]).any())
        (True, False)
    """
    salt = _mix(np.asarray(salt, np.uint64) + _GOLDEN)
    values = np.asarray(values, np.uint64)
    return _mix(values ^ (salt[:, None] if values.ndim == 2 else salt))


def aligned(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two count vectors zero-padded to the same length."""
    n = max(len(a), len(b))
    return np.pad(np.asarray(a, np.float64), (0, n - len(a))), np.pad(np.asarray(b, np.float64), (0, n - len(b)))


def vocab_kl(
    val_counts: np.ndarray,
    train_counts: np.ndarray,
    min_count: int = 5,
    alpha: float = 0.5,
    bias_correction: bool = True,
) -> float:
    """``KL(P_val || P_train)`` in nats of two token-count vectors (index = token id), smoothed for finite samples.

    Args:
        val_counts: Occurrences of each token id in the validation sample.
        train_counts: The same for the training sample.
        min_count: Types with fewer occurrences in both samples together are pooled into one bin.
        alpha: Pseudo-count added to every bin of both distributions.
        bias_correction: Subtract the divergence two samples of one distribution show on average.

    Returns:
        The divergence, ``>= 0``; ``nan`` when either sample is empty.
    """
    v, t = aligned(val_counts, train_counts)
    if v.sum() <= 0 or t.sum() <= 0:
        return float("nan")
    total = v + t
    keep = total >= min_count
    rare = (total > 0) & ~keep
    bins_v = [v[keep]]
    bins_t = [t[keep]]
    if rare.any():
        bins_v.append(np.array([v[rare].sum()]))
        bins_t.append(np.array([t[rare].sum()]))
    bv, bt = np.concatenate(bins_v), np.concatenate(bins_t)
    k = len(bv)
    p = (bv + alpha) / (bv.sum() + alpha * k)
    q = (bt + alpha) / (bt.sum() + alpha * k)
    kl = float(np.sum(p * np.log(p / q)))
    if bias_correction:
        kl -= (k - 1) / 2.0 * (1.0 / v.sum() + 1.0 / t.sum())
    return max(kl, 0.0)


def oov_share(val_counts: np.ndarray, train_counts: np.ndarray) -> float:
    """Share of validation tokens whose id never occurs in the training sample (``nan`` for no tokens)."""
    v, t = aligned(val_counts, train_counts)
    return float(v[t == 0].sum() / v.sum()) if v.sum() > 0 else float("nan")


def rare_share(val_counts: np.ndarray, train_counts: np.ndarray, rare_count: int = 5) -> float:
    """Share of validation tokens whose id occurs fewer than ``rare_count`` times in the training sample."""
    v, t = aligned(val_counts, train_counts)
    return float(v[t < rare_count].sum() / v.sum()) if v.sum() > 0 else float("nan")


def tail_summary(counts: np.ndarray, coverage: float = 0.9) -> dict[str, float]:
    """The shape of a token-frequency distribution's long tail.

    Returns:
        ``types`` (distinct ids seen), ``head_types`` (fewest types covering ``coverage`` of the tokens),
        ``head_share`` (``head_types / types``) and ``singleton_share`` (share of types seen exactly once).

    Example:
        >>> tail_summary(np.array([0, 90, 5, 3, 1, 1]))["head_types"]
        1.0
    """
    c = np.asarray(counts, np.float64)
    c = c[c > 0]
    if c.size == 0:
        return {"types": 0.0, "head_types": float("nan"), "head_share": float("nan"), "singleton_share": float("nan")}
    cum = np.cumsum(np.sort(c)[::-1]) / c.sum()
    head = int(np.searchsorted(cum, coverage - 1e-12) + 1)
    return {
        "types": float(c.size),
        "head_types": float(head),
        "head_share": head / c.size,
        "singleton_share": float(np.mean(c == 1)),
    }


def proportion_std(counts: np.ndarray) -> float:
    """Standard deviation (population, ``ddof=0``) of the class proportions ``counts / counts.sum()``.

    ``0`` for perfectly balanced classes; for two classes it is ``|p - 0.5|`` (0.1 means a 60/40 split).
    ``nan`` with fewer than two classes or no labels.
    """
    c = np.asarray(counts, np.float64)
    if c.size < 2 or c.sum() <= 0:
        return float("nan")
    return float(np.std(c / c.sum()))


def total_variation(a: np.ndarray, b: np.ndarray) -> float:
    """Total-variation distance ``0.5 * sum |p - q|`` of two count vectors' proportions (``nan`` if one is empty)."""
    p, q = aligned(a, b)
    if p.sum() <= 0 or q.sum() <= 0:
        return float("nan")
    return float(0.5 * np.abs(p / p.sum() - q / q.sum()).sum())


# -- near-duplicates ------------------------------------------------------------------------------------------


def shingle_hashes(tokens: np.ndarray, lengths: np.ndarray, n: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """64-bit hashes of every token ``n``-gram of each row.

    Args:
        tokens: ``[N, L]`` integer token ids, each row's tokens first (left-aligned), anything after ``lengths``.
        lengths: ``[N]`` number of valid tokens per row.
        n: Shingle size. A row shorter than ``n`` (but not empty) has one shingle: the whole row.

    Returns:
        ``(hashes [N, S], valid [N, S])`` with ``S = max(L - n + 1, 1)``.
    """
    tokens = np.asarray(tokens, np.int64)
    lengths = np.asarray(lengths, np.int64)
    rows, width = tokens.shape
    span = max(width - n + 1, 1)
    tok = np.pad(tokens, ((0, 0), (0, max(n - width, 0)))).astype(np.uint64)
    h = np.zeros((rows, span), np.uint64)
    for j in range(n):
        h = _mix(h * _GOLDEN + tok[:, j : j + span] + np.uint64(1))
    valid = np.arange(span)[None, :] < (lengths[:, None] - n + 1)
    short = (lengths > 0) & (lengths < n)
    if short.any():
        whole = sequence_hashes(tokens[short], lengths[short])
        h[short, 0] = whole
        valid[short, 0] = True
    return h, valid


def sequence_hashes(tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``[N]`` 64-bit hash of each row's first ``lengths`` tokens (order-sensitive; equal rows, equal hashes)."""
    tokens = np.asarray(tokens, np.int64)
    lengths = np.asarray(lengths, np.int64)
    pos = np.arange(tokens.shape[1], dtype=np.uint64)[None, :]
    mixed = _mix(tokens.astype(np.uint64) ^ _mix(pos + _GOLDEN))
    mixed[np.arange(tokens.shape[1])[None, :] >= lengths[:, None]] = 0
    return _mix(mixed.sum(axis=1, dtype=np.uint64) + lengths.astype(np.uint64))


def combined_hashes(parts: list[np.ndarray]) -> np.ndarray:
    """``[N]`` 64-bit hash of several ``[N]`` per-row hashes taken together (order-sensitive)."""
    out = np.zeros(len(parts[0]), np.uint64)
    for i, part in enumerate(parts):
        out = _mix(out ^ salted(np.asarray(part, np.uint64), np.full(len(part), i, np.uint64)))
    return out


def bytes_hashes(rows: np.ndarray) -> np.ndarray:
    """``[N]`` 64-bit hash of each row's bytes (float features: exact copies only)."""
    flat = np.ascontiguousarray(rows).reshape(len(rows), -1)
    return np.array(
        [int.from_bytes(hashlib.blake2b(r.tobytes(), digest_size=8).digest(), "little") for r in flat], np.uint64
    )


def minhash(
    tokens: np.ndarray, lengths: np.ndarray, n: int = 3, num_perm: int = 64, seed: int = 0, chunk: int = 2048
) -> np.ndarray:
    """``[N, num_perm]`` MinHash signatures of each row's set of ``n``-gram shingles.

    Entry ``k`` is the minimum over the row's shingles of the ``k``-th hash function ``a_k * h + b_k`` (mod 2^64,
    ``a_k`` odd: a bijection of the already mixed shingle hash ``h``). Two rows agree on an entry with probability
    equal to the Jaccard index of their shingle sets. Rows without shingles (empty) get all-ones signatures.
    Cost: ``N * L * num_perm`` multiply-adds, in chunks of ``chunk`` rows.
    """
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    b = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64)
    out = np.empty((len(tokens), num_perm), np.uint64)
    for start in range(0, len(tokens), chunk):
        h, valid = shingle_hashes(tokens[start : start + chunk], lengths[start : start + chunk], n)
        # a repeated shingle leaves the minimum unchanged: fill the invalid positions with the row's first one
        h = np.where(valid, h, h[:, :1])
        block = out[start : start + chunk]
        for k in range(num_perm):  # one 2-D pass per hash function: 4x faster than one 3-D broadcast
            np.min(h * a[k] + b[k], axis=1, out=block[:, k])
        block[~valid.any(axis=1)] = _EMPTY
    return out


class LeakMatches(NamedTuple):
    """For each query row: its best match among the reference rows.

    Attributes:
        similarity: ``[Nq]`` estimated Jaccard similarity with the best candidate (1.0 for an exact copy, 0.0 for
            no candidate).
        match: ``[Nq]`` row of the best reference candidate, ``-1`` for none.
        exact: ``[Nq]`` whether the row is an exact copy of a reference row.
    """

    similarity: np.ndarray
    match: np.ndarray
    exact: np.ndarray


def find_near_duplicates(
    ref_sig: np.ndarray,
    ref_hash: np.ndarray,
    query_sig: np.ndarray | None,
    query_hash: np.ndarray,
    rows: int = 3,
    ref_valid: np.ndarray | None = None,
    query_valid: np.ndarray | None = None,
) -> LeakMatches:
    """Each query row's most similar reference row, by exact hash and MinHash/LSH, in ``O((Nr + Nq) log Nr)``.

    Args:
        ref_sig: ``[Nr, K]`` reference (training) MinHash signatures, or an empty array for hash-only search.
        ref_hash: ``[Nr]`` reference whole-row hashes.
        query_sig: ``[Nq, K]`` query (validation) signatures, or ``None`` for exact copies only.
        query_hash: ``[Nq]`` query whole-row hashes.
        rows: Signature entries per LSH band (``K // rows`` bands). A pair with Jaccard ``s`` becomes a candidate
            with probability ``1 - (1 - s^rows)^bands``: 0.94 at ``s = 0.5``, 0.999 at 0.65 for 64 entries.
        ref_valid: ``[Nr]`` rows that take part (empty sequences do not); default all.
        query_valid: ``[Nq]`` the same for the query rows.

    Returns:
        :class:`LeakMatches`. Among the reference rows that share a band with a query row (the first of each
        bucket), the one sharing the most signature entries is its match.
    """
    nq = len(query_hash)
    ref_valid = np.ones(len(ref_hash), bool) if ref_valid is None else np.asarray(ref_valid, bool)
    query_valid = np.ones(nq, bool) if query_valid is None else np.asarray(query_valid, bool)
    similarity = np.zeros(nq)
    match = np.full(nq, -1, np.int64)
    exact = np.zeros(nq, bool)
    ref_rows = np.flatnonzero(ref_valid)
    if ref_rows.size == 0 or nq == 0:
        return LeakMatches(similarity, match, exact)
    # exact copies: sorted reference hashes, binary search
    order = ref_rows[np.argsort(ref_hash[ref_rows], kind="stable")]
    sorted_hash = ref_hash[order]
    pos = np.clip(np.searchsorted(sorted_hash, query_hash), 0, len(order) - 1)
    exact = (sorted_hash[pos] == query_hash) & query_valid
    match[exact] = order[pos[exact]]
    similarity[exact] = 1.0
    if query_sig is None or ref_sig.size == 0:
        return LeakMatches(similarity, match, exact)
    k = ref_sig.shape[1]
    bands = max(k // rows, 1)
    width = min(rows, k)
    candidates = np.full((nq, bands), -1, np.int64)
    for band in range(bands):
        cols = slice(band * width, (band + 1) * width)
        ref_key = _band_key(ref_sig[ref_rows, cols])
        query_key = _band_key(query_sig[:, cols])
        border = np.argsort(ref_key, kind="stable")
        keys = ref_key[border]
        at = np.clip(np.searchsorted(keys, query_key), 0, len(keys) - 1)
        hit = (keys[at] == query_key) & query_valid
        candidates[hit, band] = ref_rows[border[at[hit]]]
    has = candidates >= 0
    safe = np.where(has, candidates, 0)
    agree = np.count_nonzero(ref_sig[safe] == query_sig[:, None, :], axis=2) / k
    agree[~has] = -1.0
    best = agree.argmax(axis=1)
    best_sim = agree[np.arange(nq), best]
    better = ~exact & (best_sim > 0)
    similarity[better] = best_sim[better]
    match[better] = safe[np.arange(nq), best][better]
    return LeakMatches(similarity, match, exact)


def _band_key(block: np.ndarray) -> np.ndarray:
    key = np.zeros(len(block), np.uint64)
    for j in range(block.shape[1]):
        key = _mix(key * _GOLDEN + block[:, j])
    return key


def jaccard(a: set[int] | frozenset[int], b: set[int] | frozenset[int]) -> float:
    """Exact Jaccard index ``|a & b| / |a | b|`` of two sets (1.0 for two empty sets)."""
    union = len(a | b)
    return len(a & b) / union if union else 1.0
