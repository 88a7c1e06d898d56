"""Recognising hand-written attention: a softmax over query-key scores whose output weights a value product.

Users' own code and many libraries write attention out: ``softmax(q @ k^T / sqrt(d))`` through ``torch.softmax``,
``Tensor.softmax``, ``F.softmax`` or an ``nn.Softmax`` module, with scores ``[B, H, T, S]``, ``[B*H, T, S]`` or one
head ``[B, T, S]`` at a time, ``einsum`` instead of ``matmul``, dropout between the softmax and the value product.
:class:`SoftmaxAttention` follows the tensors of one sampled forward (it is driven by the function mode of
:mod:`lightning_diag.instrument.attention_capture`, which sees every torch function call) and recognises attention
by what it is, with two conditions that must both hold:

1. **Scores.** The softmax runs over the last dimension of a tensor of at least 3 dimensions that derives from a
   product of two activations (``matmul``, ``bmm``, ``einsum``, ``@``, ``baddbmm`` with no ``nn.Parameter``
   operand: the query-key product) through element-wise and shape operations only (scaling, masks, biases,
   ``masked_fill``, ``where``, ``tanh`` soft-capping, casts, views, transposes). A router's or a classifier's
   logits come out of an ``nn.Linear`` (or a product with a parameter) and are not scores.
2. **Weights.** The softmax's output, directly or through dropout, casts, ``masked_fill`` or reshapes that keep its
   last dimension, is the left operand of a ``matmul`` / ``bmm`` / ``@`` (or an ``einsum`` operand) that contracts
   that last dimension: the probabilities weight values over the keys. A softmax that is top-k'ed, multiplied
   element-wise or fed to a loss never is.

A recognised softmax is measured from its own output (the probabilities the model used, before dropout) and its
input (keys at ``-inf``, NaN or at most ``-1e4``, the mask values of common code, are masked); nothing is
recomputed and the model's tensors are only read. It is named after the innermost module whose forward was
running when the softmax ran (an ``nn.Softmax`` module counts as its caller). ``[B*H, T, S]`` scores are split into
``H`` heads when that module has a head count (``num_heads``, ``n_heads``, ``n_head``, ``nhead``,
``num_attention_heads`` or ``heads``) and its first input has ``B`` rows (layout ``b * H + h``, as ``view(B * H,
...)`` of ``[B, H, ...]`` gives). Several single-head softmaxes of the same shape in one forward call of a module
(a loop over heads) are that module's heads, in call order.

Only weak references to the model's tensors are kept, so nothing lives longer than the model keeps it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_diag.stats.grad import local_tensor

__all__ = [
    "FOLLOWED",
    "HEAD_ATTRIBUTES",
    "MASKED_SCORE",
    "PRODUCTS",
    "Candidate",
    "SoftmaxAttention",
    "contracts_last",
]

#: Products whose output, when no operand is a parameter, are query-key scores (and which consume probabilities).
PRODUCTS = frozenset({"matmul", "bmm", "einsum", "__matmul__", "baddbmm"})
#: Element-wise and shape operations through which a tensor stays "derived from a query-key product".
SCORE_OPS = frozenset(
    {
        "mul", "__mul__", "__rmul__", "__imul__", "mul_", "div", "__truediv__", "__itruediv__", "div_",
        "add", "__add__", "__radd__", "__iadd__", "add_", "sub", "__sub__", "__isub__", "sub_",
        "masked_fill", "masked_fill_", "where", "tanh", "clamp", "clamp_min", "clamp_max", "nan_to_num",
        "to", "type_as", "float", "half", "bfloat16", "double", "contiguous", "clone",
        "view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "__getitem__", "expand",
    }
)  # fmt: skip
#: Operations between the softmax and the value product that keep the probabilities (and their last dimension).
PROB_OPS = frozenset(
    {
        "dropout", "to", "type_as", "float", "half", "bfloat16", "double", "contiguous", "clone",
        "view", "reshape", "masked_fill", "masked_fill_", "nan_to_num", "__getitem__", "mul", "__mul__",
    }
)  # fmt: skip
#: Every function name :meth:`SoftmaxAttention.follow` needs to see (besides ``softmax``).
FOLLOWED = PRODUCTS | SCORE_OPS | PROB_OPS
#: Attributes read as a module's number of heads, to split ``[B*H, T, S]`` scores.
HEAD_ATTRIBUTES = ("num_heads", "n_heads", "n_head", "nhead", "num_attention_heads", "heads")
#: Scores at or below this (or ``-inf`` / NaN) are masked keys: ``-1e4``, ``-1e9`` and ``finfo.min`` masks.
MASKED_SCORE = -1e4

Measured = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]
Record = Callable[[str, Measured, "tuple[int, int] | None"], None]


class _Tensors:
    """Tensors by identity, held by weak reference (an entry whose tensor died never matches a new one)."""

    def __init__(self) -> None:
        self._refs: dict[int, tuple[weakref.ref[torch.Tensor], Any]] = {}

    def __len__(self) -> int:
        return len(self._refs)

    def add(self, tensor: torch.Tensor, value: Any) -> None:
        self._refs[id(tensor)] = (weakref.ref(tensor), value)

    def get(self, obj: Any) -> Any:
        entry = self._refs.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return None
        return entry[1]

    def clear(self) -> None:
        self._refs.clear()


@dataclass
class Candidate:
    """One softmax over query-key scores, measured at the softmax and waiting for its value product.

    Attributes:
        name: The module's qualified name (the base of the capture's name).
        invocation: The forward call of that module it ran in (``0``: outside any module).
        measured: ``(probs [b, H, q, S], allowed, key_valid, query_valid)`` of the subsample.
        shard: ``(tp_rank, tp_size)`` under tensor parallelism, else ``None``.
        confirmed: Whether a value product consumed it.
    """

    name: str
    invocation: int
    measured: Measured
    shard: tuple[int, int] | None = None
    confirmed: bool = False
    recorded: bool = False
    keys: int = 0


def contracts_last(equation: str, count: int, index: int) -> bool:
    """Whether ``einsum(equation, ...)`` with ``count`` operands sums operand ``index``'s last dimension against
    another operand.

    Example:
        >>> contracts_last("bhts,bhsd->bhtd", 2, 0), contracts_last("bte,bted->btd", 2, 0)
        (True, True)
        >>> contracts_last("bhts,bhsd->bhts", 2, 0), contracts_last("bhts->bht", 1, 0)
        (False, False)
    """
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != count or not 0 <= index < count:
        return False
    term = terms[index]
    if not term or term.endswith("..."):
        return False
    last = term[-1]
    others = "".join(t for i, t in enumerate(terms) if i != index)
    kept = last in rhs if arrow else lhs.count(last) == 1
    return last in others and not kept


def _operands(func: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], str | None]:
    """The tensor operands of a product (and an ``einsum``'s equation)."""
    if func == "einsum":
        if not args or not isinstance(args[0], str):
            return [], None
        rest = list(args[1:])
        if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
            rest = list(rest[0])
        return rest, args[0]
    if func == "baddbmm":
        bound = dict(zip(("input", "batch1", "batch2"), args, strict=False)) | kwargs
        return [bound.get("batch1"), bound.get("batch2")], None
    return [args[0] if args else kwargs.get("input"), args[1] if len(args) > 1 else kwargs.get("other")], None


def _head_count(module: nn.Module | None) -> int:
    for attribute in HEAD_ATTRIBUTES:
        value = getattr(module, attribute, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return value
    return 1


class SoftmaxAttention:
    """Follows one sampled forward's tensors and records the softmaxes that are attention (module docstring).

    Args:
        record: ``record(name, measured, shard)`` records one recognised attention call.
        sample_size: Sequences (``[B, ...]`` rows) measured.
        max_queries: Query rows measured, evenly spaced.
    """

    def __init__(self, record: Record, sample_size: int, max_queries: int) -> None:
        self.record = record
        self.sample_size = sample_size
        self.max_queries = max_queries
        self.scores = _Tensors()  # tensors derived from a query-key product
        self.probs = _Tensors()  # softmax outputs (and what kept them) -> Candidate
        self.open: dict[int, list[Candidate]] = {}  # forward call -> its candidates, while it runs
        self.candidates: list[Candidate] = []
        #: module name -> why a softmax of it was not taken for attention (the first reason per module)
        self.unrecognised: dict[str, str] = {}

    # -- following the forward ------------------------------------------------------------------------------
    def follow(self, func: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """One torch function call of the forward (``func`` in :data:`FOLLOWED`), after it ran."""
        if func in PRODUCTS:
            self._product(func, args, kwargs, out)
            return
        if not isinstance(out, torch.Tensor):
            return
        if func in PROB_OPS and len(self.probs):
            source = args[0] if args else kwargs.get("input")
            candidate = self.probs.get(source)
            if candidate is not None and out.dim() >= 2 and out.shape[-1] == candidate.keys:
                self.probs.add(out, candidate)
        if func in SCORE_OPS and len(self.scores) and out.is_floating_point() and self._any_score(args, kwargs):
            self.scores.add(out, True)

    def _any_score(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        return any(self.scores.get(a) is not None for a in args) or any(
            self.scores.get(v) is not None for v in kwargs.values()
        )

    def _product(self, func: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        operands, equation = _operands(func, args, kwargs)
        if len(self.probs):
            for index, operand in enumerate(operands):
                candidate = self.probs.get(operand)
                if candidate is None:
                    continue
                if equation is not None:
                    ok = contracts_last(equation, len(operands), index)
                else:
                    ok = index == 0 and operand.dim() >= 2
                if ok:
                    self._confirm(candidate)
        tensors = [t for t in operands if isinstance(t, torch.Tensor)]
        if (
            isinstance(out, torch.Tensor)
            and out.is_floating_point()
            and len(tensors) == len(operands) >= 2
            and not any(isinstance(t, nn.Parameter) for t in tensors)
        ):
            self.scores.add(out, True)

    def _confirm(self, candidate: Candidate) -> None:
        if candidate.confirmed:
            return
        candidate.confirmed = True
        if candidate.invocation not in self.open:  # its module's forward is over: nothing left to group with
            self._emit([candidate])

    # -- the softmax ----------------------------------------------------------------------------------------
    def softmax(
        self,
        name: str,
        module: nn.Module | None,
        invocation: int,
        lead: tuple[int, ...],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: torch.Tensor,
        shard: tuple[int, int] | None,
        measure: Callable[[torch.Tensor, torch.Tensor], Measured],
    ) -> None:
        """A softmax call ``out = softmax(scores, dim)`` made by ``module`` (named ``name``) in forward call
        ``invocation``, whose first input had leading dims ``lead``; ``measure(scores4, probs4)`` reads a
        ``[B, H, T, S]`` pair."""
        scores = args[0] if args else kwargs.get("input")
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if not isinstance(scores, torch.Tensor) or not scores.is_floating_point():
            return
        if scores.dim() < 3 or not isinstance(dim, int) or dim not in (-1, scores.dim() - 1):
            self.unrecognised.setdefault(
                name,
                f"a softmax over dim {dim} of a {scores.dim()}-D tensor (attention is over the last "
                "dim of [batch, (heads,) queries, keys] scores)",
            )
            return
        if self.scores.get(scores) is None:
            self.unrecognised.setdefault(name, "a softmax whose input is not a query-key product (q @ k^T)")
            return
        if out.shape != scores.shape:
            return
        s4, p4 = self._as_4d(local_tensor(scores), local_tensor(out), module, lead)
        candidate = Candidate(name, invocation, measure(s4, p4), shard, keys=int(out.shape[-1]))
        self.probs.add(out, candidate)
        self.candidates.append(candidate)
        if invocation in self.open:
            self.open[invocation].append(candidate)
        else:  # outside any module's forward: waits for its product alone
            self.open.setdefault(0, []).append(candidate)

    def _as_4d(
        self, scores: torch.Tensor, probs: torch.Tensor, module: nn.Module | None, lead: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, H, T, S]`` views of the first ``sample_size`` sequences' scores and probabilities."""
        t, s = scores.shape[-2:]
        if scores.dim() == 3:
            rows = scores.shape[0]
            heads = _head_count(module)
            flat = heads > 1 and rows % heads == 0 and rows != heads
            if flat:
                batch = rows // heads
                flat = bool(lead) and (lead[0] == batch or (len(lead) > 1 and lead[1] == batch and lead[0] != rows))
            if not flat:
                heads = 1
            b = min(self.sample_size, rows // heads)
            return scores[: b * heads].reshape(b, heads, t, s), probs[: b * heads].reshape(b, heads, t, s)
        b = min(self.sample_size, scores.shape[0])
        return scores[:b].reshape(b, -1, t, s), probs[:b].reshape(b, -1, t, s)

    # -- forward calls ----------------------------------------------------------------------------------------
    def begin(self, invocation: int) -> None:
        """A module's forward call starts."""
        self.open[invocation] = []

    def end(self, invocation: int) -> None:
        """A module's forward call is over: record its confirmed softmaxes (a loop over heads as one module)."""
        candidates = self.open.pop(invocation, None)
        if candidates:
            confirmed = [c for c in candidates if c.confirmed and not c.recorded]
            if confirmed:
                self._emit(confirmed)

    def finish(self) -> None:
        """The sampled forward is over: record what is confirmed, name what never was, forget every tensor."""
        for invocation in list(self.open):
            self.end(invocation)
        for candidate in self.candidates:
            if not candidate.confirmed:
                self.unrecognised.setdefault(
                    candidate.name,
                    "a softmax of query-key scores whose output never weighted values (no matmul / bmm / einsum / @ "
                    "contracting its last dim)",
                )
        self.candidates.clear()
        self.scores.clear()
        self.probs.clear()
        self.open.clear()

    def _emit(self, candidates: list[Candidate]) -> None:
        first = candidates[0]
        same = all(
            c.name == first.name
            and c.measured[0].shape == first.measured[0].shape
            and c.measured[1].shape == first.measured[1].shape
            and c.measured[0].shape[1] == 1
            for c in candidates
        )
        if len(candidates) > 1 and same:  # one head per call, in call order
            probs = torch.cat([c.measured[0] for c in candidates], dim=1)
            allowed = torch.cat([c.measured[1].expand_as(c.measured[0]) for c in candidates], dim=1)
            key_valid = torch.stack([c.measured[2] for c in candidates]).any(0)
            query_valid = None
            if first.measured[3] is not None:
                query_valid = torch.stack([c.measured[3] for c in candidates if c.measured[3] is not None]).any(0)
            groups: list[tuple[Candidate, Measured]] = [(first, (probs, allowed, key_valid, query_valid))]
        else:
            groups = [(c, c.measured) for c in candidates]
        for candidate in candidates:
            candidate.recorded = True
        for candidate, measured in groups:
            self.record(candidate.name, measured, candidate.shard)
