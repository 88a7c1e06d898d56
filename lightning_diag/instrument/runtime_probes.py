"""Looks at what a model does on a sampled step, without changing it: dropouts run in training mode, the dtype
matmul layers compute in, what ``train()`` overrides would do (on a copy of the model on the ``meta`` device),
spectral norms whose power iteration never ran.

Everything here is installed for one batch and removed after it; nothing runs on other steps.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

__all__ = [
    "DropoutWatch",
    "MatmulDtypeProbe",
    "meta_copy",
    "train_override_effects",
    "train_overriders",
    "unconverged_spectral_norms",
]

_F = torch.nn.functional
#: Functional dropouts: (function, position of ``p``, position of the training flag, its name, its default).
_DROPOUTS: dict[Callable[..., Any], tuple[int, int, str, bool]] = {
    _F.dropout: (1, 2, "training", True),
    _F.dropout1d: (1, 2, "training", True),
    _F.dropout2d: (1, 2, "training", True),
    _F.dropout3d: (1, 2, "training", True),
    _F.alpha_dropout: (1, 2, "training", False),
    _F.feature_alpha_dropout: (1, 2, "training", False),
    torch.dropout: (1, 2, "train", True),
    torch.alpha_dropout: (1, 2, "train", True),
    torch.feature_dropout: (1, 2, "train", True),
    torch.feature_alpha_dropout: (1, 2, "train", True),
}
_P_DEFAULT = 0.5


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], pos: int, name: str, default: Any) -> Any:
    if len(args) > pos:
        return args[pos]
    return kwargs.get(name, default)


class _ModuleStack:
    """The modules being run (global forward pre/post hooks), to name a call after the innermost one."""

    def __init__(self, root: nn.Module) -> None:
        self.names = {id(m): n for n, m in root.named_modules()}
        self.stack: list[str] = []
        self._handles: list[RemovableHandle] = []

    def start(self) -> None:
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._push),
            nn.modules.module.register_module_forward_hook(self._pop, always_call=True),
        ]

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.stack = []

    def _push(self, module: nn.Module, args: Any) -> None:
        name = self.names.get(id(module))
        if name is not None:
            self.stack.append(name)

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        if id(module) in self.names and self.stack:
            self.stack.pop()

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else ""


class _DropoutMode(TorchFunctionMode):
    def __init__(self, watch: DropoutWatch) -> None:
        super().__init__()
        self.watch = watch

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.watch.seen(func, args, kwargs)
        return func(*args, **kwargs)


class DropoutWatch:
    """Records the dropouts applied in training mode while it is active: ``found`` maps the innermost module of
    ``root`` that ran each (its qualified name, ``""`` for the root) to the largest ``p``. Calls run unchanged.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1)).eval()
        >>> watch = DropoutWatch(net)
        >>> watch.start(); _ = net(torch.ones(1, 2)); _ = _F.dropout(torch.ones(2), 0.3); watch.stop()
        >>> watch.found
        {'': 0.3}
    """

    def __init__(self, root: nn.Module) -> None:
        self.modules = _ModuleStack(root)
        self.found: dict[str, float] = {}
        self._mode: _DropoutMode | None = None

    def start(self) -> None:
        """Start watching (a torch-function mode and the module stack)."""
        self.found = {}
        self.modules.start()
        self._mode = _DropoutMode(self)
        self._mode.__enter__()

    def stop(self) -> None:
        """Stop watching; :attr:`found` keeps what was seen."""
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        self.modules.stop()

    @property
    def active(self) -> bool:
        """Whether it is watching."""
        return self._mode is not None

    def seen(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Note ``func`` if it is a dropout (or an attention with dropout) applied in training mode."""
        if func is _F.scaled_dot_product_attention:
            p = float(_arg(args, kwargs, 4, "dropout_p", 0.0) or 0.0)
        else:
            spec = _DROPOUTS.get(func)
            if spec is None:
                return
            p_pos, t_pos, t_name, t_default = spec
            if not _arg(args, kwargs, t_pos, t_name, t_default):
                return
            p = float(_arg(args, kwargs, p_pos, "p", _P_DEFAULT))
        if p > 0:
            name = self.modules.current
            self.found[name] = max(p, self.found.get(name, 0.0))


#: The layers whose compute dtype tells whether autocast applies (they autocast to the low-precision dtype).
_MATMUL_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Bilinear)


class MatmulDtypeProbe:
    """Forward hooks on the matmul layers (``nn.Linear``, ``nn.Conv*``, ``nn.Bilinear``) of ``root`` for one step:
    ``layers`` and ``float32`` map each layer that ran (and each that output float32) to its parameter count.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
        >>> probe = MatmulDtypeProbe(net)
        >>> probe.start(); _ = net(torch.ones(1, 2)); probe.stop()
        >>> probe.layers, probe.float32
        ({'0': 9, '2': 4}, {'0': 9, '2': 4})
    """

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.layers: dict[str, int] = {}
        self.float32: dict[str, int] = {}
        self._handles: list[RemovableHandle] = []

    def start(self) -> None:
        """Install the hooks."""
        self.layers, self.float32 = {}, {}
        for name, module in self.root.named_modules():
            if isinstance(module, _MATMUL_LAYERS):
                self._handles.append(module.register_forward_hook(self._hook(name, module)))

    def _hook(self, name: str, module: nn.Module) -> Callable[..., None]:
        count = sum(p.numel() for p in module.parameters(recurse=False))

        def hook(mod: nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor) and output.is_floating_point():
                self.layers[name] = count
                if output.dtype == torch.float32:
                    self.float32[name] = count

        return hook

    def stop(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def active(self) -> bool:
        """Whether the hooks are installed."""
        return bool(self._handles)


def train_overriders(root: nn.Module) -> list[str]:
    """The classes among ``root``'s modules that override ``nn.Module.train`` (``root`` included), in module order.

    Example:
        >>> class Frozen(nn.Linear):
        ...     def train(self, mode=True):
        ...         return super().train(mode)
        >>> train_overriders(nn.Sequential(nn.Linear(1, 1), Frozen(1, 1)))
        ['Frozen']
    """
    out: list[str] = []
    for module in root.modules():
        name = type(module).__qualname__
        if type(module).train is not nn.Module.train and name not in out:
            out.append(name)
    return out


def meta_copy(root: nn.Module) -> nn.Module:
    """A copy of ``root``'s module tree whose parameters and buffers live on the ``meta`` device (shapes, dtypes
    and ``requires_grad`` kept, no storage), for running user code without touching the live model.

    ``copy.deepcopy`` with its memo filled beforehand: every parameter, buffer and tensor attribute of the tree's
    modules maps to an empty ``meta`` tensor, and every hook dictionary to an empty one (the forward hooks are not
    copied, nor the objects their bound methods hold); everything else the modules hold (counters, flags, lists,
    configuration objects) is copied. A ``LightningModule`` leaves its trainer out of its copy (its own
    ``__getstate__``).

    Raises:
        Exception: Whatever copying raised (a parameter subclass ``meta`` cannot hold, an attribute that cannot be
            copied: a lock, an open file, a generator).
    """
    memo: dict[int, Any] = {}
    for module in root.modules():
        state = vars(module)
        for param in module._parameters.values():
            if param is not None and id(param) not in memo:
                meta = torch.empty_like(param, device="meta")
                memo[id(param)] = nn.Parameter(meta, requires_grad=param.requires_grad)
        for value in [*module._buffers.values(), *state.values()]:
            if isinstance(value, torch.Tensor) and id(value) not in memo:
                memo[id(value)] = torch.empty_like(value, device="meta")
        for name, value in state.items():
            if name.endswith(("hooks", "hooks_with_kwargs", "hooks_always_called")) and isinstance(value, dict):
                memo[id(value)] = type(value)()
    return copy.deepcopy(root, memo)


def train_override_effects(root: nn.Module, notes: list[str] | None = None) -> tuple[list[str], list[str]]:
    """What ``root.train(True)`` (so every ``train()`` override below it) would change that is not in effect now:
    the modules it would put in eval mode that are in training mode, and the trainable parameters it would freeze.

    The call is made on a :func:`meta_copy` of the model, under ``no_grad``: the live model is never passed to the
    user's code, so whatever else the override does (a counter, a re-initialised weight) happens to the copy only.
    What the override does outside the module tree (a global, a file, a print) still happens. An override that
    raises on the copy (one that reads a tensor's values, which a ``meta`` tensor has not), or a tree that cannot
    be copied, is treated as having no effect, and the reason is appended to ``notes``.

    Example:
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.stem, self.head = nn.Linear(2, 2), nn.Linear(2, 1)
        ...     def train(self, mode=True):
        ...         super().train(mode)
        ...         self.stem.requires_grad_(not mode)
        ...         return self
        >>> net = Net()
        >>> train_override_effects(net)
        ([], ['stem.bias', 'stem.weight'])
        >>> net.stem.weight.requires_grad  # never touched
        True
    """
    modules = list(root.named_modules())
    params = list(root.named_parameters())
    flags = [m.training for _, m in modules]
    grads = [p.requires_grad for _, p in params]
    try:
        twin = meta_copy(root)
    except Exception as err:  # the model is the user's: a tree that cannot be copied is not a reason to stop
        if notes is not None:
            notes.append(f"the module tree could not be copied ({type(err).__name__}: {err})")
        return [], []
    twin_modules = [m for _, m in twin.named_modules()]
    twin_params = [p for _, p in twin.named_parameters()]
    if len(twin_modules) != len(modules) or len(twin_params) != len(params):
        if notes is not None:
            notes.append("the copy of the module tree does not have the model's modules and parameters")
        return [], []
    try:
        with torch.no_grad():
            twin.train(True)
    except Exception as err:  # a broken override is the user's to find, not a reason to stop training
        if notes is not None:
            notes.append(f"the override raised on the copy ({type(err).__name__}: {err})")
        return [], []
    after_flags = [m.training for m in twin_modules]
    after_grads = [p.requires_grad for p in twin_params]
    to_eval = sorted(
        n or "<root>" for (n, _), now, then in zip(modules, flags, after_flags, strict=True) if now and not then
    )
    frozen = sorted(n for (n, _), now, then in zip(params, grads, after_grads, strict=True) if now and not then)
    return to_eval, frozen


def unconverged_spectral_norms(root: nn.Module, tolerance: float = 1e-3) -> list[str]:
    """Modules with an ``nn.utils.spectral_norm`` whose power iteration has never run: its ``u`` is not
    ``normalize(W v)``, the invariant every iteration leaves (a fresh module has random ``u`` and ``v``). A
    module trained, or loaded from a trained checkpoint, holds the invariant; the newer
    ``nn.utils.parametrizations.spectral_norm`` iterates at construction and is never listed.

    Example:
        >>> conv = nn.utils.spectral_norm(nn.Linear(4, 4))
        >>> unconverged_spectral_norms(nn.Sequential(conv))
        ['0']
        >>> _ = conv(torch.ones(1, 4))  # one training-mode forward runs the power iteration
        >>> unconverged_spectral_norms(nn.Sequential(conv))
        []
    """
    found = []
    with torch.no_grad():
        for name, module in root.named_modules():
            for hook in list(getattr(module, "_forward_pre_hooks", {}).values()):
                if not isinstance(hook, SpectralNorm):
                    continue
                weight = getattr(module, hook.name + "_orig", None)
                u = getattr(module, hook.name + "_u", None)
                v = getattr(module, hook.name + "_v", None)
                if not (
                    isinstance(weight, torch.Tensor) and isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor)
                ):
                    continue
                mat = hook.reshape_weight_to_matrix(weight).float()
                expected = _F.normalize(torch.mv(mat, v.float()), dim=0)
                if float((expected - u.float()).abs().max()) > tolerance:
                    found.append(name)
                    break
    return found
