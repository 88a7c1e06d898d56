"""Getting attention probabilities out of a model, only on the steps a monitor samples.

Four ways in, all no-ops unless an :class:`~lightning_diag.AttentionEntropyMonitor` is sampling the current step
(the fourth, ``torch.nn.functional.scaled_dot_product_attention`` calls, eager and hand-written attention
softmax, is seen automatically by :mod:`lightning_diag.instrument.attention_capture`):

* ``torch.nn.MultiheadAttention`` (also inside ``nn.TransformerEncoderLayer`` / ``DecoderLayer``) is found
  automatically. The monitor does **not** change the module's call (``need_weights`` stays as the model set it):
  a forward pre-hook reads the call's inputs and recomputes the softmax of the query-key scores from the module's
  own projection weights, without gradient, on a subsample of the batch. The forward, the loss, the gradients
  and the random number stream of the step are exactly those of a run without the monitor, and the
  probabilities are the ones **before** dropout.
* Custom attention modules hand their probabilities over with :func:`record_attention`, guarded by
  :func:`attention_requested` so that nothing is computed on other steps.
* Hugging Face style models that return ``output_attentions`` use :func:`record_hf_attentions`.

Example (a custom attention module)::

    from lightning_diag import attention_requested, record_attention

    def forward(self, x, key_padding_mask=None):
        probs = torch.softmax(self.scores(x), dim=-1)          # [B, H, L, S]
        if attention_requested():
            record_attention(probs, self, key_padding_mask=key_padding_mask)
        return self.dropout(probs) @ self.values(x)
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from lightning_diag.instrument.attention_softmax import MASKED_SCORE
from lightning_diag.stats.attention_probs import HeadStats, head_stats, special_key_mask

__all__ = [
    "AttentionRecorder",
    "attention_requested",
    "mha_probabilities",
    "record_attention",
    "record_hf_attentions",
    "subsample_rows",
]

_ACTIVE: AttentionRecorder | None = None
_MHA_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


def attention_requested() -> bool:
    """Whether a monitor is sampling the current step: only then is :func:`record_attention` worth calling.

    Example:
        >>> attention_requested()
        False
    """
    return _ACTIVE is not None


def record_attention(
    probs: torch.Tensor,
    source: str | nn.Module,
    *,
    key_padding_mask: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    causal: bool = False,
) -> None:
    """Hand one attention module's probabilities to the active monitor; a no-op when none is sampling.

    Args:
        probs: Attention probabilities ``[B, H, L, S]`` (or ``[H, L, S]``), rows summing to one over the keys;
            ideally before dropout.
        source: The module's name as it should appear in tags, or the module itself (its qualified name in the
            ``LightningModule`` is used).
        key_padding_mask: ``[B, S]``, ``True`` at padded keys (PyTorch's convention).
        attention_mask: ``[B, S]``, ``1`` at real tokens and ``0`` at padding (Hugging Face's convention);
            an alternative to ``key_padding_mask``.
        causal: Whether query ``i`` may only see keys ``<= i`` (the entropy of uniform attention, the reference
            of ``attn_entropy_high``, is then computed over the visible keys only).
    """
    recorder = _ACTIVE
    if recorder is None:
        return
    recorder.add_probabilities(probs, source, key_padding_mask, attention_mask, causal)


def record_hf_attentions(
    attentions: Sequence[torch.Tensor] | None,
    prefix: str = "model",
    *,
    attention_mask: torch.Tensor | None = None,
    causal: bool = False,
) -> None:
    """Hand the ``attentions`` of a Hugging Face model output (``output_attentions=True``) to the monitor.

    Rarely needed now: the monitor sees Hugging Face attention by itself (``sdpa`` and ``eager``, see
    :mod:`lightning_diag.instrument.attention_capture`); when it has, this call records nothing (a notice says so
    once), so the same layers are never counted twice. Layer ``i`` is reported as ``<prefix>.layer_<i>``. Call the
    model with ``output_attentions=attention_requested()`` so the probabilities are only materialised on sampled
    steps, and build it with ``attn_implementation="eager"`` so that sampled steps compute exactly what the others
    do (other implementations fall back to eager when asked for attentions). Hugging Face returns the probabilities
    after dropout; rows are renormalised, but a model trained with attention dropout is measured with its noise.

    Example::

        out = self.bert(input_ids, attention_mask=mask, output_attentions=attention_requested())
        record_hf_attentions(out.attentions, "bert", attention_mask=mask)

    Args:
        attentions: One ``[B, H, L, S]`` tensor per layer, or ``None`` (nothing is recorded).
        prefix: Name of the model in tags.
        attention_mask: ``[B, S]``, ``1`` at real tokens and ``0`` at padding.
        causal: Whether the model is a causal (decoder-only) language model.
    """
    recorder = _ACTIVE
    if recorder is None:
        return
    if recorder.captured:
        recorder.notes["hf"] = (
            f"record_hf_attentions(..., {prefix!r}) was ignored: the model's attention is already captured "
            "automatically under its modules' names; the call (and output_attentions) can go"
        )
        return
    if not attentions:
        recorder.problems[prefix] = (
            "the model returned no attentions: call it with `output_attentions=attention_requested()` and build it "
            'with `attn_implementation="eager"` (other implementations may return none)'
        )
        return
    for i, probs in enumerate(attentions):
        if isinstance(probs, torch.Tensor):
            record_attention(probs, f"{prefix}.layer_{i}", attention_mask=attention_mask, causal=causal)


def subsample_rows(length: int, max_queries: int, device: torch.device) -> torch.Tensor:
    if length <= max_queries:
        return torch.arange(length, device=device)
    return torch.linspace(0, length - 1, max_queries, device=device).round().long().unique()


def mha_probabilities(
    module: nn.MultiheadAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    sample_size: int = 8,
    max_queries: int = 64,
    peaks: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Recompute, without gradient, the attention probabilities an ``nn.MultiheadAttention`` call produces.

    Follows ``torch.nn.functional.multi_head_attention_forward``: the module's query/key projections, scaling by
    ``1/sqrt(head_dim)``, ``bias_k`` and ``add_zero_attn`` keys, boolean and additive ``attn_mask`` /
    ``key_padding_mask``, softmax; no dropout.

    Args:
        module: The attention module.
        query: The call's query (batch-first or not as the module says; unbatched ``[L, E]`` works too).
        key: The call's key.
        key_padding_mask: As passed to the module.
        attn_mask: As passed to the module (``[L, S]`` or ``[B * H, L, S]``).
        is_causal: The call's causal hint; used only when ``attn_mask`` is ``None``.
        sample_size: The first this many sequences of the batch are used.
        max_queries: At most this many query rows per sequence, evenly spaced.
        peaks: If given, the largest ``|score|`` among the allowed keys of the subsample (the peak attention
            logit, a 0-d float32 device tensor) is appended to it.

    Returns:
        ``(probs [b, H, q, S'], allowed [b, H or 1, q, S'], key_valid [b, S], query_valid [b, q] or None)``:
        ``S'`` counts the extra ``bias_k`` / zero keys, ``key_valid`` marks the real (non-padding) keys of the
        input, and ``query_valid`` is given for self-attention (query and key are the same tensor).
    """
    self_attention = query is key
    if query.dim() == 2:
        query, key = query.unsqueeze(0), key.unsqueeze(0)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    elif not module.batch_first:
        query, key = query.transpose(0, 1), key.transpose(0, 1)
    batch, length, embed = query.shape
    source_len = key.shape[1]
    heads = module.num_heads
    head_dim = embed // heads
    b = min(sample_size, batch)
    rows = subsample_rows(length, max_queries, query.device)
    with torch.no_grad():
        if module.in_proj_weight is not None:
            w_q, w_k = module.in_proj_weight[:embed], module.in_proj_weight[embed : 2 * embed]
        else:
            w_q, w_k = module.q_proj_weight, module.k_proj_weight
        bias = module.in_proj_bias
        b_q = None if bias is None else bias[:embed].float()
        b_k = None if bias is None else bias[embed : 2 * embed].float()
        q = F.linear(query[:b, rows].float(), w_q.float(), b_q)
        k = F.linear(key[:b].float(), w_k.float(), b_k)
        extra = 0
        if module.bias_k is not None:
            k = torch.cat([k, module.bias_k.float().reshape(1, 1, embed).expand(b, 1, embed)], dim=1)
            extra += 1
        if module.add_zero_attn:
            k = torch.cat([k, k.new_zeros(b, 1, embed)], dim=1)
            extra += 1
        q = q.reshape(b, -1, heads, head_dim).transpose(1, 2)
        k = k.reshape(b, -1, heads, head_dim).transpose(1, 2)
        scores = (q * head_dim**-0.5) @ k.transpose(-2, -1)

        key_valid = torch.ones(b, source_len, dtype=torch.bool, device=query.device)
        allowed = torch.ones(1, 1, 1, source_len + extra, dtype=torch.bool, device=query.device)
        if key_padding_mask is not None:
            kpm = key_padding_mask[:b]
            if kpm.dtype == torch.bool:
                key_valid = ~kpm
            else:
                key_valid = kpm.float() > MASKED_SCORE  # -inf, finfo.min and -1e9 masks alike
                scores = scores + F.pad(kpm.float().masked_fill(~key_valid, 0.0), (0, extra))[:, None, None, :]
            allowed = F.pad(key_valid, (0, extra), value=True)[:, None, None, :]
        if attn_mask is None and is_causal and length == source_len:
            attn_mask = torch.ones(length, source_len, dtype=torch.bool, device=query.device).triu(1)
        if attn_mask is not None:
            mask = attn_mask
            mask = mask[rows] if mask.dim() == 2 else mask.reshape(batch, heads, length, source_len)[:b, :, rows]
            if mask.dtype == torch.bool:
                ok = ~mask
            else:
                ok = mask.float() > MASKED_SCORE
                scores = scores + F.pad(mask.float().masked_fill(~ok, 0.0), (0, extra))
            ok = F.pad(ok, (0, extra), value=True)
            allowed = allowed & (ok if ok.dim() == 4 else ok[None, None])
        if peaks is not None:
            peaks.append(scores.abs().masked_fill(~allowed, 0.0).amax())
        scores = scores.masked_fill(~allowed, -math.inf)
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        query_valid = key_valid[:, rows] if self_attention and length == source_len else None
    return probs, allowed, key_valid, query_valid


class AttentionRecorder:
    """Collects the per-head statistics of one sampled step (created and activated by the monitor).

    Args:
        sample_size: Sequences of the batch measured.
        max_queries: Query rows per sequence measured.
        special_positions: Positions among the valid keys that are special (``0`` first, ``-1`` last).
        special_token_ids: Token ids that are special (needs ``token_ids``).
        token_ids: ``[B, S]`` token ids of the batch, or ``None``.
        keep_maps: Also keep the first sequence's maps and flattened per-head maps (for images).
        module_names: Qualified names of modules, by ``id``, for :func:`record_attention` with a module.
        timed: Wraps a method in a timer (``SystemMonitor``'s, for this recorder's trainer), or ``None``: the
            recorder's ``add``, ``add_probabilities`` and the hooks ``mha_pre_hook`` makes are then this instance's
            timed wrappers (the class is never changed).
    """

    def __init__(
        self,
        sample_size: int,
        max_queries: int,
        special_positions: tuple[int, ...],
        special_token_ids: tuple[int, ...] = (),
        token_ids: torch.Tensor | None = None,
        keep_maps: bool = False,
        module_names: dict[int, str] | None = None,
        timed: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
    ) -> None:
        if timed is not None:
            self.add = timed(self.add)  # type: ignore[method-assign]
            self.add_probabilities = timed(self.add_probabilities)  # type: ignore[method-assign]
            make_hook = self.mha_pre_hook
            self.mha_pre_hook = lambda name: timed(make_hook(name))  # type: ignore[method-assign]
        self.sample_size = sample_size
        self.max_queries = max_queries
        self.special_positions = special_positions
        self.special_token_ids = special_token_ids
        self.token_ids = token_ids
        self.keep_maps = keep_maps
        self.module_names = module_names or {}
        self.stats: dict[str, HeadStats] = {}
        self.maps: dict[str, torch.Tensor] = {}
        self.flat: dict[str, torch.Tensor] = {}
        self.problems: dict[str, str] = {}
        self.notes: dict[str, str] = {}
        self.captured: set[str] = set()  # names measured by the automatic capture this step
        #: module name -> why a softmax it ran was not taken for attention (for the "no attention" message)
        self.unrecognised: dict[str, str] = {}
        #: name -> (tp_rank, tp_size) for modules whose heads are split over tensor-parallel ranks.
        self.head_shards: dict[str, tuple[int, int]] = {}
        #: name -> the largest attention logit ``|q.k| * scale`` of its sampled queries (a 0-d device tensor), for
        #: the modules whose logits were seen (not for probabilities handed over by :func:`record_attention`).
        self.logit_peaks: dict[str, torch.Tensor] = {}

    def activate(self) -> None:
        """Make this the recorder :func:`record_attention` feeds."""
        global _ACTIVE
        _ACTIVE = self

    def deactivate(self) -> None:
        """Stop feeding this recorder (a no-op if another one is active)."""
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None

    def _name(self, source: str | nn.Module) -> str:
        if isinstance(source, str):
            return source
        return self.module_names.get(id(source), type(source).__name__)

    def add_probabilities(
        self,
        probs: torch.Tensor,
        source: str | nn.Module,
        key_padding_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        causal: bool = False,
    ) -> None:
        """Record probabilities handed over explicitly (see :func:`record_attention`)."""
        name = self._name(source)
        if name in self.stats:
            return
        if not isinstance(probs, torch.Tensor) or probs.dim() not in (3, 4):
            shape = tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__
            self.problems[name] = f"expected probabilities [batch, heads, queries, keys], got {shape}"
            return
        p = probs.detach()
        if p.dim() == 3:
            p = p.unsqueeze(0)
        b = min(self.sample_size, p.shape[0])
        length, source_len = p.shape[2], p.shape[3]
        rows = subsample_rows(length, self.max_queries, p.device)
        p = p[:b, :, rows]
        key_valid = torch.ones(b, source_len, dtype=torch.bool, device=p.device)
        if key_padding_mask is not None:
            key_valid = ~key_padding_mask[:b].bool()
        elif attention_mask is not None:
            key_valid = attention_mask[:b].reshape(b, -1)[:, -source_len:] > 0
        allowed = key_valid[:, None, None, :]
        if causal:
            offset = source_len - length  # keys cached before the first query
            visible = torch.arange(source_len, device=p.device)[None, :] <= (rows[:, None] + offset)
            allowed = allowed & visible[None, None]
        query_valid = key_valid[:, rows] if length == source_len else None
        self.add(name, p, allowed, key_valid, query_valid)

    def add(
        self,
        name: str,
        probs: torch.Tensor,
        allowed: torch.Tensor,
        key_valid: torch.Tensor,
        query_valid: torch.Tensor | None,
        logit_peak: torch.Tensor | None = None,
    ) -> None:
        """Reduce one module's sampled probabilities to per-head statistics (the first call per step wins);
        ``logit_peak``: the largest attention logit of the sample, where the logits were seen."""
        if name in self.stats:
            return
        if logit_peak is not None:
            self.logit_peaks[name] = logit_peak
        source_len = key_valid.shape[1]
        token_ids = self.token_ids
        if token_ids is not None and tuple(token_ids.shape[-1:]) == (source_len,):
            token_ids = token_ids[: key_valid.shape[0]].to(key_valid.device)
        else:
            token_ids = None
        special = special_key_mask(key_valid, self.special_positions, token_ids, self.special_token_ids)
        special = F.pad(special, (0, probs.shape[-1] - source_len), value=False)
        positions = None
        if query_valid is not None:  # self-attention: query row i sits at key position rows[i]
            rows = subsample_rows(source_len, self.max_queries, probs.device)
            positions = rows if rows.numel() == probs.shape[2] else None
        self.stats[name] = head_stats(probs, allowed, query_valid, special, positions)
        if self.keep_maps:
            first = probs[0].float()
            if query_valid is not None:
                first = first[:, query_valid[0]]
            self.maps[name] = first[..., :source_len][..., key_valid[0]]
            self.flat[name] = probs.float().mean(0).reshape(probs.shape[1], -1)

    def mha_pre_hook(self, name: str) -> Any:
        """A forward pre-hook (``with_kwargs=True``) that measures an ``nn.MultiheadAttention`` call."""

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if name in self.stats or name in self.problems:
                return
            peaks: list[torch.Tensor] = []
            try:
                bound = _MHA_SIGNATURE.bind(module, *args, **kwargs).arguments
                probs, allowed, key_valid, query_valid = mha_probabilities(
                    module,  # type: ignore[arg-type]
                    bound["query"],
                    bound["key"],
                    bound.get("key_padding_mask"),
                    bound.get("attn_mask"),
                    bool(bound.get("is_causal", False)),
                    self.sample_size,
                    self.max_queries,
                    peaks,
                )
            except Exception as err:  # a call shape we do not understand must never break training
                self.problems[name] = f"{type(err).__name__}: {err}"
                return
            self.add(name, probs, allowed, key_valid, query_valid, peaks[0] if peaks else None)

        return hook
