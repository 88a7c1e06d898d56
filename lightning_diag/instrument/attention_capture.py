"""Seeing attention that no ``nn.MultiheadAttention`` computes: ``scaled_dot_product_attention`` and eager softmax.

On a step an :class:`~lightning_diag.AttentionEntropyMonitor` samples, :class:`AttentionCapture` enters a
:class:`torch.overrides.TorchFunctionMode` around the forward of the ``LightningModule`` and installs a global
forward pre/post hook pair that keeps a stack of the modules being run. The mode sees every call of
``torch.nn.functional.scaled_dot_product_attention`` however it was imported (``F.``, ``torch._C._nn.``, a
local alias: all are the same builtin, and every builtin consults the active mode). Each call runs **unchanged**
(the mode calls the original function with the original arguments and returns its result); afterwards the
probabilities the call implies are recomputed from its ``query``, ``key``, ``attn_mask``, ``is_causal``,
``scale`` and ``enable_gqa`` under ``no_grad``, for a subsample, without random numbers. Attention written out by
hand (Hugging Face ``attn_implementation="eager"``, nanoGPT's non-flash path) is seen at its softmax: a
``softmax`` over the last dimension of a 4-D tensor called directly by a module whose class name contains
``Attention``; the probabilities are the softmax's own output, before dropout, and the keys it masked (``-inf``,
``-1e9`` or ``finfo.min`` scores) are read off its input. Any other softmax is handed to
:class:`~lightning_diag.instrument.attention_softmax.SoftmaxAttention`, which follows the forward's products,
element-wise and shape operations and takes a softmax for attention when its input is query-key scores and its
output weights values (a ``matmul`` / ``bmm`` / ``einsum`` / ``@`` contracting its last dimension): hand-written
attention in any module, never a router's, a classifier's or a loss's softmax.

Each capture is named after the innermost module of the ``LightningModule`` that made the call (its qualified
name, e.g. ``net.model.layers.0.self_attn``); a module's second and later calls in one step get ``.call_<i>``.
Calls made by an ``nn.MultiheadAttention`` are left to the monitor's own hook (no double counting). Nothing is
installed on other steps.

Tensor parallelism (``tp_mesh``): a rank computes only its share of the heads. When the call's ``query`` is a
DTensor sharded on the head dimension, or the calling module holds a parameter sharded over the tensor-parallel
mesh dimension (:func:`~lightning_diag.instrument.sharding.head_shard`), the capture records ``(tp_rank, tp_size)``
in ``recorder.head_shards[name]``: the local heads are global heads ``tp_rank * H_local ...``. DTensor arguments are
measured on their local tensors.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_diag.instrument.attention_record import AttentionRecorder, subsample_rows
from lightning_diag.instrument.attention_softmax import FOLLOWED, MASKED_SCORE, SoftmaxAttention
from lightning_diag.instrument.sharding import head_shard
from lightning_diag.stats.grad import is_dtensor, local_tensor

__all__ = ["AttentionCapture", "is_compiled", "logit_peak", "sdpa_probabilities", "softmax_probabilities"]

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
Probabilities = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


def _masked_threshold(dtype: torch.dtype) -> float:
    """Additive mask values at or below this mean "masked" (``-inf``, or Hugging Face's ``finfo(dtype).min``)."""
    return torch.finfo(dtype).min / 2 if dtype.is_floating_point else -math.inf


def _valid_positions(allowed_full: torch.Tensor, length: int, source_len: int, rows: torch.Tensor) -> Any:
    """``key_valid [b, S]``: keys some query may attend; ``query_valid``: for same-length (self) attention."""
    key_valid = allowed_full.reshape(allowed_full.shape[0], -1, source_len).any(1)
    query_valid = key_valid[:, rows] if length == source_len else None
    return key_valid, query_valid


def logit_peak(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The largest ``|score|`` among the allowed entries (``allowed`` broadcasts to ``scores``), as a 0-d float32
    tensor on the device; 0 where none is allowed, NaN if a score is NaN.

    Example:
        >>> logit_peak(torch.tensor([[3.0, -7.0, -1e9]]), torch.tensor([[True, True, False]])).item()
        7.0
    """
    with torch.no_grad():
        return scores.detach().float().abs().masked_fill(~allowed, 0.0).amax()


def _to_4d(x: torch.Tensor, ndim: int) -> torch.Tensor:
    """``[..., L, E]`` with ``ndim`` dims (right-aligned broadcasting) as ``[B, M, L, E]``."""
    x = x.reshape((1,) * (ndim - x.dim()) + tuple(x.shape))
    if ndim == 2:
        return x[None, None]
    if ndim == 3:
        return x[:, None]
    return x.reshape(x.shape[0], -1, *x.shape[-2:]) if ndim > 4 else x


def sdpa_probabilities(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    sample_size: int = 8,
    max_queries: int = 64,
    peaks: list[torch.Tensor] | None = None,
) -> Probabilities:
    """The attention probabilities a ``scaled_dot_product_attention`` call implies, for a subsample, no gradient.

    Follows the documented reference of ``torch.nn.functional.scaled_dot_product_attention``: scores
    ``q @ k^T * scale`` (``1/sqrt(E)`` by default), a top-left causal mask when ``is_causal``, a boolean
    ``attn_mask`` (``True`` takes part) or an additive float one (broadcast to ``[..., L, S]``), key heads repeated
    for grouped-query attention; no dropout. Scores are computed in float32.

    Args:
        query: ``[N, ..., Hq, L, E]`` (also ``[N, L, E]`` or ``[L, E]``).
        key: ``[N, ..., H, S, E]``.
        attn_mask: As passed to the call.
        is_causal: As passed to the call.
        scale: As passed to the call.
        enable_gqa: As passed to the call.
        sample_size: The first this many batch rows are used.
        max_queries: At most this many query rows, evenly spaced.
        peaks: If given, the largest ``|score|`` among the allowed keys of the subsample (a 0-d float32 tensor on
            the device: the peak attention logit, masks' additive biases included) is appended to it.

    Returns:
        ``(probs [b, H, q, S], allowed [b, H or 1, q, S], key_valid [b, S], query_valid [b, q] or None)``. A key is
        valid when some query of its batch row may attend it; ``query_valid`` (same-length attention only) marks
        query positions whose key is valid, so padded query rows drop out.
    """
    ndim = max(query.dim(), key.dim())
    query, key = query.detach(), key.detach()
    if ndim > 4:  # several head-like dims: broadcast them before they are merged into one
        shape = torch.broadcast_shapes(query.shape[:-2], key.shape[:-2])
        if attn_mask is not None:
            shape = torch.broadcast_shapes(shape, attn_mask.shape[:-2])
            attn_mask = attn_mask.expand(*shape, *attn_mask.shape[-2:])
        query = query.expand(*shape, *query.shape[-2:])
        key = key.expand(*shape, *key.shape[-2:])
    q = _to_4d(query, ndim)
    k = _to_4d(key, ndim)
    batch = max(q.shape[0], k.shape[0])
    b = min(sample_size, batch)
    length, source_len = q.shape[-2], k.shape[-2]
    rows = subsample_rows(length, max_queries, q.device)
    with torch.no_grad():
        qs = q[:b, :, rows].float()
        ks = k[:b].float()
        if enable_gqa and qs.shape[1] != ks.shape[1] and ks.shape[1] > 0:
            ks = ks.repeat_interleave(qs.shape[1] // ks.shape[1], dim=1)
        factor = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        scores = (qs @ ks.transpose(-2, -1)) * factor
        allowed_full = torch.ones(1, 1, 1, source_len, dtype=torch.bool, device=q.device)
        if is_causal:
            allowed_full = torch.ones(length, source_len, dtype=torch.bool, device=q.device).tril()[None, None]
        if attn_mask is not None:
            mask = _to_4d(attn_mask.detach(), max(ndim, attn_mask.dim()))
            mask = mask[:b] if mask.shape[0] > 1 else mask
            if mask.dtype == torch.bool:
                ok = mask
            else:
                ok = mask > _masked_threshold(mask.dtype)
                scores = scores + (mask[:, :, rows] if mask.shape[2] > 1 else mask).float().masked_fill(
                    ~(ok[:, :, rows] if ok.shape[2] > 1 else ok), 0.0
                )
            allowed_full = allowed_full & ok
        allowed_full = allowed_full.expand(-1, -1, length, -1)
        allowed = allowed_full[:, :, rows]
        if peaks is not None:
            peaks.append(logit_peak(scores, allowed))
        scores = scores.masked_fill(~allowed, -math.inf)
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        if allowed_full.shape[0] < b:
            allowed_full = allowed_full.expand(b, -1, -1, -1)
        key_valid, query_valid = _valid_positions(allowed_full, length, source_len, rows)
    return probs, allowed, key_valid, query_valid


def softmax_probabilities(
    scores: torch.Tensor,
    probs: torch.Tensor,
    sample_size: int = 8,
    max_queries: int = 64,
    peaks: list[torch.Tensor] | None = None,
) -> Probabilities:
    """Subsample an attention softmax ``probs = softmax(scores, -1)`` (both ``[B, H, L, S]``); masks from scores.

    A key is masked for a query where its score is ``-inf``, NaN or at most ``-1e4``
    (:data:`~lightning_diag.instrument.attention_softmax.MASKED_SCORE`: the ``-1e4``, ``-1e9`` and
    ``finfo(dtype).min`` additive masks of common code and Hugging Face models). Returns the same tuple as
    :func:`sdpa_probabilities`; ``peaks`` as there.
    """
    with torch.no_grad():
        b = min(sample_size, scores.shape[0])
        length, source_len = scores.shape[-2], scores.shape[-1]
        rows = subsample_rows(length, max_queries, scores.device)
        s = scores.detach()[:b]
        allowed_full = s > MASKED_SCORE
        allowed = allowed_full[:, :, rows]
        p = probs.detach()[:b, :, rows].float()
        key_valid, query_valid = _valid_positions(allowed_full, length, source_len, rows)
        if peaks is not None:
            peaks.append(logit_peak(s[:, :, rows].float(), allowed))
    return p, allowed, key_valid, query_valid


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` or a submodule runs through ``torch.compile`` (the capture then stays off)."""
    if "torch._dynamo" not in sys.modules:  # nothing was ever compiled in this process
        return False
    from torch._dynamo.eval_frame import OptimizedModule

    for m in module.modules():
        if isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None:
            return True
        if hasattr(getattr(m, "forward", None), "_torchdynamo_orig_callable"):
            return True
    return False


def _locals(obj: Any) -> Any:
    """DTensor arguments as their local tensors (a tuple or a dict of arguments, or one value)."""
    if isinstance(obj, tuple):
        return tuple(_locals(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _locals(v) for k, v in obj.items()}
    return local_tensor(obj) if is_dtensor(obj) else obj


class _Mode(TorchFunctionMode):
    def __init__(self, capture: AttentionCapture) -> None:
        super().__init__()
        self.capture = capture

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)  # the call itself, exactly as the model made it
        name = getattr(func, "__name__", "")
        if name == "scaled_dot_product_attention" or name == "softmax":
            self.capture.seen(name, args, kwargs, out)
        elif name in FOLLOWED:
            self.capture.follow(name, args, kwargs, out)
        return out


class AttentionCapture:
    """Installs the function mode and the module stack for one sampled forward (see the module docstring).

    Args:
        root: The ``LightningModule``: calls are named by qualified names inside it.
        recorder: Receives the per-call probabilities.
        include: ``name -> bool``: whether a module's captures are kept (the monitor's ``modules`` patterns).
        names: ``id(module) -> qualified name`` of ``root``'s modules, if already known.
        tp_mesh: The tensor-parallel ``DeviceMesh`` (1-D) when the model uses tensor parallelism, else ``None``.
    """

    def __init__(
        self,
        root: nn.Module,
        recorder: AttentionRecorder,
        include: Any = None,
        names: dict[int, str] | None = None,
        tp_mesh: Any = None,
    ) -> None:
        self.tp_mesh = tp_mesh
        self.names = names if names is not None else {id(m): n for n, m in root.named_modules()}
        self.root_name = type(root).__name__
        self.recorder = recorder
        self.include = include
        #: the modules whose forward is running: (module, forward call number, leading dims of its first input)
        self.stack: list[tuple[nn.Module, int, tuple[int, ...]]] = []
        self.calls: dict[str, int] = {}
        self.softmaxes = SoftmaxAttention(self._record, recorder.sample_size, recorder.max_queries)
        self._invocations = 0
        #: ``id(probs)`` of a measured call -> its peak logit, until the call is recorded
        self._peaks: dict[int, torch.Tensor] = {}
        self._mode: _Mode | None = None
        self._handles: list[Any] = []

    @property
    def active(self) -> bool:
        """Whether the mode and the hooks are installed."""
        return self._mode is not None

    def start(self) -> None:
        """Install the module-stack hooks and enter the function mode."""
        if self._mode is not None:
            return
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._push),
            nn.modules.module.register_module_forward_hook(self._pop, always_call=True),
        ]
        self._mode = _Mode(self)
        self._mode.__enter__()

    def stop(self) -> None:
        """Leave the function mode and remove the hooks (idempotent); record the hand-written attention seen."""
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.stack = []
        try:
            self.softmaxes.finish()
        except Exception as err:  # never break training
            self.recorder.problems.setdefault("softmax attention", f"{type(err).__name__}: {err}")
        for name, reason in self.softmaxes.unrecognised.items():
            self.recorder.unrecognised.setdefault(name, reason)
        self._peaks.clear()

    def _push(self, module: nn.Module, args: Any) -> None:
        self._invocations += 1
        lead: tuple[int, ...] = ()
        for arg in args if isinstance(args, tuple) else ():
            if isinstance(arg, torch.Tensor):
                lead = tuple(arg.shape[:2])
                break
        self.stack.append((module, self._invocations, lead))
        self.softmaxes.begin(self._invocations)

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] is module:
                ended = [entry[1] for entry in reversed(self.stack[i:])]
                del self.stack[i:]
                try:
                    with torch._C.DisableTorchFunction():  # the measurement itself is not the model's
                        for invocation in ended:
                            self.softmaxes.end(invocation)
                except Exception as err:  # never break training
                    self.recorder.problems.setdefault("softmax attention", f"{type(err).__name__}: {err}")
                return

    def _caller(self) -> tuple[nn.Module | None, int, tuple[int, ...]]:
        """The innermost running module of ``root`` (an ``nn.Softmax`` counts as its caller), its call, its lead."""
        for module, invocation, lead in reversed(self.stack):
            if id(module) in self.names and not isinstance(module, nn.Softmax):
                return module, invocation, lead
        return None, 0, ()

    def follow(self, func: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """A product, element-wise or shape operation of the forward (never raises)."""
        try:
            self.softmaxes.follow(func, args, kwargs, out)
        except Exception as err:  # a call we do not understand must never break training
            self.recorder.problems.setdefault("softmax attention", f"{func}: {type(err).__name__}: {err}")

    def seen(self, func: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """One intercepted call (never raises: a failure is reported once through the recorder's problems)."""
        if torch.compiler.is_compiling() or not torch.is_tensor(out):
            return
        module, invocation, lead = self._caller()
        if isinstance(module, nn.MultiheadAttention):
            return  # measured by the monitor's own pre-hook
        base = self.names.get(id(module), "") if module is not None else ""
        base = base or self.root_name
        if self.include is not None and not self.include(base):
            return
        by_name = module is not None and "attention" in type(module).__name__.lower()
        try:
            first = args[0] if args else kwargs.get("query", kwargs.get("input"))
            shard = head_shard(module, first, self.tp_mesh)
            if func == "softmax":
                measured = self._softmax(_locals(args), _locals(kwargs), local_tensor(out)) if by_name else None
                if measured is None:  # not Hugging Face eager: attention only if its output weights values
                    self.softmaxes.softmax(
                        base, module, invocation, lead, args, kwargs, out, shard, self._measure_softmax
                    )
                    return
            else:
                bound = dict(zip(_SDPA_ARGS, _locals(args), strict=False)) | _locals(kwargs)
                peaks: list[torch.Tensor] = []
                measured = sdpa_probabilities(
                    bound["query"],
                    bound["key"],
                    bound.get("attn_mask"),
                    bool(bound.get("is_causal", False)),
                    bound.get("scale"),
                    bool(bound.get("enable_gqa", False)),
                    self.recorder.sample_size,
                    self.recorder.max_queries,
                    peaks,
                )
                self._peaks[id(measured[0])] = peaks[0]
        except Exception as err:  # a call we do not understand must never break training
            self.recorder.problems[base] = f"{func}: {type(err).__name__}: {err}"
            return
        if measured is not None:
            self._record(base, measured, shard)

    def _measure_softmax(self, scores: torch.Tensor, probs: torch.Tensor) -> Probabilities:
        peaks: list[torch.Tensor] = []
        measured = softmax_probabilities(scores, probs, self.recorder.sample_size, self.recorder.max_queries, peaks)
        self._peaks[id(measured[0])] = peaks[0]
        return measured

    def _record(self, base: str, measured: Probabilities, shard: tuple[int, int] | None) -> None:
        """Record one attention call of the module named ``base`` (``.call_<i>`` from its second call on)."""
        index = self.calls.get(base, 0)
        self.calls[base] = index + 1
        name = base if index == 0 else f"{base}.call_{index}"
        if shard is not None:
            self.recorder.head_shards[name] = shard
        self.recorder.captured.add(name)
        # the peak logit of a call measured whole (per-head calls grouped into one record have none)
        self.recorder.add(name, *measured, logit_peak=self._peaks.pop(id(measured[0]), None))

    def _softmax(self, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor) -> Probabilities | None:
        """Hugging Face eager attention: a 4-D last-dim softmax called by a module named ``...Attention``."""
        scores = args[0] if args else kwargs.get("input")
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if not isinstance(scores, torch.Tensor) or scores.dim() != 4 or dim not in (-1, 3):
            return None
        if not scores.dtype.is_floating_point or out.shape != scores.shape:
            return None
        return self._measure_softmax(scores, out)
