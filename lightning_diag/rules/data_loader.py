"""Rules of how the data loaders build batches (framework-free, :class:`LoaderRules`): ``batch_size_mismatch``,
``worker_rng_shared``. Fed by :class:`~lightning_diag.DataDiagnostics`. Exact meaning:

* ``batch_size_mismatch`` (warning): the tensors of one batch (a sampled one, or one the
  trainer produced) disagree on their leading dimension, scalars and documented non-batch keys left out
  (:data:`~lightning_diag.instrument.batches.NON_BATCH_KEYS`); source ``train`` / ``val``.
* ``worker_rng_shared`` (warning): the training loader starts ``num_workers > 0`` workers,
  the dataset (or its ``collate_fn``) holds a generator of its own that reading a sample drew from, and no
  ``worker_init_fn`` reseeds it (none, or Lightning's, which reseeds only the global generators): every worker
  starts from a copy of the same state and the "random" augmentations repeat across workers; source ``train``.

Each (rule, source) pair alerts once per fit.
"""

from __future__ import annotations

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import RuleSpec, register
from lightning_diag.rules.base import Rule, StepContext
from lightning_diag.rules.measures import BatchSizes, LoaderStreams, Measure, Measures

__all__ = [
    "BATCH_SIZE_MISMATCH",
    "BATCH_SIZE_MISMATCH_SPEC",
    "WORKER_RNG_SHARED",
    "WORKER_RNG_SHARED_SPEC",
    "LoaderRules",
]

_DATA = "DataDiagnostics"
_EXAMPLES = 5

# -- declarations (one per rule id; the docs\' thresholds table and the report read them) -----------------------
BATCH_SIZE_MISMATCH_SPEC = register(RuleSpec(
    "batch_size_mismatch", _DATA, "warning", None,
    "the tensors of one batch disagree on the leading (batch) dimension",
    source="issue 35 (TrainCheck's published silent errors)",
))
WORKER_RNG_SHARED_SPEC = register(RuleSpec(
    "worker_rng_shared", _DATA, "warning", None,
    "data loader workers draw from copies of one generator the dataset holds (no worker_init_fn reseeds it)",
    source="issue 35 (TrainCheck's published silent errors)",
))
BATCH_SIZE_MISMATCH = BATCH_SIZE_MISMATCH_SPEC.rule_id
WORKER_RNG_SHARED = WORKER_RNG_SHARED_SPEC.rule_id


class LoaderRules(Rule):
    """``batch_size_mismatch`` and ``worker_rng_shared``: how the loaders build batches. One latch (keys
    ``rule:source``); each alerts once per fit and source.

    Example:
        >>> rules = LoaderRules()
        >>> sizes = BatchSizes({"input_ids": 1, "pixel_values": 16, "labels": 16}, "train")
        >>> [(a.rule, a.source) for a in rules.judge(StepContext(0, 0), Measures(batch_sizes=sizes))]
        [('batch_size_mismatch', 'train')]
        >>> rules.judge(StepContext(0, 1), Measures(batch_sizes=BatchSizes({"input_ids": 1, "labels": 16}, "train")))
        []
    """

    specs = (BATCH_SIZE_MISMATCH_SPEC, WORKER_RNG_SHARED_SPEC)
    optional = frozenset({Measure.BATCH_SIZES, Measure.LOADER_STREAMS})

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge what was measured of the loaders: one batch's leading dimensions (``m.batch_sizes``), the training
        loader's random streams (``m.loader_streams``), or both."""
        alerts: list[Alert] = []
        if m.batch_sizes is not None:
            alerts += self._batch_sizes(m.batch_sizes, ctx)
        if m.loader_streams is not None:
            alerts += self._shared_stream(m.loader_streams, ctx)
        return alerts

    def _batch_sizes(self, batch: BatchSizes, ctx: StepContext) -> list[Alert]:
        """Judge one batch's leading dimensions (``{key: rows}`` of its tensors); ``where`` says which batch."""
        sizes, split, where = batch.sizes, batch.split, batch.where
        counts: dict[int, list[str]] = {}
        for key, rows in sizes.items():
            counts.setdefault(int(rows), []).append(key)
        if len(counts) < 2 or not self.latch.update(f"{BATCH_SIZE_MISMATCH}:{split}", True):
            return []
        ranked = sorted(counts.items(), key=lambda kv: (-len(kv[1]), -kv[0]))
        parts = "; ".join(
            f"{_keys(keys)} {'has' if len(keys) == 1 else 'have'} {rows} row{'s' if rows != 1 else ''}"
            for rows, keys in ranked
        )
        expected = ranked[0][0]
        return [
            self._alert(
                ctx,
                f"the tensors of a {split} batch{where} disagree on the batch (first) dimension: {parts}. "
                "Broadcasting can hide it (a loss over a 1-row input repeated against every label, inputs paired "
                "with the wrong samples); check the collate_fn and the dataset's __getitem__",
                source=split,
                value=float(min(counts)),
                threshold=float(expected),
                rule=BATCH_SIZE_MISMATCH,
            )
        ]

    def _shared_stream(self, streams: LoaderStreams, ctx: StepContext) -> list[Alert]:
        """Judge the training loader: ``paths`` of the dataset's own generators that reading a sample drew from,
        its ``num_workers``, and its ``worker_init_fn`` (``""``: none; else a description)."""
        paths, num_workers, worker_init = streams.paths, streams.num_workers, streams.worker_init
        if not paths or num_workers <= 0 or not self.latch.update(f"{WORKER_RNG_SHARED}:train", True):
            return []
        init = f"its worker_init_fn ({worker_init}) reseeds only the global generators" if worker_init else (
            "no worker_init_fn reseeds it"
        )
        return [
            self._alert(
                ctx,
                f"the training loader's {num_workers} workers draw from copies of one random stream: "
                f"{_keys(list(paths))} is a generator the dataset holds itself, each worker gets a copy of it in "
                f"the same state, and {init}. The workers' random augmentations repeat each other; reseed it per "
                "worker in a worker_init_fn (from torch.utils.data.get_worker_info().seed, which differs per "
                "worker and epoch), or draw from torch's global generator in __getitem__ (reseeded per worker)",
                source="train",
                value=float(num_workers),
                threshold=None,
                rule=WORKER_RNG_SHARED,
            )
        ]


def _keys(keys: list[str]) -> str:
    shown = ", ".join(f"`{k}`" for k in keys[:_EXAMPLES])
    return shown + (f" and {len(keys) - _EXAMPLES} more" if len(keys) > _EXAMPLES else "")
