"""Slices that fail together, as one finding: a failing group described by a disjunction or a conjunction of
features (issue 46 §3).

A hard group of samples is often marked by several features rather than one: any of ten marker tokens, each held
by a part of the group, or two features that fail only together. Judged one at a time (as
:func:`lightning_diag.stats.error_slices.find_slices` does), the group is split into slices that each hold a
part of it, and the most significant part names the whole. :func:`find_groups` builds the group instead:

1. **Candidates.** Every feature held by at least ``min_count`` samples, every feature other than a token bigram
   held by at least ``member_min`` (bigrams are many, and each candidate raises every group's correction; a rare
   bigram is described by its tokens), features of exactly the same samples being one candidate; and every
   **conjunction** of two features each held by at least ``min_count`` samples whose intersection holds at least
   ``min_count`` samples, differs from both, and leaves ``min_count`` outside (SliceLine's pairs, Sagadeeva and
   Boehm 2021). A conjunction becomes a candidate only when neither of its features reaches the lift ``ratio`` on
   its own ("fails only together"), and only pairs of the ``max_parents`` most significant such features are
   evaluated (the cost), but every eligible pair counts as a hypothesis. ``P`` = candidate features + eligible
   pairs.
2. **Pool.** The candidates whose error rate is at least ``member_lift`` times the overall rate (by default half
   the lift ``ratio`` a finding needs, at least 1: a member need not qualify on its own, the group must), with at
   least 2 wrong samples and a one-sided Fisher p-value of at most ``screen``; the ``max_pool`` most
   significant.
3. **Greedy union.** The most significant unused pool slice seeds a group (union ``U``, ``m = 1`` member). A
   further unused pool slice ``c`` may join when (a) it fails with the group: at least half of its wrong samples
   are already in ``U`` (its errors are mostly covered), or it is a sibling of the seed (a value of the same
   field: a token with tokens, ``source=...`` with ``source=...``; conjunctions have no siblings); (b) the samples
   it adds fail at least ``member_lift`` times the overall rate; (c) the union leaves ``min_count`` samples outside;
   (d) it makes the group's *corrected* p-value smaller; and (e) its own p-value times the price of one more
   member (the factor by which the correction grows, below) is at most 1: a slice of a few samples that happen to
   fail does not ride on the group's far tail. The slice that makes it smallest joins; the union
   grows while one does (at most ``max_members`` members). Then every unused pool slice whose samples overlap
   ``U`` with a Jaccard index of at least ``jaccard`` is listed as an alternative description of the group (an
   *alternate*), and the next unused slice seeds the next group.
4. **Correction.** A group of ``m`` members is one of the ``C(P, m)`` unions of ``m`` candidates; its union's
   one-sided Fisher p-value is multiplied by ``C(P, m) * m * (m + 1)`` (a weighted Bonferroni correction: the
   weights ``1 / (m (m + 1) C(P, m))`` sum to at most 1 over every union of every size, so the family-wise error
   stays within the level whatever the greedy search picks; a single slice pays ``2 P``). Each member must pay
   for itself: a member that adds samples which fail only by chance does not lower the corrected p-value, and
   does not join.

The finding's numbers (size, share, error rate, lift, p-values) are the union's. Its *kind* is ``"slice"`` (one
feature, with its alternates), ``"conjunction"`` (one conjunction) or ``"disjunction"`` (several members).

Pure numpy and scipy, imported when the function runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any

import numpy as np

from lightning_diag.stats.error_slices import MERGE_JACCARD, Finding, Member, SliceFeatures

__all__ = [
    "CONJUNCTION",
    "COVERED",
    "MAX_MEMBERS",
    "MAX_PARENTS",
    "MAX_POOL",
    "SCREEN_P",
    "Groups",
    "feature_field",
    "find_groups",
]

#: Joins the two feature names of a conjunction (``"5 & source=web"``).
CONJUNCTION = " & "
#: A slice joins a group when at least this share of its wrong samples are in the group (or it is a sibling).
COVERED = 0.5
#: A pool slice's largest one-sided Fisher p-value (uncorrected: the correction is the group's).
SCREEN_P = 0.05
#: Most pool slices (the most significant).
MAX_POOL = 200
#: Most members of one group.
MAX_MEMBERS = 24
#: Conjunctions are evaluated among this many features at most (the most significant).
MAX_PARENTS = 200


@dataclasses.dataclass(frozen=True)
class Groups:
    """What :func:`find_groups` returns.

    Attributes:
        findings: One per group, most significant first.
        candidates: Candidate features (distinct sample sets; see the module docstring).
        conjunctions: Eligible pairs of features (each a hypothesis).
    """

    findings: list[Finding]
    candidates: int
    conjunctions: int

    @property
    def hypotheses(self) -> int:
        """``P``: the candidates a union is drawn from."""
        return self.candidates + self.conjunctions


def feature_field(name: str) -> str:
    """The field a feature is a value of: ``"conjunction"``, ``"token"`` (a unigram), ``"bigram"``, or the name
    before ``=`` (``"source"``, ``"label"``, ``"embedding"``).

    Example:
        >>> [feature_field(n) for n in ("12", "12 57", "source=web", "5 & source=web")]
        ['token', 'bigram', 'source', 'conjunction']
    """
    if CONJUNCTION in name:
        return "conjunction"
    if "=" in name:
        return name.split("=", 1)[0]
    return "bigram" if " " in name else "token"


def _distinct_columns(members: Any, keep: np.ndarray) -> list[list[int]]:
    """The kept columns grouped by identical sample sets (first column first)."""
    groups: dict[bytes, list[int]] = {}
    for c in np.flatnonzero(keep).tolist():
        rows = members.indices[members.indptr[c]:members.indptr[c + 1]]
        groups.setdefault(np.sort(rows).tobytes(), []).append(c)
    return list(groups.values())


def _log_sf(bad: np.ndarray, n: int, total_bad: int, size: np.ndarray) -> np.ndarray:
    """log of the one-sided Fisher exact p-value of ``bad`` wrong samples in sets of ``size`` (``hypergeom.sf``,
    fast; its slow ``logsf`` only where the p-value underflows)."""
    from scipy.stats import hypergeom

    bad, size = np.broadcast_arrays(np.asarray(bad, dtype=np.int64), np.asarray(size, dtype=np.int64))
    with np.errstate(divide="ignore"):
        out = np.log(np.asarray(hypergeom.sf(bad - 1, n, total_bad, size), dtype=np.float64))
        tiny = ~(out > -700.0)
        if tiny.any():
            out[tiny] = hypergeom.logsf(bad[tiny] - 1, n, total_bad, size[tiny])
    return out


def find_groups(
    features: SliceFeatures,
    errors: np.ndarray,
    wrong: np.ndarray,
    min_count: int,
    ratio: float,
    member_min: int | None = None,
    member_lift: float | None = None,
    labels: np.ndarray | None = None,
    predictions: np.ndarray | None = None,
    screen: float = SCREEN_P,
    max_pool: int = MAX_POOL,
    max_members: int = MAX_MEMBERS,
    max_parents: int = MAX_PARENTS,
    jaccard: float = MERGE_JACCARD,
) -> Groups:
    """The groups of slices that fail together (see the module docstring), most significant first.

    Args:
        features: The sample x feature matrix (columns held by fewer than ``member_min`` samples, and bigrams held
            by fewer than ``min_count``, are ignored).
        errors: Each sample's error (0/1, or a token error rate).
        wrong: Each sample counted wrong (the test counts these).
        min_count: The smallest conjunction, and the fewest samples a group leaves outside.
        ratio: The lift a finding needs (it sets the conjunctions' condition and the default ``member_lift``).
        member_min: The smallest member slice (default ``min_count``).
        member_lift: A pool slice's (and the samples a member adds) error rate over the overall rate, at least
            (default ``max(1, ratio / 2)``).
        labels: True labels (classification), for the majority label of a group's wrong samples.
        predictions: Predictions (classification), likewise.
        screen: A pool slice's largest uncorrected p-value.
        max_pool: Most pool slices.
        max_members: Most members of a group.
        max_parents: Conjunctions are evaluated among this many features (the most significant that do not reach
            the lift alone); every eligible pair is counted in ``P`` all the same.
        jaccard: Unused pool slices overlapping a group's union this much are its alternates.

    Example:
        >>> from lightning_diag.stats.error_slices import value_features
        >>> n = 400
        >>> marker = [f"m{i % 8}" if i < 64 else None for i in range(n)]  # 8 markers of 8 samples: 16% of all
        >>> wrong = (np.arange(n) < 64) & (np.arange(n) % 3 != 0) | (np.arange(n) % 25 == 0)
        >>> g = find_groups(value_features(marker, "tag"), wrong.astype(float), wrong, min_count=20, ratio=3.0,
        ...                 member_min=5)
        >>> [(f.kind, len(f.members), f.size, round(f.lift, 1)) for f in g.findings]
        [('disjunction', 8, 64, 4.8)]
    """
    from scipy.sparse import csc_matrix

    members = features.members.tocsc()
    n = features.samples
    member_min = min_count if member_min is None else member_min
    member_lift = max(1.0, ratio / 2) if member_lift is None else member_lift
    errors = np.asarray(errors, dtype=np.float64)
    wrong = np.asarray(wrong, dtype=bool)
    total_err, total_bad = float(errors.sum()), int(wrong.sum())
    if n == 0 or members.shape[1] == 0 or total_err <= 0:
        return Groups([], 0, 0)
    overall = total_err / n
    sizes = np.asarray(members.sum(axis=0)).ravel().astype(np.int64)
    small = np.array([feature_field(name) != "bigram" for name in features.names], dtype=bool)
    singles = _distinct_columns(
        members, ((sizes >= min_count) | (small & (sizes >= member_min))) & (n - sizes >= min_count)
    )
    if not singles:
        return Groups([], 0, 0)
    firsts = np.array([cols[0] for cols in singles], dtype=np.int64)
    sub = members[:, firsts]
    size = sizes[firsts]
    err = np.asarray(sub.T @ errors).ravel()
    bad = np.asarray(sub.T @ wrong.astype(np.float64)).ravel().round().astype(np.int64)
    names = [tuple(features.names[c] for c in cols) for cols in singles]
    columns: list[Any] = [sub[:, [j]] for j in range(len(singles))]

    # conjunctions of two features of at least min_count samples each
    parents = np.flatnonzero(size >= min_count)
    lifted = err / size >= ratio * overall
    conjunctions = 0
    conj_size = conj_err = conj_bad = np.empty(0)
    pairs: list[tuple[int, int]] = []
    if len(parents) > 1:
        psub = sub[:, parents]
        inter = (psub.T @ psub).toarray().round().astype(np.int64)
        psize = size[parents]
        upper = np.triu(np.ones_like(inter, dtype=bool), k=1)
        eligible = (
            upper & (inter >= min_count) & (n - inter >= min_count)
            & (inter < psize[:, None]) & (inter < psize[None, :])
        )
        conjunctions = int(eligible.sum())
        # evaluated: pairs of the max_parents most significant parents that do not reach the lift alone (every
        # eligible pair is counted above, so evaluating fewer keeps the correction valid)
        plain = np.flatnonzero(~lifted[parents])
        plain = plain[np.argsort(_log_sf(bad[parents[plain]], n, total_bad, size[parents[plain]]), kind="stable")]
        plain = np.sort(plain[:max_parents])
        ii, jj = np.nonzero(eligible[np.ix_(plain, plain)])
        if len(ii):
            qsub = psub[:, plain]
            inter_err = (qsub.T @ qsub.multiply(errors[:, None]).tocsc()).toarray()
            inter_bad = (qsub.T @ qsub.multiply(wrong[:, None].astype(np.float64)).tocsc()).toarray()
            conj_size = inter[plain[ii], plain[jj]]
            conj_err = inter_err[ii, jj]
            conj_bad = inter_bad[ii, jj].round().astype(np.int64)
            pairs = [(int(parents[plain[i]]), int(parents[plain[j]])) for i, j in zip(ii.tolist(), jj.tolist(),
                                                                                      strict=True)]

    all_size = np.concatenate([size, np.asarray(conj_size, dtype=np.int64)])
    all_err = np.concatenate([err, np.asarray(conj_err, dtype=np.float64)])
    all_bad = np.concatenate([bad, np.asarray(conj_bad, dtype=np.int64)])
    rate = all_err / all_size
    rest = (total_err - all_err) / (n - all_size)
    log_p = _log_sf(all_bad, n, total_bad, all_size)
    ok = (rate >= member_lift * overall) & (rate > rest) & (all_bad >= 2) & (log_p <= math.log(screen))
    order = [int(i) for i in np.argsort(log_p, kind="stable") if ok[i]][:max_pool]
    if not order:
        return Groups([], len(singles), conjunctions)

    def column(i: int) -> Any:
        if i < len(singles):
            return columns[i]
        a, b = pairs[i - len(singles)]
        return columns[a].multiply(columns[b])

    def name(i: int) -> tuple[str, ...]:
        if i < len(singles):
            return names[i]
        a, b = pairs[i - len(singles)]
        return (names[a][0] + CONJUNCTION + names[b][0],)

    pool = csc_matrix(np.hstack([column(i).toarray() for i in order]) > 0, dtype=np.float64)
    q_size, q_err, q_bad = all_size[order], all_err[order], all_bad[order]
    q_fields = [feature_field(name(i)[0]) for i in order]
    hypotheses = len(singles) + conjunctions

    def correction(m: int) -> float:
        log_comb = math.lgamma(hypotheses + 1) - math.lgamma(m + 1) - math.lgamma(hypotheses - m + 1)
        return log_comb + math.log(m * (m + 1))

    used = np.zeros(len(order), dtype=bool)
    found: list[tuple[float, Finding]] = []
    for seed in range(len(order)):
        if used[seed]:
            continue
        used[seed] = True
        chosen = [seed]
        in_u = pool[:, seed].toarray().ravel() > 0
        score = float(log_p[order[seed]]) + correction(1)
        sibling = np.array([f == q_fields[seed] and f != "conjunction" for f in q_fields])
        while len(chosen) < max_members:
            inside = np.asarray(pool.T @ in_u.astype(np.float64)).ravel()
            inside_bad = np.asarray(pool.T @ (in_u & wrong).astype(np.float64)).ravel()
            inside_err = np.asarray(pool.T @ (errors * in_u)).ravel()
            added = q_size - inside
            added_err = q_err - inside_err
            new_size = in_u.sum() + added
            new_bad = int((in_u & wrong).sum()) + (q_bad - inside_bad)
            with np.errstate(divide="ignore", invalid="ignore"):
                joins = (
                    ~used & (added > 0) & ((inside_bad >= COVERED * q_bad) | sibling)
                    & (added_err / np.maximum(added, 1) >= member_lift * overall) & (n - new_size >= min_count)
                )
            if not joins.any():
                break
            price = correction(len(chosen) + 1) - correction(len(chosen))
            joins &= log_p[order] + price <= 0.0
            if not joins.any():
                break
            cand = np.flatnonzero(joins)
            new_scores = _log_sf(new_bad[cand], n, total_bad, new_size[cand]) + correction(len(chosen) + 1)
            best = int(np.argmin(new_scores))
            if not new_scores[best] < score:
                break
            pick = int(cand[best])
            chosen.append(pick)
            used[pick] = True
            in_u |= pool[:, pick].toarray().ravel() > 0
            score = float(new_scores[best])
        inside = np.asarray(pool.T @ in_u.astype(np.float64)).ravel()
        overlap = inside / (q_size + in_u.sum() - inside)
        alternates = [int(i) for i in np.flatnonzero(~used & (overlap >= jaccard))]
        used[alternates] = True
        found.append((score, _finding(
            in_u, errors, wrong, score, [order[i] for i in chosen], [order[i] for i in alternates], name,
            (all_size, all_err, all_bad, log_p), overall, labels, predictions,
        )))
    found.sort(key=lambda sf: (sf[0], -sf[1].lift))
    return Groups([f for _, f in found], len(singles), conjunctions)


def _finding(
    in_u: np.ndarray,
    errors: np.ndarray,
    wrong: np.ndarray,
    log_adjusted: float,
    chosen: list[int],
    alternates: list[int],
    name: Any,
    numbers: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    overall: float,
    labels: np.ndarray | None,
    predictions: np.ndarray | None,
) -> Finding:
    n = len(errors)
    all_size, all_err, all_bad, log_p = numbers
    size = int(in_u.sum())
    rate = float(errors[in_u].mean())
    rest = float(errors[~in_u].mean())
    bad = int((in_u & wrong).sum())
    p_value = float(np.exp(_log_sf(np.array([bad]), n, int(wrong.sum()), np.array([size]))[0]))
    members = tuple(
        Member(name(i), int(all_size[i]), float(all_size[i] / n), float(all_err[i] / all_size[i]),
               float(all_err[i] / all_size[i] / overall), int(all_bad[i]), float(np.exp(log_p[i])))
        for i in chosen
    )
    single = "conjunction" if CONJUNCTION in name(chosen[0])[0] else "slice"
    kind = "disjunction" if len(chosen) > 1 else single
    label = pred = None
    bad_rows = np.flatnonzero(in_u & wrong)
    if labels is not None and predictions is not None and len(bad_rows):
        label = int(Counter(labels[bad_rows].tolist()).most_common(1)[0][0])
        pred = int(Counter(predictions[bad_rows].tolist()).most_common(1)[0][0])
    feature_names = tuple(dict.fromkeys(f for i in [*chosen, *alternates] for f in name(i)))
    return Finding(
        feature_names, size, size / n, rate, rest, rate / overall, bad, p_value,
        float(min(1.0, math.exp(min(log_adjusted, 0.0)))), len(chosen) + len(alternates), label, pred,
        kind=kind, members=members, union_share=size / n, union_error_rate=rate,
        alternates=tuple(f for i in alternates for f in name(i)),
    )
