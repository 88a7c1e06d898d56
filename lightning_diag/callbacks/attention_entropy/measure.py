"""What AttentionEntropyMonitor does with a sampled step's records: one host copy of every module's per-head
statistics (reduced over ranks, heads placed at their global index under tensor parallelism), the head distances,
and the images. The monitor itself (:mod:`lightning_diag.callbacks.attention_entropy.monitor`) sets the capture up."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch

from lightning_diag.core.tags import attn_distance_tag, attn_heads_tag, attn_map_tag
from lightning_diag.instrument.attention_record import AttentionRecorder
from lightning_diag.output.images import heatmap, scatter, tile
from lightning_diag.output.writer import DiagWriter
from lightning_diag.rules.records import LayerStats
from lightning_diag.stats.attention_probs import head_pca, head_similarity

__all__ = ["IMAGE_KEYS", "draw_images", "no_attention_message", "reduce_distances", "reduce_stats"]

#: Keys shown at most per heatmap.
IMAGE_KEYS = 128


def no_attention_message(recorder: AttentionRecorder, filtered: bool = False) -> str:
    """What was looked for on a step where no attention was recognised, and which softmaxes were not taken.

    Example:
        >>> recorder = AttentionRecorder(8, 64, ())
        >>> recorder.unrecognised["head"] = "a softmax over dim -1 of a 2-D tensor"
        >>> print(no_attention_message(recorder))  # doctest: +NORMALIZE_WHITESPACE
        no attention recognised: looked for nn.MultiheadAttention modules, scaled_dot_product_attention calls,
        softmax in modules named ...Attention (Hugging Face eager) and softmax-weighted matmuls (a softmax over
        the last dim of query-key scores whose output weights values through matmul / bmm / einsum / @); not
        recognised as attention: `head` (a softmax over dim -1 of a 2-D tensor); nothing was handed over through
        record_attention(): attention entropy is not measured
    """
    looked = (
        "no attention recognised"
        + (" in the modules matching `modules`" if filtered else "")
        + ": looked for nn.MultiheadAttention modules, scaled_dot_product_attention calls, softmax in modules"
        " named ...Attention (Hugging Face eager) and softmax-weighted matmuls (a softmax over the last dim of"
        " query-key scores whose output weights values through matmul / bmm / einsum / @)"
    )
    items = list(recorder.unrecognised.items())
    if items:
        shown = "; ".join(f"`{name}` ({reason})" for name, reason in items[:4])
        more = f"; and {len(items) - 4} more" if len(items) > 4 else ""
        looked += f"; not recognised as attention: {shown}{more}"
    return looked + "; nothing was handed over through record_attention(): attention entropy is not measured"


def reduce_stats(
    trainer: pl.Trainer,
    recorder: AttentionRecorder,
    loss: torch.Tensor | None,
    notice: Callable[[str, str], None],
    filtered: bool = False,
    peaks: dict[str, float] | None = None,
) -> tuple[dict[str, LayerStats], float] | None:
    """One host copy of every module's statistics, averaged over ranks (weighted by valid rows), and of the
    sampled batch's training loss (averaged over the ranks that have one; ``nan`` when none has).

    ``notice(key, message)`` says once what is not measured; ``filtered``: the monitor watches only some modules;
    ``peaks``, if given, receives each module's peak attention logit (``recorder.logit_peaks``, averaged over the
    ranks that saw it) in the same copy.
    """
    names = list(recorder.stats)
    distributed = trainer.world_size > 1
    if distributed:
        # Every rank reaches this point on the same step; agree on the module count before reducing.
        count = torch.tensor([len(names), -len(names)], dtype=torch.float32, device=trainer.strategy.root_device)
        count = trainer.strategy.reduce(count, reduce_op="max")
        if int(count[0]) != -int(count[1]):
            notice(
                "ranks-differ",
                "ranks recorded different attention modules on one step; each rank's statistics are its own",
            )
            distributed = False
    if not names:
        notice("no-attention", no_attention_message(recorder, filtered))
        return None
    # Tensor parallelism: a rank holds heads tp_rank * H_local ... of H_local * tp_size; each value goes to
    # its global head's slot (zeros elsewhere) with a per-head row count, so the sum over ranks gives every
    # head once per data-parallel group, averaged over those groups like DDP's ranks.
    heads: list[int] = []
    parts = []
    for n in names:
        s = recorder.stats[n]
        rows = s.rows.reshape(-1)[:1].float()
        local = int(s.entropy.numel())
        tp_rank, tp_size = recorder.head_shards.get(n, (0, 1)) if distributed else (0, 1)
        heads.append(local * tp_size)

        def place(v: torch.Tensor, local: int = local, tp_rank: int = tp_rank, tp_size: int = tp_size) -> Any:
            if tp_size == 1:
                return v.reshape(-1).float()
            out = torch.zeros(local * tp_size, dtype=torch.float32, device=v.device)
            out[tp_rank * local : (tp_rank + 1) * local] = v.reshape(-1).float()
            return out

        unknown = torch.full_like(s.entropy, float("nan"))
        first = s.first_mass if s.first_mass is not None else unknown
        coverage = s.coverage if s.coverage is not None else unknown
        causal = s.causal if s.causal is not None else torch.zeros((), device=rows.device)
        parts += [place(s.entropy * rows), place(s.uniform * rows), place(s.special_mass * rows)]
        parts += [place(s.special_share * rows), place(first * rows), place(coverage * rows)]
        parts += [causal.reshape(1) * rows, rows, place(rows.expand(local))]
    # the peak logits and the loss ride along in the same copy: [value, 1] where known, [0, 0] where not
    device = parts[0].device if parts else trainer.strategy.root_device
    for n in names:
        peak = recorder.logit_peaks.get(n) if peaks is not None else None
        if peak is None:
            parts.append(torch.zeros(2, device=device))
        else:
            parts.append(torch.stack([peak.float().reshape(()).to(device), torch.ones((), device=device)]))
    if loss is not None:
        parts.append(torch.stack([loss.detach().float().reshape(()).to(device), torch.ones((), device=device)]))
    else:
        parts.append(torch.zeros(2, device=device))
    flat = torch.cat([p.reshape(-1).float() for p in parts])
    if distributed:
        flat = trainer.strategy.reduce(flat, reduce_op="sum")
    host = flat.tolist()  # the one copy of this sampled step
    loss_sum, loss_ranks = host[-2:]
    batch_loss = loss_sum / loss_ranks if loss_ranks > 0 else math.nan
    layers: dict[str, LayerStats] = {}
    i = 0
    for name, h in zip(names, heads, strict=True):
        chunk = host[i : i + 7 * h + 2]
        i += 7 * h + 2
        rows = chunk[6 * h + 1]
        head_rows = chunk[6 * h + 2 :]
        if rows <= 0 or min(head_rows) <= 0:
            continue
        cols = [[v / r for v, r in zip(chunk[j * h : (j + 1) * h], head_rows, strict=True)] for j in range(6)]
        # causal only when every rank's rows are: the summed flag is the same number on every rank
        is_causal = chunk[6 * h] / rows > 1 - 1e-6
        entropy, uniform, mass, share, first_mass, cover = cols
        layers[name] = LayerStats(entropy, uniform, mass, share, first_mass, is_causal, cover)
    if peaks is not None:
        for name in names:
            total, seen = host[i], host[i + 1]
            i += 2
            if seen > 0 and name in layers:
                peaks[name] = total / seen
    return layers, batch_loss


def reduce_distances(
    trainer: pl.Trainer, recorder: AttentionRecorder, names: list[str], distributed: bool
) -> dict[str, float]:
    """``diag/attn_distance[_relative]/<module>/head_<h>`` of the self-attention modules, averaged over ranks
    weighted by valid rows (one host copy; ``distributed``: every rank has the same modules, as
    :func:`reduce_stats` checked)."""
    measured = [n for n in names if recorder.stats[n].distance is not None]
    if not measured:
        return {}
    # Tensor parallelism: each rank's heads go to their global slots with per-head rows, as in reduce_stats.
    parts = []
    heads: list[int] = []
    for n in measured:
        s = recorder.stats[n]
        rows = s.rows.reshape(-1)[:1].float()
        local = int(s.entropy.numel())
        tp_rank, tp_size = recorder.head_shards.get(n, (0, 1)) if distributed else (0, 1)
        heads.append(local * tp_size)
        per_head = [s.distance * rows, s.distance_relative * rows, rows.expand(local)]  # type: ignore[operator]
        for v in per_head:
            out = torch.zeros(local * tp_size, dtype=torch.float32, device=rows.device)
            out[tp_rank * local : (tp_rank + 1) * local] = v.reshape(-1).float()
            parts.append(out)
    flat = torch.cat(parts)
    if distributed:
        flat = trainer.strategy.reduce(flat, reduce_op="sum")
    host = flat.tolist()
    values: dict[str, float] = {}
    i = 0
    for n, h in zip(measured, heads, strict=True):
        chunk, i = host[i : i + 3 * h], i + 3 * h
        head_rows = chunk[2 * h :]
        for head in range(h):
            if head_rows[head] <= 0:
                continue
            values[attn_distance_tag(n, head)] = chunk[head] / head_rows[head]
            values[attn_distance_tag(n, head, relative=True)] = chunk[h + head] / head_rows[head]
    return values


def draw_images(writer: DiagWriter, recorder: AttentionRecorder, step: int) -> None:
    """``diag/attn_map/<module>`` of every kept map and the heads' similarity and PCA images."""
    for name, probs in recorder.maps.items():
        maps = probs[..., :IMAGE_KEYS].cpu().numpy()
        if maps.size == 0:
            continue
        cell = max(1, min(8, 128 // max(maps.shape[1], maps.shape[2], 1)))
        # one colour scale per image, 0 to its largest weight: near-uniform maps still show their structure
        top = max(float(maps.max()), 1e-6)
        writer.image(attn_map_tag(name), tile([heatmap(m, cell, 0.0, top) for m in maps], gap=cell), step)
    # Heads are compared within the largest set of modules whose maps have the same shape.
    by_shape: dict[tuple[int, ...], list[str]] = {}
    for name, flat in recorder.flat.items():
        by_shape.setdefault(tuple(flat.shape[1:]), []).append(name)
    if not by_shape:
        return
    names = max(by_shape.values(), key=len)
    stacked = torch.cat([recorder.flat[n] for n in names])
    if stacked.shape[0] < 2:
        return
    groups = [g for g, n in enumerate(names) for _ in range(recorder.flat[n].shape[0])]
    corr = head_similarity(stacked).cpu().numpy()
    cell = max(2, min(16, 256 // corr.shape[0]))
    writer.image(attn_heads_tag("similarity"), heatmap(corr, cell, -1.0, 1.0, diverging=True), step)
    coords = head_pca(stacked).cpu().numpy()
    writer.image(attn_heads_tag("pca"), scatter(coords, groups), step)
