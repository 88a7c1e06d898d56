"""GradientFlowMonitor's silent-error sampling: ``update_none`` / ``update_stale`` and ``grad_not_zeroed``.

Split out of :mod:`lightning_diag.callbacks.gradient_flow.monitor` (which mixes :class:`SilentUpdateChecks` into
:class:`~lightning_diag.GradientFlowMonitor`). Everything here runs on measured steps, or, for
``grad_not_zeroed``, between a measured optimizer step and the same optimizer's next step; on any other step each
hook is one empty-container test.

``grad_not_zeroed``'s exact criterion, per parameter an optimizer holds: at a backward its ``.grad`` still holds a
non-zero gradient left from before its own optimizer's last ``step()`` (not set to ``None`` or zero at any backward
since), that backward adds to it, and the optimizer's next ``step()`` applies it (the parameter was not zeroed
before that step's backward either). Measured on :data:`ZEROED_SAMPLE_SIZE` evenly spaced elements per parameter,
on the device: a parameter whose sampled elements all have a zero gradient is not judged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import pytorch_lightning as pl
import torch

from lightning_diag.callbacks.common.preset import Feed
from lightning_diag.core.tags import updates_unchanged_tag
from lightning_diag.instrument.grad_measure import ParamIndex, read_with
from lightning_diag.rules.base import StepContext
from lightning_diag.rules.measures import Measures, StaleGrads
from lightning_diag.rules.records import LayerUpdate
from lightning_diag.stats.updates import ElementSample, segment_any, unchanged_counts

__all__ = ["ZEROED_SAMPLE_SIZE", "PendingUpdate", "SilentUpdateChecks", "ZeroGradWatch", "optimizer_position"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)
#: Elements per parameter read by ``grad_not_zeroed`` at each backward it watches.
ZEROED_SAMPLE_SIZE = 8
#: A watch whose optimizer has not stepped again within this many measuring intervals is dropped (not judged).
ZEROED_WATCH_INTERVALS = 4
#: Checkpoint key (inside GradientFlowMonitor's state) of the ``grad_not_zeroed`` watches and unread verdicts.
ZEROED_STATE_KEY = "zeroed"


class PendingUpdate:
    """The sampled elements of one measured optimizer step, read before it (compared after it)."""

    def __init__(
        self, positions: list[int], sample: ElementSample, before: torch.Tensor, grads: torch.Tensor,
        low_precision: list[bool], causes: list[str | None],
    ) -> None:
        self.positions = positions
        self.sample = sample
        self.before = before
        self.grads = grads
        self.low_precision = low_precision
        self.causes = causes


class _Watch:
    """One optimizer's parameters from its measured step to its next step (device flags, one per parameter)."""

    def __init__(
        self, positions: list[int], sample: ElementSample, stale: torch.Tensor, added: torch.Tensor, armed_at: int
    ) -> None:
        self.positions = positions
        self.armed_at = armed_at
        self.sample = sample
        #: ``.grad`` still non-zero since the step (never found ``None``/zero at a backward since)
        self.stale = stale
        #: a backward added to the left-over gradient
        self.added = added
        self.before: torch.Tensor | None = None
        #: every watched ``.grad`` was ``None`` at a backward since the step (``zero_grad``'s default), known on the
        #: host: nothing is left over, :attr:`stale` is all false for good and no later backward is read
        self.cleared = False


class ZeroGradWatch:
    """``grad_not_zeroed``'s device-side bookkeeping over a list of parameters (no Lightning, no host read).

    :meth:`arm` at an optimizer's measured step, :meth:`before_backward` / :meth:`after_backward` around every
    backward, :meth:`before_step` at every step of an optimizer with a watch: its verdict (one bool per parameter:
    not zeroed) joins :attr:`verdicts`, read by the caller with its next host read.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(4))
        >>> w.grad = torch.ones(4)
        >>> watch = ZeroGradWatch()
        >>> watch.arm(0, [0], [w])
        >>> watch.before_backward([w]); w.grad += 1; watch.after_backward([w])  # no zero_grad: added to
        >>> watch.before_step(0)
        >>> [flags.tolist() for _, _, flags in watch.verdicts]
        [[True]]
    """

    def __init__(self, size: int = ZEROED_SAMPLE_SIZE) -> None:
        self.size = size
        self.watches: dict[int, _Watch] = {}
        #: (optimizer position, parameter positions, device bool flags "not zeroed") not yet read
        self.verdicts: list[tuple[int, list[int], torch.Tensor]] = []
        self._samples: dict[tuple[int, ...], ElementSample] = {}

    def clear(self) -> None:
        """Forget every watch and verdict (a new fit)."""
        self.watches.clear()
        self.verdicts.clear()
        self._samples.clear()

    def _sample(self, positions: list[int], params: Sequence[torch.Tensor]) -> ElementSample:
        key = tuple(positions)
        sample = self._samples.get(key)
        if sample is None:
            sample = self._samples[key] = ElementSample([params[i] for i in positions], self.size)
        return sample

    def arm(self, optimizer: int, positions: list[int], params: Sequence[torch.Tensor], step: int = 0) -> None:
        """At a measured step of ``optimizer`` (global ``step``): watch ``positions`` (parameters it holds with a
        ``.grad``)."""
        self.watches.pop(optimizer, None)
        if not positions:
            return
        sample = self._sample(positions, params)
        grads = sample.gather([params[i].grad for i in positions])
        stale = segment_any(grads != 0, sample.segment, sample.count)
        self.watches[optimizer] = _Watch(positions, sample, stale, torch.zeros_like(stale), step)

    def before_backward(self, params: Sequence[torch.Tensor]) -> None:
        """A backward starts: a gradient set to ``None`` or zero since the step is no longer left over."""
        for w in self.watches.values():
            if w.cleared:
                continue
            found = [params[i].grad for i in w.positions]
            if all(g is None for g in found):
                # every gradient set to None: the flags the device would compute (no sampled element non-zero) are
                # known here; one operator instead of reading this backward and the next (a measuring step's
                # following backward in the usual loop)
                w.stale.zero_()
                w.cleared = True
                w.before = None
                continue
            grads = w.sample.gather(found)
            w.stale &= segment_any(grads != 0, w.sample.segment, w.sample.count)
            w.before = grads

    def after_backward(self, params: Sequence[torch.Tensor]) -> None:
        """A backward ended: the left-over gradients it changed were added to."""
        for w in self.watches.values():
            if w.before is None:  # a backward whose start was not seen (armed in between)
                continue
            grads = w.sample.gather([params[i].grad for i in w.positions])
            w.added |= w.stale & segment_any(grads != w.before, w.sample.segment, w.sample.count)
            w.before = None

    def before_step(self, optimizer: int) -> None:
        """``optimizer`` is about to step: the verdict of its watch, if any (added to and never zeroed)."""
        w = self.watches.pop(optimizer, None)
        if w is not None:
            self.verdicts.append((optimizer, w.positions, w.added & w.stale))

    def expire(self, before: int) -> None:
        """Drop the watches armed before global step ``before`` (an optimizer that stopped stepping)."""
        for k in [k for k, w in self.watches.items() if w.armed_at < before]:
            del self.watches[k]

    def take_verdicts(self) -> list[tuple[int, list[int], torch.Tensor]]:
        """The verdicts not yet read (and forget them)."""
        verdicts, self.verdicts = self.verdicts, []
        return verdicts


class SilentUpdateChecks:
    """The update sampling and ``grad_not_zeroed`` watch of :class:`~lightning_diag.GradientFlowMonitor`.

    A mixin: the host class provides ``_index``, ``_measured_loss`` (the measured step's training loss),
    ``update_sample_size``, ``writer``, ``record``,
    ``threshold_lines`` and ``feed`` (which judges what this measured with the preset's detectors), and its preset
    module sets :attr:`stale_id` (``update_stale``'s id: its threshold is written beside the logged shares).
    """

    _index: ParamIndex | None
    _measured_loss: float | None
    update_sample_size: int
    writer: Any
    record: Callable[..., Any]
    feed: Feed
    threshold_lines: Callable[..., dict[str, float]]
    stale_id: ClassVar[str]
    every_n_steps: Callable[[pl.Trainer], int]

    def _reset_update_state(self) -> None:
        self._samples: dict[tuple[int, ...], ElementSample] = {}
        self._pending_updates: list[PendingUpdate] = []
        self._stepped = False
        self._zero = ZeroGradWatch()
        # grad_not_zeroed verdicts loaded from a checkpoint, by parameter name: re-created at the first backward
        self._zero_restored: dict[str, Any] | None = None
        self._zero_names: dict[int, str] = {}  # optimizer position -> name for messages
        # restored watches the reload left nothing to judge in (optimizer positions), and those closed since the
        # last read: each is a check without a verdict (:meth:`_restore_zeroed`)
        self._zero_undecided: set[int] = set()
        self._zero_undecided_closed = 0

    # -- grad_not_zeroed ---------------------------------------------------------------------------------------
    def _zero_before_backward(self, build_index: Callable[[], ParamIndex]) -> None:
        if self._zero_restored is not None:
            if self._index is None:
                self._index = build_index()
            self._restore_zeroed(self._index)
        if self._zero.watches:
            assert self._index is not None
            self._zero.before_backward(self._index.params)

    def _zero_after_backward(self) -> None:
        if self._zero.watches and self._index is not None:
            self._zero.after_backward(self._index.params)

    def _zero_before_step(self, trainer: pl.Trainer, optimizer: Any) -> None:
        if self._zero.watches:
            self._zero.before_step(optimizer_position(trainer, optimizer))
        if self._zero_undecided:
            position = optimizer_position(trainer, optimizer)
            if position in self._zero_undecided:
                self._zero_undecided.discard(position)
                self._zero_undecided_closed += 1

    def _zero_arm(self, trainer: pl.Trainer, position: int, chosen: list[int]) -> None:
        assert self._index is not None
        opt = trainer.optimizers[position] if position < len(trainer.optimizers) else None
        if opt is not None:
            self._zero_names[position] = f"optimizer {position} ({type(opt).__name__})"
        self._zero.arm(position, chosen, self._index.params, trainer.global_step)

    def _zeroed_state(self) -> dict[str, Any]:
        """The open watches and the verdicts not yet read, by parameter name (host lists: one small read at
        checkpoint time).

        Gradients are not in a checkpoint: a resumed run starts with every ``.grad`` ``None``, which the reload
        made, not the user's code. A restored watch judges only the parameters still holding a ``.grad`` at its
        first backward (a resume in the same process, on the same model); the others are not judged, and a watch
        left with none closes without a verdict (:meth:`_restore_zeroed`).
        """
        if self._zero_restored is not None:  # saved again before the restored state was used
            return self._zero_restored
        names = self._index.names if self._index is not None else []
        verdicts = [
            {"optimizer": k, "params": [names[i] for i, f in zip(positions, flags.tolist(), strict=True) if f]}
            for k, positions, flags in self._zero.verdicts
        ]
        watches = [
            {
                "optimizer": k, "params": [names[i] for i in w.positions], "stale": w.stale.tolist(),
                "added": w.added.tolist(), "armed_at": w.armed_at,
            }
            for k, w in self._zero.watches.items()
        ]  # fmt: skip
        return {"verdicts": verdicts, "watches": watches}

    def _load_zeroed_state(self, state: dict[str, Any]) -> None:
        """Keep a checkpoint's open watches and unread ``grad_not_zeroed`` verdicts."""
        self._zero.clear()
        restored = {"verdicts": list(state["verdicts"]), "watches": list(state["watches"])}
        self._zero_restored = restored if restored["verdicts"] or restored["watches"] else None

    def _restore_zeroed(self, index: ParamIndex) -> None:
        """Re-create the checkpoint's verdicts and open watches, at the first backward after the load.

        A watched parameter whose ``.grad`` is ``None`` here lost its left-over gradient in the reload: whether
        the user's code would have zeroed it cannot be told, so it is not judged. Judging it would close the
        watch healthy, and that healthy check would release a latched ``grad_not_zeroed`` alert, which alerts
        again at the next check of a run that still never zeroes. A watch left with no parameter to judge still
        closes at its optimizer's next step: it counts as a check, as in the uninterrupted run, without a verdict
        (the latch is left as it is).
        """
        state, self._zero_restored = self._zero_restored, None
        assert state is not None
        where = {n: i for i, n in enumerate(index.names)}
        device = index.params[0].device if index.params else torch.device("cpu")
        for v in state["verdicts"]:
            positions = [where[n] for n in v["params"] if n in where]
            # only the flagged parameters were saved: every flag set
            self._zero.verdicts.append(
                (int(v["optimizer"]), positions, torch.ones(len(positions), dtype=torch.bool, device=device))
            )
        for w in state.get("watches", []):
            kept = [(where[n], st, ad) for n, st, ad in zip(w["params"], w["stale"], w["added"], strict=True)
                    if n in where and index.params[where[n]].grad is not None]  # fmt: skip
            if not kept:
                self._zero_undecided.add(int(w["optimizer"]))
                continue
            positions = [i for i, _, _ in kept]
            sample = self._zero._sample(positions, index.params)
            flags = [torch.tensor([x[j] for x in kept], dtype=torch.bool, device=device) for j in (1, 2)]
            self._zero.watches[int(w["optimizer"])] = _Watch(positions, sample, flags[0], flags[1], int(w["armed_at"]))

    # -- update_none / update_stale ----------------------------------------------------------------------------
    def _sample_updates(
        self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer, index: ParamIndex, position: int
    ) -> None:
        """Read the sampled elements and gradients of the parameters this step should change (device only)."""
        with_grad = [i for i, p in enumerate(index.params) if p.grad is not None]
        if not with_grad:
            return
        lr_of = {id(p): group.get("lr", None) for group in optimizer.param_groups for p in group["params"]}
        in_any = {id(p) for opt in trainer.optimizers for group in opt.param_groups for p in group["params"]}
        if not any(id(index.params[i]) in in_any for i in with_grad):
            if position != 0:
                return  # the optimizers hold none of them: judged once per interval, with the first optimizer
            positions = with_grad
            causes: list[str | None] = ["no_optimizer"] * len(with_grad)
        else:
            positions = [i for i in with_grad if id(index.params[i]) in lr_of]
            causes = [
                "lr_zero" if isinstance(lr_of[id(index.params[i])], (int, float)) and lr_of[id(index.params[i])] == 0
                else None
                for i in positions
            ]
        if not positions:
            return
        key = tuple(positions)
        sample = self._samples.get(key)
        if sample is None:
            sample = self._samples[key] = ElementSample([index.params[i] for i in positions], self.update_sample_size)
        params = [index.params[i] for i in positions]
        before = sample.gather(params)
        grads = sample.gather([p.grad for p in params])
        low = [p.dtype in _LOW_PRECISION for p in params]
        self._pending_updates.append(PendingUpdate(positions, sample, before, grads, low, causes))

    def _judge_updates(self, trainer: pl.Trainer, extra: torch.Tensor | None = None) -> list[float] | None:
        """Compare the sampled elements after the step, read the ``grad_not_zeroed`` verdicts, judge (one host
        read for both, and for ``extra``: a 1-D float32 tensor of the caller's, read in the same copy after the
        counts' reduction across ranks, not reduced; its host values are returned, ``None`` without it)."""
        assert self._index is not None
        index = self._index
        pending, self._pending_updates = self._pending_updates, []
        verdicts = self._zero.take_verdicts()
        undecided, self._zero_undecided_closed = self._zero_undecided_closed, 0
        step = max(trainer.global_step - 1, 0)  # the step that was measured
        ctx = StepContext(trainer.current_epoch, step)
        if undecided and not verdicts:  # one check per read, as with verdicts (the rule counts its updates)
            self.record(self.feed(ctx, Measures(stale_grads=StaleGrads((), decided=False))))  # the latch as it is
        self._zero.expire(trainer.global_step - ZEROED_WATCH_INTERVALS * self.every_n_steps(trainer))
        parts = [
            unchanged_counts(u.before, u.sample.gather([index.params[i] for i in u.positions]), u.grads,
                             u.sample.segment, u.sample.count).reshape(-1)
            for u in pending
        ]
        parts += [flags.float() for _, _, flags in verdicts]
        if not parts:
            return None if extra is None else extra.tolist()
        device = parts[0].device
        values = torch.cat([p.to(device) for p in parts])
        if trainer.world_size > 1:  # sharded parameters: every rank counts its own shard; all decide on the sum
            values = trainer.strategy.reduce(values, reduce_op="sum")
        host, extra_host = read_with([values], extra)  # the one host read of the update rules (and the extra)
        offset = 0
        layers: dict[str, list[Any]] = {}
        for u in pending:
            n = u.sample.count
            counted, unchanged = host[offset : offset + n], host[offset + n : offset + 2 * n]
            offset += 2 * n
            for k, i in enumerate(u.positions):
                layer = index.layers[index.layer_of[i]]
                entry = layers.setdefault(layer, [0, 0, False, set()])
                entry[0] += int(counted[k])
                entry[1] += int(unchanged[k])
                entry[2] = entry[2] or u.low_precision[k]
                entry[3].add(u.causes[k])
        if layers:
            updates = {
                layer: LayerUpdate(c, s, low, next(iter(causes)) if len(causes) == 1 else None)
                for layer, (c, s, low, causes) in layers.items()
            }
            shares = {updates_unchanged_tag(k): v.share for k, v in updates.items() if v.counted}
            self.writer.scalars({**shares, **self.threshold_lines(self.stale_id)}, step)
            # the measured step's training loss (the first optimizer's; GradientFlowMonitor keeps it until the
            # update ratios are judged, after this)
            self.record(self.feed(ctx, Measures(layer_updates=updates, loss=self._measured_loss)))
        if verdicts:
            stale: set[str] = set()
            optimizers: set[str] = set()
            for k, positions, _ in verdicts:
                flags = host[offset : offset + len(positions)]
                offset += len(positions)
                hit = [i for i, f in zip(positions, flags, strict=True) if f > 0]
                if hit:
                    stale.update(index.layers[index.layer_of[i]] for i in hit)
                    optimizers.add(self._zero_names.get(k, f"optimizer {k}"))
            self.record(self.feed(ctx, Measures(stale_grads=StaleGrads(stale, sorted(optimizers)))))
        return None if extra is None else extra_host


def _unwrap(optimizer: Any) -> Any:
    # trainer.optimizers holds the torch optimizers; a manual `opt.step()` may hand over a LightningOptimizer.
    return getattr(optimizer, "optimizer", optimizer)


def optimizer_position(trainer: pl.Trainer, optimizer: Any) -> int:
    """The optimizer's position in ``trainer.optimizers`` (0 when it is not there)."""
    target = _unwrap(optimizer)
    return next((i for i, opt in enumerate(trainer.optimizers) if _unwrap(opt) is target), 0)
