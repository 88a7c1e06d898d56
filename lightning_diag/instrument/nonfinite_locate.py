"""Where did a NaN/Inf come from? Replay one training step with hooks and name the first place it appeared.

Used by :class:`~lightning_diag.AnomalyAlarm` (``locate_nonfinite=True``) on the first non-finite step only:
healthy steps pay nothing but one reference to the batch and a copy of the (few-kilobyte) RNG state.

The algorithm, in order (the first finding wins):

1. **input**: a floating-point tensor of the batch holds a NaN/Inf (``source="input"``, naming its key/position);
2. **forward**: forward hooks on every module; the first module, in the order their forwards *finish*
   (innermost first), whose output is non-finite while all its tensor inputs were finite
   (``source`` = its qualified name, or ``"loss"`` for a ``torch.nn`` loss module);
3. **loss**: every module output was finite but the loss is not (``source="loss"``, e.g. ``log(0)``);
4. **backward**: the loss is finite, so gradients are computed with :func:`torch.autograd.grad` (``.grad`` is
   never written) with tensor hooks on every module's outputs, inputs and own parameters; the module whose
   output gradient was finite while an input or parameter gradient was not, earliest in backward order
   (``source`` = its name, the message says "in backward"; ``"loss"`` when the gradient of the loss with respect
   to the model's output is already non-finite).

The replay must not change training: the RNG state (torch CPU and every device generator, ``random``, numpy;
:mod:`lightning_diag.instrument.rng`) is set to the state the original step started with (torch's generators, so
dropout draws the same masks; ``random`` and numpy are not rewound, only kept unchanged) and put back afterwards;
every buffer
(BatchNorm running statistics, ``num_batches_tracked``) is copied before and restored after; parameters,
``.grad`` and optimizer state are not touched.

Limits: in-place operations on a module's output after its forward hook ran are seen as they were when the
module returned; custom autograd functions are seen only at module boundaries; ``torch.compile``-d modules are
opaque (hooks on their submodules do not fire inside the compiled graph): the compiled module is named as a
whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import torch
from torch import nn

from lightning_diag.instrument.rng import RngState, preserved_rng

__all__ = [
    "INPUT_SOURCE",
    "LOSS_SOURCE",
    "Localisation",
    "find_nonfinite_in_batch",
    "locate",
]

INPUT_SOURCE = "input"
LOSS_SOURCE = "loss"
Phase = Literal["input", "forward", "loss", "backward", "none"]

_FLOAT16_MAX = float(torch.finfo(torch.float16).max)
_BFLOAT16_MAX = float(torch.finfo(torch.bfloat16).max)


@dataclasses.dataclass(frozen=True)
class Localisation:
    """What the replay found.

    Attributes:
        source: ``"input"``, a module's qualified name, ``"loss"``, or ``""`` when the replay found nothing.
        phase: ``"input"``, ``"forward"``, ``"loss"``, ``"backward"`` or ``"none"``.
        detail: One sentence for the alert message (module type, dtype, max |x|, NaN/Inf counts).
    """

    source: str
    phase: Phase
    detail: str

    @property
    def found(self) -> bool:
        """Whether the replay reproduced the non-finite value."""
        return self.phase != "none"

    def as_dict(self) -> dict[str, str]:
        """Plain strings (what DDP broadcasts between ranks)."""
        return {"source": self.source, "phase": self.phase, "detail": self.detail}

    @classmethod
    def from_dict(cls, data: Mapping[str, str]) -> Localisation:
        """Inverse of :meth:`as_dict`."""
        return cls(str(data["source"]), data["phase"], str(data["detail"]))  # type: ignore[arg-type]


NOT_FOUND = Localisation("", "none", "the replay of the step did not reproduce the non-finite value")


# -- tensors in nested structures -----------------------------------------------------------------------------
def _walk(obj: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _walk(value, f"{path}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _walk(value, f"{path}[{i}]")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from _walk(getattr(obj, field.name), f"{path}.{field.name}")


def _float_tensors(obj: Any, path: str = "") -> list[tuple[str, torch.Tensor]]:
    return [(p, t) for p, t in _walk(obj, path) if t.is_floating_point() or t.is_complex()]


def _bad_counts(t: torch.Tensor) -> tuple[int, int]:
    t = t.detach()
    return int(torch.isnan(t).sum()), int(torch.isinf(t).sum())


def _all_finite(tensors: list[tuple[str, torch.Tensor]]) -> bool:
    return all(bool(torch.isfinite(t.detach()).all()) for _, t in tensors)


def _max_abs(tensors: list[tuple[str, torch.Tensor]]) -> tuple[float, str]:
    best, dtype = 0.0, ""
    for _, t in tensors:
        if t.numel():
            m = float(t.detach().abs().max())
            if m >= best:
                best, dtype = m, str(t.dtype).replace("torch.", "")
    return best, dtype


def _diagnosis(out_nan: int, out_inf: int, max_in: float, dtype: str) -> str:
    counts = f"{out_nan} NaN / {out_inf} Inf"
    if dtype in ("float16", "bfloat16"):
        limit = _FLOAT16_MAX if dtype == "float16" else _BFLOAT16_MAX
        near = max_in > limit**0.5  # squares, sums and matmuls of values this large overflow
        hint = f"; {dtype} max is {limit:.6g}: likely an overflow" if out_inf and near else ""
    else:
        hint = ""
    if not hint and out_nan:
        hint = "; NaN from finite values: 0/0, inf-inf, log/sqrt of a negative"
    elif not hint:
        hint = "; an overflow"
    return f"{counts} from finite inputs ({dtype or 'no tensor input'}, max |x| {max_in:.3g}){hint}"


def find_nonfinite_in_batch(batch: Any) -> Localisation | None:
    """The first floating-point tensor of ``batch`` holding a NaN/Inf, or ``None``.

    Example:
        >>> find_nonfinite_in_batch({"x": torch.tensor([1.0, float("nan")])}).detail
        "batch['x'] (float32, shape (2,)) holds 1 NaN / 0 Inf"
    """
    for path, t in _float_tensors(batch, "batch"):
        if not bool(torch.isfinite(t).all()):
            nan, inf = _bad_counts(t)
            dtype = str(t.dtype).replace("torch.", "")
            return Localisation(
                INPUT_SOURCE, "input", f"{path} ({dtype}, shape {tuple(t.shape)}) holds {nan} NaN / {inf} Inf"
            )
    return None


# -- the replay -----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _preserved_buffers(module: nn.Module) -> Iterator[None]:
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, copy in saved:
                buf.copy_(copy)


@dataclasses.dataclass
class _Slot:
    """One tensor whose gradient is watched in backward."""

    time: int = -1
    finite: bool = True


class _Recorder:
    def __init__(self, module: nn.Module, root_name: str) -> None:
        self.root_name = root_name
        self.names = {m: (name or root_name) for name, m in module.named_modules()}
        self.depth = {m: (name.count(".") + 1 if name else 0) for name, m in module.named_modules()}
        self.forward_finding: Localisation | None = None
        self.clock = 0
        self.slots: dict[int, _Slot] = {}
        self.tensor_slots: dict[int, int] = {}  # id(tensor) -> slot id (tensors stay alive during the replay)
        self.keep: list[torch.Tensor] = []
        self.module_out: dict[nn.Module, list[int]] = {}
        self.module_in: dict[nn.Module, list[int]] = {}
        self.handles: list[Any] = []
        self.root = module

    def _slot(self, t: torch.Tensor) -> int | None:
        if not t.requires_grad:
            return None
        key = id(t)
        if key in self.tensor_slots:
            return self.tensor_slots[key]
        sid = len(self.slots)
        self.slots[sid] = slot = _Slot()
        self.tensor_slots[key] = sid
        self.keep.append(t)

        def hook(grad: torch.Tensor) -> None:
            if slot.time < 0:
                self.clock += 1
                slot.time = self.clock
                slot.finite = bool(torch.isfinite(grad).all())

        t.register_hook(hook)
        return sid

    def forward_hook(self, mod: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        inputs = _float_tensors((args, kwargs))
        outputs = _float_tensors(output)
        if self.forward_finding is None and not _all_finite(outputs) and _all_finite(inputs):
            out_nan = out_inf = 0
            for _, t in outputs:
                n, i = _bad_counts(t)
                out_nan, out_inf = out_nan + n, out_inf + i
            max_in, dtype = _max_abs(inputs)
            kind = type(mod).__name__
            is_loss = isinstance(mod, nn.modules.loss._Loss)
            name = self.names.get(mod, kind)
            self.forward_finding = Localisation(
                LOSS_SOURCE if is_loss else name,
                "forward",
                f"{kind} `{name}` forward: {_diagnosis(out_nan, out_inf, max_in, dtype)}",
            )
        if torch.is_grad_enabled():
            self.module_in[mod] = [s for _, t in inputs if (s := self._slot(t)) is not None]
            self.module_out[mod] = [s for _, t in outputs if (s := self._slot(t)) is not None]

    def attach(self) -> None:
        for mod in self.names:
            self.handles.append(mod.register_forward_hook(self.forward_hook, with_kwargs=True))

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def watch_parameters(self) -> dict[nn.Module, list[int]]:
        own: dict[nn.Module, list[int]] = {}
        for mod in self.names:
            own[mod] = [s for p in mod.parameters(recurse=False) if (s := self._slot(p)) is not None]
        return own

    def backward_finding(self, own_params: dict[nn.Module, list[int]], loss_out: list[int]) -> Localisation | None:
        def bad_time(ids: list[int]) -> int | None:
            times = [self.slots[s].time for s in ids if self.slots[s].time >= 0 and not self.slots[s].finite]
            return min(times) if times else None

        def ok(ids: list[int]) -> bool:
            seen = [self.slots[s] for s in ids if self.slots[s].time >= 0]
            return bool(seen) and all(s.finite for s in seen)

        candidates = []
        for mod, name in self.names.items():
            if not ok(self.module_out.get(mod, [])):
                continue
            t = bad_time(self.module_in.get(mod, []) + own_params.get(mod, []))
            if t is not None:
                candidates.append((t, -self.depth[mod], name, mod))
        if candidates:
            _, _, name, mod = min(candidates, key=lambda c: (c[0], c[1]))
            kind = type(mod).__name__
            is_loss = isinstance(mod, nn.modules.loss._Loss)
            return Localisation(
                LOSS_SOURCE if is_loss else name,
                "backward",
                f"{kind} `{name}` in backward: the gradient at its output is finite, at its input or "
                "parameters it is not",
            )
        if any(bad_time(ids) is not None for ids in [loss_out, *self.module_out.values()]):
            return Localisation(
                LOSS_SOURCE,
                "backward",
                "in backward: the gradient of the loss with respect to the model's output is already non-finite",
            )
        return None


def locate(
    module: nn.Module,
    run_step: Callable[[], torch.Tensor | None],
    *,
    rng_state: RngState | None = None,
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    loss_scale: float = 1.0,
    root_name: str | None = None,
    forward_only: bool = False,
) -> Localisation:
    """Replay one step (``run_step`` returns its loss) with hooks and find where the first NaN/Inf appeared.

    The input check (:func:`find_nonfinite_in_batch`) is the caller's: this function replays the model.

    Args:
        module: The model whose modules are hooked (``named_modules`` gives the names).
        run_step: Runs the forward pass and returns the (unscaled) loss tensor, or ``None``.
        rng_state: The RNG state the original step started with (so dropout draws the same masks); the
            current state is restored afterwards either way.
        context: Called to get the context the original step ran in (autocast of a mixed-precision plugin).
        loss_scale: Multiplies the loss before backward (a GradScaler's scale, so fp16 overflows reproduce).
        root_name: The name of ``module`` itself in messages (default: its class name).
        forward_only: Replay the forward pass only, without autograd (sharded training, where every rank must
            run the same collectives: a backward that some ranks skip would hang); a non-finite value that first
            appears in backward is then not localised.

    Returns:
        A :class:`Localisation`; ``phase == "none"`` when nothing non-finite was reproduced.
    """
    recorder = _Recorder(module, root_name or type(module).__name__)
    try:
        with preserved_rng(), _preserved_buffers(module):
            if rng_state is not None:
                rng_state.restore()
            recorder.attach()
            try:
                with (torch.no_grad() if forward_only else torch.enable_grad()), context():
                    loss = run_step()
            finally:
                recorder.detach()
            if recorder.forward_finding is not None:
                return recorder.forward_finding
            if not isinstance(loss, torch.Tensor):
                return NOT_FOUND
            if not bool(torch.isfinite(loss.detach()).all()):
                value = float(loss.detach().float().reshape(-1)[0])
                return Localisation(LOSS_SOURCE, "loss", f"every module output is finite, the loss is not ({value})")
            if forward_only or not loss.requires_grad:
                return NOT_FOUND
            own = recorder.watch_parameters()
            loss_slot = recorder._slot(loss)
            params = [p for p in module.parameters() if p.requires_grad]
            scaled = loss.float().sum() * loss_scale if loss_scale != 1.0 else loss.sum()
            grads = torch.autograd.grad(scaled, params, allow_unused=True)
            finding = recorder.backward_finding(own, [loss_slot] if loss_slot is not None else [])
            if finding is not None:
                return finding
            if any(g is not None and not bool(torch.isfinite(g).all()) for g in grads):
                return Localisation(LOSS_SOURCE, "backward", "in backward, outside every module boundary the hooks see")
            return NOT_FOUND
    finally:
        recorder.keep.clear()
