"""Ground truth for the calibration harness's throughput rule (issue 44): how much of a run's step really is
waiting for data, measured without lightning_diag.

A healthy run is healthy in the sense that it converges; whether its training loop waits for its data loader is a
fact about its settings that the run's label does not decide. The harness therefore measures it for every healthy
run that watches ``dataloader_bound`` (:data:`ORACLES`), after the fit, by a method of its own (no hook timing, no
lightning_diag code):

* **data**: the run's own train dataloader (``trainer.train_dataloader``) is iterated for up to
  :data:`ORACLE_BATCHES` batches (at most an epoch's), timing ``iter()`` and each ``next()`` alone. ``iter()`` is
  paid once an epoch, so it is spread over the epoch's batches. With ``num_workers=0`` this is exactly what the
  training loop waits for (the main process collates while the model waits). With workers, the loader is iterated
  a second time with the measured compute time slept between two ``next()`` calls, as the training loop leaves the
  workers that time to prefetch;
* **compute**: the same batches, already collated in memory, are trained on by a bare ``Trainer.fit`` of the run's
  own module (same Lightning flavour, precision, accumulation and clipping; no callback but a clock; no
  validation): the mean time between two ends of a training batch, the first step (optimizer state, lazy
  initialisation) left out. At least :data:`MIN_COMPUTE_STEPS` steps (the batches cycle);
* **share** = data / (data + compute), the quantity ``dataloader_bound`` compares with its threshold; the rule
  also needs the waiting above its ``min_wait_s`` per step, so the oracle's excess (:func:`loader_excess`) is the
  smaller of the two, as the rule's.

:func:`verdict` turns the excess into what the harness counts: above :data:`TRUE_FACTOR` a true finding (an alarm
is a detection, no alarm a miss), below its inverse quiet (an alarm is a false alarm), between ambiguous (neither).

The module is trained on for a few more steps after the run's record was taken: the record is not affected.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import itertools
import math
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning_diag.rules.dataloader_bound import DATALOADER_BOUND, DEFAULT_DATALOADER_BOUND_MIN_WAIT_S

#: Batches read (and trained on) per run, at most an epoch's.
ORACLE_BATCHES = 30
#: Training steps of the compute pass at least (the batches cycle where the epoch is shorter).
MIN_COMPUTE_STEPS = 4
#: A healthy run whose oracle excess (1.0 at the rule's threshold) is above ``TRUE_FACTOR`` is a true finding (an
#: alarm there is a detection, no alarm a miss); below ``1 / TRUE_FACTOR`` it is quiet (an alarm is a false
#: alarm); between, ambiguous (neither counts).
TRUE_FACTOR = 1.2
#: Verdicts of :func:`verdict`.
TRUE_FINDING, AMBIGUOUS, QUIET = "true finding", "ambiguous", "quiet"


class _Done(Exception):
    """Raised by the compute pass's clock once it has its steps (before any epoch-end hook runs)."""


def _as_is(batch: Any) -> Any:
    return batch


def _lightning(trainer: Any) -> Any:
    """The Lightning package ``trainer`` belongs to (``lightning.pytorch`` or ``pytorch_lightning``)."""
    return importlib.import_module(
        "lightning.pytorch" if type(trainer).__module__.startswith("lightning.") else "pytorch_lightning"
    )


def compute_per_batch(trainer: Any, batches: Sequence[Any], root: str) -> float:
    """Seconds per training batch of ``trainer``'s module on ``batches`` (already collated), by a bare fit.

    Raises:
        RuntimeError: If the fit ended before two timed steps.
    """
    import torch

    lib = _lightning(trainer)
    steps = max(len(batches), MIN_COMPUTE_STEPS)
    feed = [batches[i % len(batches)] for i in range(steps)]
    stamps: list[float] = []

    class Clock(lib.Callback):  # type: ignore[misc, name-defined]
        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            stamps.append(time.perf_counter())
            if len(stamps) >= steps:
                raise _Done  # stop before the epoch's end: a plateau scheduler would ask for validation metrics

    bare = type(trainer)(
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        precision=trainer.precision,
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        gradient_clip_val=trainer.gradient_clip_val,
        gradient_clip_algorithm=trainer.gradient_clip_algorithm,
        callbacks=[Clock()],
    )
    loader = torch.utils.data.DataLoader(feed, batch_size=None, collate_fn=_as_is)
    with contextlib.suppress(_Done):
        bare.fit(trainer.lightning_module, train_dataloaders=loader)
    if len(stamps) < 2:
        raise RuntimeError(f"the bare fit timed {len(stamps)} steps")
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return sum(gaps) / len(gaps)


def _read(loader: Any, n: int, pause_s: float = 0.0) -> tuple[float, list[float], list[Any]]:
    """``(iter() seconds, each next()'s seconds, the batches)`` of up to ``n`` batches of ``loader``, sleeping
    ``pause_s`` after each (the time a training step leaves the loader's workers)."""
    start = time.perf_counter()
    it = iter(loader)
    opened = time.perf_counter() - start
    waits: list[float] = []
    batches: list[Any] = []
    for _ in range(n):
        start = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        waits.append(time.perf_counter() - start)
        batches.append(batch)
        if pause_s > 0:
            time.sleep(pause_s)
    del it  # shuts the workers down
    return opened, waits, batches


def data_share(trainer: Any, batches: int = ORACLE_BATCHES) -> dict[str, Any]:
    """The share of a training step spent waiting for data, measured on ``trainer``'s run after its fit.

    Returns:
        ``share``, ``data_s`` and ``compute_s`` (seconds per batch), ``batches`` read, ``workers`` (the loader's
        ``num_workers``) and ``seconds`` (the oracle's own time); or ``error`` where it cannot be measured (no
        single train dataloader, an empty one, a module the bare fit cannot train).
    """
    start = time.perf_counter()
    loader = trainer.train_dataloader
    if loader is None or isinstance(loader, (Mapping, list, tuple)) or not hasattr(loader, "__iter__"):
        return {"error": f"not one train dataloader: {type(loader).__name__}"}
    per_epoch = trainer.num_training_batches
    epoch = int(per_epoch) if isinstance(per_epoch, int) or math.isfinite(per_epoch) else None
    n = max(1, min(batches, epoch or batches))
    workers = int(getattr(loader, "num_workers", 0) or 0)
    try:
        opened, waits, collated = _read(loader, n)
        if not collated:
            return {"error": "the train dataloader is empty"}
        with tempfile.TemporaryDirectory() as root:
            compute = compute_per_batch(trainer, collated, root)
        if workers:
            opened, waits, _ = _read(loader, len(collated), pause_s=compute)
    except Exception as err:  # a run the oracle cannot measure is reported, not a crash of the harness
        return {"error": f"{type(err).__name__}: {err}"}
    data = opened / max(epoch or len(waits), len(waits)) + sum(waits) / len(waits)
    return {
        "share": data / (data + compute),
        "data_s": data,
        "compute_s": compute,
        "batches": len(waits),
        "workers": workers,
        "seconds": time.perf_counter() - start,
    }


def loader_excess(measured: Mapping[str, Any], threshold: float) -> float:
    """The oracle's excess for ``dataloader_bound``, as the rule's own (:meth:`Rule.observe`): the smaller of the
    share over ``threshold`` and the waiting per step over the rule's ``min_wait_s`` (below which it never fires by
    its contract: a loader that costs a millisecond a step is no bottleneck worth a warning)."""
    return min(float(measured["share"]) / threshold, float(measured["data_s"]) / DEFAULT_DATALOADER_BOUND_MIN_WAIT_S)


@dataclasses.dataclass(frozen=True)
class Oracle:
    """The ground truth of one rule: ``measure(trainer)`` after the fit, and ``excess(measured, threshold)``, 1.0
    where the run sits at the rule's threshold by the oracle's measure."""

    measure: Callable[[Any], dict[str, Any]]
    excess: Callable[[Mapping[str, Any], float], float]


#: The rules with an oracle, by rule id.
ORACLES: dict[str, Oracle] = {DATALOADER_BOUND: Oracle(data_share, loader_excess)}


def measure(trainer: Any, rules: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The oracles of ``rules`` (those of :data:`ORACLES`) on ``trainer``, by rule id."""
    return {rule: ORACLES[rule].measure(trainer) for rule in rules if rule in ORACLES}


def oracle_excess(record: Mapping[str, Any], rule: str, threshold: float | None) -> float | None:
    """The oracle's excess for ``rule`` on a record's run (1.0 at ``threshold``); ``None`` without a measurement
    (no oracle for the rule, an older record, a run it could not measure)."""
    measured = record.get("oracle", {}).get(rule, {})
    if rule not in ORACLES or threshold is None or "share" not in measured:
        return None
    return ORACLES[rule].excess(measured, threshold)


def verdict(record: Mapping[str, Any], rule: str, threshold: float | None) -> str | None:
    """What the oracle says of a record's run for ``rule``: :data:`TRUE_FINDING` (its excess above
    :data:`TRUE_FACTOR`), :data:`QUIET` (below ``1 / TRUE_FACTOR``), :data:`AMBIGUOUS` (between); ``None``
    without a measurement.

    Example:
        >>> rec = {"oracle": {"dataloader_bound": {"share": 0.5, "data_s": 0.02}}}
        >>> verdict(rec, "dataloader_bound", 0.25), verdict(rec, "dataloader_bound", 0.45)
        ('true finding', 'ambiguous')
        >>> verdict({"oracle": {"dataloader_bound": {"share": 0.5, "data_s": 0.002}}}, "dataloader_bound", 0.25)
        'quiet'
        >>> verdict(rec, "grad_explode", 10.0) is None
        True
    """
    excess = oracle_excess(record, rule, threshold)
    if excess is None:
        return None
    if excess > TRUE_FACTOR:
        return TRUE_FINDING
    if excess < 1 / TRUE_FACTOR:
        return QUIET
    return AMBIGUOUS
