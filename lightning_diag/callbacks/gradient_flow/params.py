"""Which parameters :class:`~lightning_diag.GradientFlowMonitor` measures, and which of them cannot learn.

Split out of :mod:`lightning_diag.callbacks.gradient_flow`: the ``params=`` selection (``fnmatch`` name patterns or
a predicate), the :class:`~lightning_diag.instrument.grad_measure.ParamIndex` of the selected trainable parameters
(built once per fit, at the first measured step) and ``grad_frozen``'s input, the selected parameters that cannot
learn (see :class:`~lightning_diag.rules.grad_frozen.GradFrozenRule`). Everything here runs on measured steps only.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Collection, Iterable, Sequence

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import BaseFinetuning

from lightning_diag.instrument.grad_measure import ParamIndex

__all__ = [
    "ParamSelector",
    "build_param_index",
    "check_param_selector",
    "is_selected",
    "stuck_parameters",
    "zero_gradient_ids",
]

#: ``params=``: parameter-name ``fnmatch`` patterns, or a predicate ``(name, parameter) -> bool``.
ParamSelector = Sequence[str] | Callable[[str, torch.nn.Parameter], bool]


def check_param_selector(params: object) -> None:
    """Check a ``params=`` argument (``None``, a list of name patterns or a predicate).

    Raises:
        TypeError: If ``params`` is none of those (a single string included).
    """
    if (
        params is not None
        and not callable(params)
        and (isinstance(params, str) or not isinstance(params, Iterable) or not all(isinstance(p, str) for p in params))
    ):
        raise TypeError(
            "Expected argument `params` to be a list of name patterns or a predicate (name, param) -> bool,"
            f" but got {params!r}"
        )


def is_selected(selector: ParamSelector | None, name: str, param: torch.nn.Parameter) -> bool:
    """Whether ``selector`` (``None``: every parameter) selects the parameter ``name``.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> is_selected(["encoder.*"], "encoder.0.weight", w), is_selected(["encoder.*"], "head.weight", w)
        (True, False)
        >>> is_selected(lambda name, p: p.ndim > 1, "head.weight", w)
        False
    """
    if selector is None:
        return True
    if callable(selector):
        return bool(selector(name, param))
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in selector)


def build_param_index(
    pl_module: pl.LightningModule,
    selector: ParamSelector | None,
    per_parameter: bool,
    logit_projections: Sequence[str],
    world_size: int,
) -> ParamIndex:
    """The index of the module's trainable parameters that ``selector`` selects (it may hold none)."""
    named = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad and is_selected(selector, n, p)]
    return ParamIndex(
        [n for n, _ in named],
        [p for _, p in named],
        per_parameter,
        dict(pl_module.named_modules()),
        logit_projections,
        world_size=world_size,
    )


def zero_gradient_ids(index: ParamIndex, chosen: list[int], norms: dict[str, float]) -> set[int]:
    """The ``id`` of the ``chosen`` parameters whose layer's measured gradient norm is exactly zero; none when
    half the layers or more are at zero (most of the model without a gradient is a collapse, ``grad_collapse``'s
    business, not a few stuck layers)."""
    zero_layers = {layer for layer, v in norms.items() if v == 0.0}
    if 2 * len(zero_layers) >= len(norms):
        return set()
    return {id(index.params[i]) for i in chosen if index.layers[index.layer_of[i]] in zero_layers}


def stuck_parameters(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    selector: ParamSelector | None,
    expect_frozen: Sequence[str],
    in_opt: set[int],
    zero: Collection[int] = (),
) -> dict[str, str]:
    """``{name: reason}`` for the selected parameters that cannot learn (see ``GradFrozenRule``).

    Args:
        trainer: The trainer (its optimizers and callbacks).
        pl_module: The module whose parameters are looked at.
        selector: ``params=`` (``None``: every parameter).
        expect_frozen: Name patterns of parameters frozen or left out on purpose: never reported.
        in_opt: The ``id`` of the parameters of the optimizer being stepped.
        zero: The ``id`` of the parameters whose layer's measured gradient is exactly zero (in the graph,
            nothing reaches them).

    Returns:
        ``"frozen"`` (``requires_grad=False``), ``"excluded"`` (trainable, in no optimizer), ``"no_grad"`` (in
        this optimizer, no gradient) or ``"zero_grad"`` by parameter name. With a ``BaseFinetuning`` callback
        attached, frozen and excluded parameters are that callback's business and are not reported.
    """
    finetuning = any(isinstance(cb, BaseFinetuning) for cb in trainer.callbacks)  # type: ignore[attr-defined]
    in_any = {id(p) for opt in trainer.optimizers for group in opt.param_groups for p in group["params"]}
    stuck: dict[str, str] = {}
    for name, p in pl_module.named_parameters():
        if any(fnmatch.fnmatchcase(name, pat) for pat in expect_frozen) or not is_selected(selector, name, p):
            continue
        if not p.requires_grad:
            if not finetuning:
                stuck[name] = "frozen"
        elif id(p) not in in_any:
            if not finetuning:
                stuck[name] = "excluded"
        elif id(p) in in_opt and p.grad is None:
            stuck[name] = "no_grad"
        elif id(p) in zero:
            stuck[name] = "zero_grad"
    return stuck
