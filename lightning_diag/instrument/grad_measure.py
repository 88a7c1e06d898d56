"""What :class:`~lightning_diag.callbacks.gradient_flow.monitor.GradientFlowMonitor` measures and how: the parameter
index (which parameters are measured, the layer each belongs to, which layers are comparable weight matrices,
their blocks and roles), the device computation of a measured step that ends in its one host copy, and the
update-to-weight ratios after the optimizer step.

Sharded training (FSDP2, tensor parallelism, both, HSDP: parameters and gradients are ``DTensor`` objects): every
quantity is that of the full, unsharded tensor, computed from the local shards. Each rank sums the squares of its
own shards per layer on the device, weighted so that replicated copies count once
(:func:`~lightning_diag.stats.grad.copy_weights`), and ONE all-reduce (a SUM over all ranks) per measured step
gives the full sums of squares, the same on every rank; the loss rides in the same all-reduce. Element counts are
the global ones. Nothing is gathered.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence

import torch

from lightning_diag.core.tags import update_ratio_tag, weight_norm_tag
from lightning_diag.stats.grad import copy_weights, grouped_squares, is_dtensor, local_tensor, per_tensor_norms
from lightning_diag.stats.layer_roles import role_of

__all__ = [
    "DEFAULT_LOGIT_PROJECTIONS",
    "GradientSquares",
    "ParamIndex",
    "StepMeasurement",
    "WeightCopies",
    "measure_step",
    "read_with",
    "update_norms",
    "update_ratio_values",
]

#: Wrapper components that torch.compile (``_orig_mod``), FSDP1 (``_fsdp_wrapped_module``) and activation
#: checkpointing (``_checkpoint_wrapped_module``) add to parameter names: the model's own names are reported.
_WRAPPER_PREFIX = re.compile(r"(?:^|(?<=\.))(?:_orig_mod|_fsdp_wrapped_module|_checkpoint_wrapped_module)\.")

#: Attention query/key projections (last name component): their gradient flows only through the softmax, so it
#: is tiny whenever attention is near uniform (at initialisation, or for a head the task does not need).
DEFAULT_LOGIT_PROJECTIONS = ("q", "k", "query", "key", "q_proj", "k_proj", "q_lin", "k_lin", "wq", "wk", "to_q", "to_k")


#: Name components of embedding tables and learned position/class tokens, which are not weight matrices.
_EMBEDDING = re.compile(r".*embed.*|pos|pos_emb|wte|wpe|cls_token|mask_token|dist_token")


#: A host total of gradient norms below this proves their squares' float32 sum finite in any order
#: (:meth:`GradientSquares.proves_finite`).
_PROVEN_TOTAL = 1e19


class ParamIndex:
    """Which parameters are measured, the layer each belongs to, and which layers are comparable weight
    matrices (built once per fit).

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        >>> named = list(net.named_parameters())
        >>> index = ParamIndex([n for n, _ in named], [p for _, p in named], False, dict(net.named_modules()))
        >>> index.layers, index.is_matrix
        (['0', '1', '2'], [False, True, False, True, False])
    """

    def __init__(
        self,
        names: list[str],
        params: list[torch.nn.Parameter],
        per_parameter: bool,
        modules: dict[str, torch.nn.Module] | None = None,
        logit_projections: Sequence[str] = DEFAULT_LOGIT_PROJECTIONS,
        world_size: int = 1,
    ) -> None:
        modules = modules or {}
        owners = [n.rsplit(".", 1)[0] if "." in n else "" for n in names]
        names = [_WRAPPER_PREFIX.sub("", n) for n in names]
        layers = [n if per_parameter else (n.rsplit(".", 1)[0] if "." in n else n) for n in names]
        self.layers = list(dict.fromkeys(layers))
        position = {layer: i for i, layer in enumerate(self.layers)}
        self.names = names
        self.params = params
        self.layer_of = [position[layer] for layer in layers]
        self.numel = [p.numel() for p in params]  # a DTensor's numel is the global one
        #: Whether any parameter is a DTensor (sharded training): measured from local shards, one all-reduce.
        self.sharded = world_size > 1 and any(is_dtensor(p) for p in params)
        #: Each parameter's weight in the cross-rank SUM of squares (replicated copies count once).
        self.weights = copy_weights(params, world_size) if self.sharded else [1.0] * len(params)
        self.world_size = world_size
        # A comparable weight matrix: a >= 2-D parameter of a module that is neither an embedding (sparse rows)
        # nor an attention query/key projection.
        skip = set(logit_projections)
        self.is_matrix = [
            p.ndim >= 2
            and not isinstance(modules.get(owner), torch.nn.Embedding)
            and not any(_EMBEDDING.fullmatch(part) for part in name.split("."))
            and owner.rsplit(".", 1)[-1] not in skip
            for p, owner, name in zip(params, owners, names, strict=True)
        ]
        matrix_layers = {self.layers[self.layer_of[i]] for i, m in enumerate(self.is_matrix) if m}
        in_blocks = {layer for layer in matrix_layers if role_of(layer) != layer}
        self.block_layers = in_blocks or matrix_layers  # no repeated blocks (an LSTM and its head): all matrices
        self.roles = {layer: role_of(layer) for layer in matrix_layers}
        self.in_block = [layer in self.block_layers for layer in self.layers]
        self._layouts: dict[tuple[torch.device, tuple[int, ...]], _Layout] = {}
        self._rows: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}

    def layout(self, chosen: list[int], device: torch.device) -> _Layout:
        """The index tensors of a measurement of ``chosen`` on ``device`` (made at its first measurement, then
        reused: the same parameters are measured at every measured step)."""
        key = (device, tuple(chosen))
        found = self._layouts.get(key)
        if found is None:
            found = self._layouts[key] = _Layout(self, chosen, device)
        return found

    def rows_index(self, rows: list[int], device: torch.device) -> torch.Tensor:
        """``rows`` as an index tensor on ``device`` (made at its first measurement, then reused: the rows of the
        measured gradients in the shared squares are the same at every measured step, so no host-to-device copy
        is made after the first).

        Example:
            >>> index = ParamIndex(["w"], [torch.nn.Parameter(torch.ones(1))], False)
            >>> index.rows_index([1, 0], torch.device("cpu")) is index.rows_index([1, 0], torch.device("cpu"))
            True
        """
        key = (device, tuple(rows))
        found = self._rows.get(key)
        if found is None:
            found = self._rows[key] = torch.tensor(rows, dtype=torch.long, device=device)
        return found


class _Layout:
    """What :func:`measure_step` indexes with for one list of measured parameters, on their device: which layer
    each belongs to, the layers' element counts, the comparable weight matrices and the blocks' layers."""

    def __init__(self, index: ParamIndex, chosen: list[int], device: torch.device) -> None:
        n_layers = len(index.layers)
        layer_of = [index.layer_of[i] for i in chosen]
        self.group_of = torch.tensor(layer_of, device=device)
        numel = torch.zeros(n_layers, dtype=torch.float32, device=device)
        numel.index_add_(0, self.group_of, torch.tensor([float(index.numel[i]) for i in chosen], device=device))
        #: sqrt of each layer's element count (at least 1): the RMS divisor
        self.numel_root = numel.clamp_min(1.0).sqrt()
        #: positions in ``chosen`` of the comparable weight matrices, and their layers
        self.matrix = [k for k, i in enumerate(chosen) if index.is_matrix[i]]
        self.matrix_layers = sorted({index.layer_of[chosen[k]] for k in self.matrix})
        self.matrix_index = torch.tensor(self.matrix, dtype=torch.long, device=device)
        self.matrix_groups = torch.tensor([index.layer_of[chosen[k]] for k in self.matrix], device=device)
        self.matrix_layer_index = torch.tensor(self.matrix_layers, dtype=torch.long, device=device)
        #: the blocks' layers, as positions (a boolean mask would index through a nonzero: one more operator, and
        #: a host synchronisation on an accelerator)
        self.in_block = torch.tensor([g for g, b in enumerate(index.in_block) if b], dtype=torch.long, device=device)
        #: the layers with a measured parameter
        self.present = sorted(set(layer_of))


@dataclasses.dataclass(eq=False)
class GradientSquares:
    """The squared L2 norm of each gradient a measured step read (and of its parameter), kept on the device for the
    step's readers (the non-finite guard's pass: 0 times their sum is 0 only when every gradient is finite; the
    gradient-flow measurement: its layers' sums).

    Attributes:
        versions: ``{id(gradient): its version counter when measured}``, in the order of :attr:`squares`.
        squares: The squared norms, float32, on the gradients' device (an overflow reads as a non-finite value).
        total: The L2 norm of all of them on the host (the square root of a float32 sum of ``squares``, in another
            order), set by the reader that reads it back with its step's other values; NaN until then.
        weights: The squared norms of the gradients' parameters, row by row with :attr:`squares` (``None``: not
            measured).

    Example:
        >>> g = [torch.tensor([3.0, 4.0]), torch.tensor([1.0])]
        >>> shared = GradientSquares.of(g, torch.tensor([25.0, 1.0]))
        >>> shared.covers(g[::-1]), shared.covers(g[:1])
        (True, False)
        >>> _ = g[0].mul_(2)  # changed since it was measured
        >>> shared.covers(g)
        False
    """

    versions: dict[int, int]
    squares: torch.Tensor
    total: float = math.nan
    weights: torch.Tensor | None = None

    @classmethod
    def of(
        cls, grads: Sequence[torch.Tensor], squares: torch.Tensor, weights: torch.Tensor | None = None
    ) -> GradientSquares:
        """The squares ``squares`` of ``grads`` (and ``weights`` of their parameters), with the gradients'
        identities and versions now."""
        return cls({id(g): g._version for g in grads}, squares, weights=weights)

    @classmethod
    def measure(cls, params: Sequence[torch.Tensor], weights: bool) -> GradientSquares | None:
        """The squared norms of the gradients of ``params`` (those that have one, in order) and, with ``weights``, of
        those parameters, in one fused pass (:func:`~lightning_diag.stats.grad.per_tensor_norms`, each norm the same
        as on its own). ``None`` when no parameter has a gradient or one is a ``DTensor`` (sharded training: a local
        shard's norm is not the tensor's; each reader measures its own).

        Example:
            >>> w = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
            >>> w.grad = torch.tensor([1.0, 0.0])
            >>> found = GradientSquares.measure([w], weights=True)
            >>> found.squares.tolist(), found.weights.tolist()
            ([1.0], [25.0])
        """
        with_grad = [p for p in params if p.grad is not None]
        if not with_grad or any(is_dtensor(p) for p in with_grad):
            return None
        grads: list[torch.Tensor] = [p.grad for p in with_grad]  # type: ignore[misc]
        if not weights:
            return cls.of(grads, per_tensor_norms(grads).pow(2))
        both = per_tensor_norms([*grads, *with_grad]).pow(2)
        return cls.of(grads, both[: len(grads)], both[len(grads) :])

    def rows_of(self, grads: Sequence[torch.Tensor]) -> list[int] | None:
        """The rows of :attr:`squares` that hold ``grads``' squares, in their order, when every one of them was
        measured here and is unchanged since; else ``None``.

        Example:
            >>> g = [torch.ones(2), torch.ones(3), torch.ones(1)]
            >>> known = GradientSquares.of(g, torch.tensor([2.0, 3.0, 1.0]))
            >>> known.rows_of([g[2], g[0]]), known.rows_of([torch.ones(1)])
            ([2, 0], None)
        """
        versions = self.versions
        if any(versions.get(id(g)) != g._version for g in grads):
            return None
        positions = {key: row for row, key in enumerate(versions)}
        return [positions[id(g)] for g in grads]

    def proves_finite(self) -> bool:
        """Whether :attr:`total` proves every square finite, and their float32 sum finite in whatever order it is
        added: a finite total below 1e19 (its square below 1e38, the float32 maximum being 3.4e38; a NaN or an
        infinity in any gradient makes its norm, and so the total, non-finite).

        Example:
            >>> GradientSquares({}, torch.tensor([25.0]), 5.0).proves_finite()
            True
            >>> GradientSquares({}, torch.tensor([float("inf")]), float("inf")).proves_finite()
            False
        """
        return self.total < _PROVEN_TOTAL  # NaN compares False

    def covers(self, grads: Sequence[torch.Tensor]) -> bool:
        """Whether these are the squares of exactly ``grads`` (the same tensors, in any order, unchanged since)."""
        return len(grads) == len(self.versions) and self.rows_of(grads) is not None


@dataclasses.dataclass
class StepMeasurement:
    """The host values of one measured step.

    Attributes:
        total: L2 norm of all measured gradients.
        norms: ``{layer: L2 norm of its gradients}`` of the layers with a gradient.
        rms: ``{layer: RMS gradient per element}``.
        relative: ``{layer: ||g_W|| / ||W||}`` of the comparable weight matrices.
        blocks: L2 norm of the blocks' weight-matrix gradients (``total`` when there is no matrix).
        has_matrices: Whether any comparable weight matrix has a gradient.
        loss: The step's training loss, ``None`` when unknown or not finite.
        weight_squares: The squared norms of the measured parameters before the optimizer step, on the device, in
            the order of ``chosen`` (``None`` under sharded training): :func:`update_norms` reuses them.
        extra: The host values of :func:`measure_step`'s ``extra`` tensor, read in the same copy.
    """

    total: float
    norms: dict[str, float]
    rms: dict[str, float]
    relative: dict[str, float]
    blocks: float
    has_matrices: bool
    loss: float | None
    weight_squares: torch.Tensor | None = None
    extra: list[float] = dataclasses.field(default_factory=list)


def measure_step(
    index: ParamIndex,
    chosen: list[int],
    loss: torch.Tensor | None,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    extra: torch.Tensor | None = None,
    known: GradientSquares | None = None,
) -> StepMeasurement:
    """Per-layer norms, RMS and relative gradients of the ``chosen`` parameters (positions in ``index``, each
    with a gradient), computed on their device and copied to the host once.

    Args:
        index: The parameter index.
        chosen: Positions of the parameters measured this step (each has a ``.grad``).
        loss: The step's loss (a device scalar), or ``None``.
        reduce: A SUM over all ranks (``None`` in a single process): the one collective of the step. Under DDP
            it carries the loss alone (whose mean over the ranks makes the collapse verdict the same everywhere);
            under sharded training the weighted per-layer sums of squares of the local shards too.
        extra: A 1-D float32 tensor of the caller's to read in the step's one host copy (not reduced across ranks):
            the activation watch's statistics of the same step. Its values are :attr:`StepMeasurement.extra`.
        known: The squared norms of the step's gradients and weights measured already (the driver's, read by every
            callback of the step): used when they hold every chosen gradient, unchanged, on the gradients' device
            (the same values as measured here: each norm is its own tensor's), else measured here. Its
            :attr:`~GradientSquares.total` is set from this step's host copy when the chosen gradients are all of it.
    """
    grads = [index.params[i].grad for i in chosen]
    device = local_tensor(grads[0]).device  # type: ignore[arg-type]
    n_layers = len(index.layers)
    layout = index.layout(chosen, device)
    group_of = layout.group_of
    usable = known is not None and not index.sharded and known.squares.device == device
    rows = known.rows_of(grads) if usable else None  # type: ignore[union-attr, arg-type]
    if known is not None and rows is not None and known.weights is not None:
        if len(rows) == known.squares.numel() and rows == list(range(len(rows))):
            # the usual case: the measured parameters are the optimizer's, in its order
            squares, weight_squares = known.squares, known.weights
        else:  # an exact gather (two parameter groups: decay/no-decay), its index made once
            at = index.rows_index(rows, device)
            squares, weight_squares = known.squares[at], known.weights[at]
        shared: GradientSquares | None = known
    elif index.sharded:
        squares = per_tensor_norms(grads).pow(2)  # type: ignore[arg-type]
        weight_squares = None
        shared = None
    else:
        # every measured parameter's weight norm with the gradients' in one pass (the update ratios reuse them after
        # the step): one multi-tensor kernel and one stack for both lists, each norm the same as on its own
        both = per_tensor_norms([*grads, *(index.params[i] for i in chosen)]).pow(2)  # type: ignore[list-item]
        squares, weight_squares = both[: len(chosen)], both[len(chosen) :]
        shared = GradientSquares.of(grads, squares)  # type: ignore[arg-type]
    if index.sharded:
        squares = squares * torch.tensor([index.weights[i] for i in chosen], device=device)
    parts = [grouped_squares(squares, group_of, n_layers)]
    # comparable weight matrices: ||g_W|| / ||W|| per layer, and the blocks' gradient norm
    matrix = layout.matrix
    matrix_layers = layout.matrix_layers
    # under sharded training the matrices' weight norms only (below)
    if matrix:
        m_groups = layout.matrix_groups
        if weight_squares is not None:
            m_weight = weight_squares[layout.matrix_index]
        else:
            m_weight = per_tensor_norms([index.params[chosen[k]] for k in matrix]).pow(2)  # no autograd inside
        if index.sharded:
            m_weight = m_weight * torch.tensor([index.weights[chosen[k]] for k in matrix], device=device)
        parts.append(grouped_squares(squares[layout.matrix_index], m_groups, n_layers))
        parts.append(grouped_squares(m_weight, m_groups, n_layers))
    world = index.world_size if reduce is not None else 1
    loss_t = loss.reshape(1).to(device).float() if loss is not None else torch.full((1,), math.nan, device=device)
    if reduce is not None and index.sharded:
        # the one all-reduce of the step: every layer's weighted sums of squares, and the loss
        reduced = reduce(torch.cat([*parts, loss_t / world]))
        parts = list(reduced[:-1].split(n_layers))
        loss_t = reduced[-1:]
    elif reduce is not None:
        loss_t = reduce(loss_t) / world  # DDP: the gradients are already the full ones on every rank
    layer_norms = parts[0].sqrt()
    total = parts[0].sum().sqrt()
    rms = layer_norms / layout.numel_root
    derived: list[torch.Tensor] = []
    if matrix:
        relative = parts[1].sqrt() / parts[2].sqrt().clamp_min(1e-12)
        derived = [
            relative[layout.matrix_layer_index],
            parts[1].index_select(0, layout.in_block).sum().sqrt().reshape(1),
        ]
    present = layout.present
    host, extra_host = read_with([total.reshape(1), layer_norms, rms, *derived, loss_t], extra)  # the one copy
    if shared is not None and len(chosen) == len(shared.versions):  # every gradient of it: the total is theirs
        shared.total = host[0]  # the guard's pass at this step reads it on the host (no operator)
    return StepMeasurement(
        total=host[0],
        norms={index.layers[g]: host[1 + g] for g in present},
        rms={index.layers[g]: host[1 + n_layers + g] for g in present},
        relative={index.layers[g]: host[1 + 2 * n_layers + j] for j, g in enumerate(matrix_layers)},
        blocks=host[1 + 2 * n_layers + len(matrix_layers)] if matrix else host[0],
        has_matrices=bool(matrix),
        loss=host[-1] if math.isfinite(host[-1]) else None,
        weight_squares=weight_squares,
        extra=extra_host,
    )


def read_with(parts: Sequence[torch.Tensor], extra: torch.Tensor | None) -> tuple[list[float], list[float]]:
    """The host values of the 1-d tensors ``parts`` (on one device) and of a caller's ``extra`` 1-d tensor (moved
    there), in one host copy of their concatenation: ``(values of parts, values of extra)``, the second empty when
    ``extra`` is ``None``.

    Example:
        >>> read_with([torch.tensor([1.0]), torch.tensor([2.0, 3.0])], torch.tensor([4.0]))
        ([1.0, 2.0, 3.0], [4.0])
    """
    device = parts[0].device
    tensors = [*parts] if extra is None else [*parts, extra if extra.device == device else extra.to(device)]
    host = (tensors[0] if len(tensors) == 1 else torch.cat(tensors)).tolist()
    n = len(host) - (0 if extra is None else extra.numel())
    return host[:n], host[n:]


class WeightCopies:
    """The copies of the measured weights before an optimizer step (read by :func:`update_norms` after it), made
    into the same buffers at every measured step on the CPU.

    A fresh copy of the 1.1M-parameter MLP's weights costs 0.4-2.3 ms on one CPU thread, most of it the kernel
    zero-filling the new pages of each large allocation; copying into buffers kept from the last measured step
    costs 0.13 ms. The values are the same either way (the buffers are laid out as the weights). On other devices
    every copy is a fresh one: their caching allocators already reuse the memory, and a copy kept between
    measured steps would hold device memory the training needs.

    Example:
        >>> w = [torch.ones(3)]
        >>> copies = WeightCopies()
        >>> first = copies.take(0, w)
        >>> copies.release()
        >>> _ = w[0].add_(1.0)
        >>> second = copies.take(0, w)
        >>> second[0] is first[0], second[0].tolist()
        (True, [2.0, 2.0, 2.0])
    """

    def __init__(self) -> None:
        self._buffers: dict[object, list[torch.Tensor]] = {}
        self._lent: set[object] = set()

    def take(self, key: object, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of ``tensors`` (their local shards), the caller's until :meth:`release`; ``key`` names the list
        (the same key, the same tensors: the buffers of the last take under it are filled again)."""
        # outside autograd rather than from detach()-ed views: the same copies, one operator fewer per tensor
        sources = [local_tensor(t) for t in tensors]
        buffers = self._buffers.get(key)
        with torch.no_grad():
            if key in self._lent or buffers is None or not _same_layout(buffers, sources):
                copies = [s.clone() for s in sources]
                if key not in self._lent and sources and all(s.device.type == "cpu" for s in sources):
                    self._buffers[key] = copies
                    self._lent.add(key)
                return copies
            torch._foreach_copy_(buffers, sources)
        self._lent.add(key)
        return buffers

    def release(self) -> None:
        """The copies taken so far are consumed: the next :meth:`take` may fill their buffers again."""
        self._lent.clear()

    def clear(self) -> None:
        """Drop every buffer (a new fit)."""
        self._buffers = {}
        self._lent = set()


def _same_layout(buffers: list[torch.Tensor], sources: list[torch.Tensor]) -> bool:
    return len(buffers) == len(sources) and all(
        b.shape == s.shape and b.dtype == s.dtype and b.device == s.device and b.stride() == s.stride()
        for b, s in zip(buffers, sources, strict=True)
    )


def update_norms(
    index: ParamIndex,
    chosen: list[int],
    before: list[torch.Tensor],
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    weight_squares: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight norms and update ratios of ``chosen`` (their values by tag: :func:`update_ratio_values` of the
    vector's host values), on the device: one float32 vector of ``2 * len(index.layers)`` values, the layers'
    weight norms before the step then their update ratios (layers without a measured parameter hold 0 and NaN).

    Under sharded training ``before`` holds local shards and ``reduce`` (a SUM over all ranks) makes the sums of
    squares those of the full tensors, in one all-reduce; without sharding ``reduce`` is not used.
    """
    device = before[0].device
    layout = index.layout(chosen, device)
    group_of = layout.group_of
    after = [local_tensor(index.params[i]) for i in chosen]  # read outside autograd below, not detach()-ed
    n = len(index.layers)
    with torch.no_grad():
        weight_sq = weight_squares if weight_squares is not None else per_tensor_norms(before).pow(2)
        # The copies are this function's to consume: W_before - W_after in place (the norm of -dW), no second copy.
        torch._foreach_sub_(before, after)
        update_sq = per_tensor_norms(before).pow(2)
    if index.sharded:
        weights = torch.tensor([index.weights[i] for i in chosen], device=device)
        weight_sq, update_sq = weight_sq * weights, update_sq * weights
    both = torch.cat([grouped_squares(weight_sq, group_of, n), grouped_squares(update_sq, group_of, n)])
    if index.sharded and reduce is not None:
        both = reduce(both)
    weight, update = both.sqrt().split(n)
    return torch.cat([weight, update / weight.clamp_min(1e-12)])


def update_ratio_values(index: ParamIndex, chosen: list[int], host: Sequence[float]) -> dict[str, float]:
    """``diag/weight_norm/<layer>`` and ``diag/update_ratio/<layer>`` values (the layers' weight norms before the
    optimizer step, and ``||W_after - W_before|| / ||W_before||``) from the host values ``host`` of
    :func:`update_norms`' vector."""
    n = len(index.layers)
    values = {}
    for g in sorted({index.layer_of[i] for i in chosen}):  # the layers with a measured parameter
        values[weight_norm_tag(index.layers[g])] = host[g]
        values[update_ratio_tag(index.layers[g])] = host[n + g]
    return values
