"""The ``diag/`` tag vocabulary: every tag builder and parser, in one place.

The callbacks build their tags here, and the dashboard layout (:mod:`lightning_diag.output.dashboard`), the report
and the plots read them back with the parsers and patterns here, so a tag family is defined once. This module
imports only the standard library, so the report reads runs without torch or Lightning.

Families (``<layer>`` is a parameter group's module name, ``<module>`` an attention module's qualified name):

* ``diag/grad_norm/<layer>``, ``diag/grad_norm/total`` (first optimizer) and
  ``diag/grad_norm/total/optimizer_<i>`` (the ``i``-th optimizer, ``i >= 1``): gradient L2 norms. Totals are
  never layers (:func:`grad_layer` returns ``None`` for them).
* ``diag/update_ratio/<layer>``, ``diag/weight_norm/<layer>``, ``diag/grad_hist/<param>``,
  ``diag/act_grad_norm/<module>``, ``diag/act_dead/<layer>``, ``diag/act_saturated/<layer>``,
  ``diag/grad_zero/<layer>``.
* ``diag/attn_entropy/<module>/mean``, ``.../head_<h>``, ``.../uniform``; ``diag/attn_sink/<module>`` (named after its
  rule: ``tag(ATTN_SINK, module)``);
  images ``diag/attn_map/<module>``, ``diag/attn_heads/similarity|pca``.
* ``diag/loss/<name>`` (``train_step``, ``train_epoch``, ``train_window``, ``swing``, ``val``,
  ``train_fluctuation``, ``val_fluctuation``), ``diag/lr/<optimizer>/<group>``.
* ``diag/threshold/<rule>``: a rule's threshold as a reference series; text ``diag/alerts`` and
  ``diag/thresholds``.
* Families of newer callbacks: ``diag/data/...``, ``diag/system/...``, ``diag/overhead/<CallbackName>``,
  ``diag/sharpness/...``, ``diag/quant/...``, built with :func:`family_tag`. A callback that adds a family adds
  its builder and parser in a block of its own at the end of this module.

Example:
    >>> grad_total_tag(), grad_total_tag(1)
    ('diag/grad_norm/total', 'diag/grad_norm/total/optimizer_1')
    >>> grad_layer("diag/grad_norm/encoder.0"), grad_layer("diag/grad_norm/total/optimizer_1")
    ('encoder.0', None)
    >>> attn_head("diag/attn_entropy/blocks.0.attn/head_3")
    ('blocks.0.attn', 3)
"""

from __future__ import annotations

import functools
import re
from typing import Literal

__all__ = [
    "ALERTS_TAG",
    "FAMILIES",
    "GRAD_LAYER_PATTERN",
    "GRAD_TOTAL_PATTERN",
    "TAG_PREFIX",
    "THRESHOLDS_TAG",
    "LossSeries",
    "act_grad_norm_tag",
    "attn_distance_tag",
    "attn_entropy_tag",
    "attn_head",
    "attn_heads_tag",
    "attn_map_tag",
    "attn_mean",
    "attn_uniform_tag",
    "data_tag",
    "dead_units_tag",
    "errors_tag",
    "family_tag",
    "grad_blocks_tag",
    "grad_hist_tag",
    "grad_layer",
    "grad_norm_tag",
    "grad_relative_tag",
    "grad_rms_tag",
    "grad_total_optimizer",
    "grad_total_tag",
    "loss_tag",
    "lr_tag",
    "overhead_tag",
    "prefix",
    "robustness_tag",
    "sanitize_tag",
    "saturation_tag",
    "tag",
    "threshold_rule",
    "threshold_tag",
    "update_ratio_tag",
    "weight_norm_tag",
    "zero_grad_tag",
]

TAG_PREFIX = "diag"
_BAD_TAG_CHARS = re.compile(r"[^A-Za-z0-9_.\-/]")
#: Text tag of the alert table (newest first).
ALERTS_TAG = TAG_PREFIX + "/alerts"
#: Text tag of the thresholds-in-effect table written at fit start.
THRESHOLDS_TAG = TAG_PREFIX + "/thresholds"
#: Tag families of the newer callbacks, for :func:`family_tag`.
FAMILIES: tuple[str, ...] = ("data", "system", "overhead", "sharpness", "quant", "errors", "robustness")

#: The names of the ``diag/loss/<name>`` series.
LossSeries = Literal[
    "train_step", "train_epoch", "train_window", "train_spread", "swing", "val", "val_se", "train_fluctuation",
    "val_fluctuation",
]


def sanitize_tag(part: str) -> str:
    """Make one tag component safe for TensorBoard (letters, digits, ``_ . - /``).

    Example:
        >>> sanitize_tag("layer[0] weight")
        'layer_0__weight'
    """
    return _BAD_TAG_CHARS.sub("_", part) or "_"


@functools.lru_cache(maxsize=8192)  # a fit asks for the same few hundred tags at every measuring step
def tag(*parts: str) -> str:
    """Build a ``diag/...`` tag from components.

    Example:
        >>> tag("grad_norm", "encoder.layers.0")
        'diag/grad_norm/encoder.layers.0'
    """
    return "/".join([TAG_PREFIX, *(sanitize_tag(p) for p in parts)])


def prefix(family: str) -> str:
    """The prefix every tag of a family starts with (``"diag/grad_norm/"``)."""
    return f"{TAG_PREFIX}/{family}/"


# -- builders ---------------------------------------------------------------------------------------------


def threshold_tag(rule: str) -> str:
    """The tag of a rule's threshold reference series.

    Example:
        >>> threshold_tag("grad_explode")
        'diag/threshold/grad_explode'
    """
    return tag("threshold", rule)


def grad_norm_tag(layer: str) -> str:
    """A layer's gradient L2 norm."""
    return tag("grad_norm", layer)


def grad_total_tag(optimizer: int = 0) -> str:
    """The global gradient norm of the ``optimizer``-th optimizer (``diag/grad_norm/total`` for the first)."""
    return tag("grad_norm", "total") if optimizer == 0 else tag("grad_norm", "total", f"optimizer_{optimizer}")


def update_ratio_tag(layer: str) -> str:
    """A layer's update-to-weight ratio."""
    return tag("update_ratio", layer)


def weight_norm_tag(layer: str) -> str:
    """A layer's weight L2 norm."""
    return tag("weight_norm", layer)


def grad_hist_tag(param: str) -> str:
    """A parameter's gradient histogram."""
    return tag("grad_hist", param)


def act_grad_norm_tag(module: str) -> str:
    """The gradient norm of a module's output (activation gradient)."""
    return tag("act_grad_norm", module)


def dead_units_tag(layer: str) -> str:
    """Share of a layer's units inactive for every sample of a measured batch (ReLU family)."""
    return tag("act_dead", layer)


def saturation_tag(layer: str) -> str:
    """Share of a bounded activation's inputs beyond its linear range, after ``layer``."""
    return tag("act_saturated", layer)


def zero_grad_tag(layer: str) -> str:
    """Share of exactly-zero entries of a layer's weight gradient (layers followed by a ReLU)."""
    return tag("grad_zero", layer)


def attn_entropy_tag(module: str, head: int | Literal["mean", "uniform"]) -> str:
    """An attention module's entropy: one head (``head_<h>``), the mean over heads, or the uniform reference.

    Example:
        >>> attn_entropy_tag("enc.0.attn", 2), attn_entropy_tag("enc.0.attn", "mean")
        ('diag/attn_entropy/enc.0.attn/head_2', 'diag/attn_entropy/enc.0.attn/mean')
    """
    return tag("attn_entropy", module, head if isinstance(head, str) else f"head_{head}")


def attn_distance_tag(module: str, head: int, relative: bool = False) -> str:
    """A head's mean attention distance |i − j| (``diag/attn_distance/...``), or the same over the sequence
    length (``diag/attn_distance_relative/...``).

    Example:
        >>> attn_distance_tag("h.0.attn", 1), attn_distance_tag("h.0.attn", 1, relative=True)
        ('diag/attn_distance/h.0.attn/head_1', 'diag/attn_distance_relative/h.0.attn/head_1')
    """
    return tag("attn_distance_relative" if relative else "attn_distance", module, f"head_{head}")


def attn_uniform_tag(module: str) -> str:
    """The entropy of uniform attention over the module's keys (the largest possible)."""
    return attn_entropy_tag(module, "uniform")


def attn_map_tag(module: str) -> str:
    """The image of a module's attention maps."""
    return tag("attn_map", module)


def attn_heads_tag(kind: Literal["similarity", "pca"]) -> str:
    """The head-similarity heatmap or PCA scatter image."""
    return tag("attn_heads", kind)


def loss_tag(name: LossSeries) -> str:
    """A loss series (``diag/loss/train_step``, ...)."""
    return tag("loss", name)


def lr_tag(*parts: str) -> str:
    """A learning rate: ``lr_tag("optimizer_0", "group_1")`` -> ``diag/lr/optimizer_0/group_1``."""
    return tag("lr", *parts)


def family_tag(family: str, *parts: str) -> str:
    """A tag of one of the newer families (:data:`FAMILIES`): ``diag/<family>/<parts...>``.

    Raises:
        ValueError: If ``family`` is not one of :data:`FAMILIES`.

    Example:
        >>> family_tag("data", "label_balance", "std")
        'diag/data/label_balance/std'
    """
    if family not in FAMILIES:
        raise ValueError(f"`family` can be {', '.join(FAMILIES)}, got {family!r}")
    return tag(family, *parts)


def data_tag(*parts: str) -> str:
    """A DataDiagnostics tag: ``data_tag("train", "seq_len")`` -> ``diag/data/train/seq_len``."""
    return family_tag("data", *parts)


def overhead_tag(callback: str) -> str:
    """A callback's own share of the step time: ``diag/overhead/<CallbackName>``."""
    return family_tag("overhead", callback)


# -- GradientFlowMonitor's scale-free quantities (issue 11) ---------------------------------------------
def grad_rms_tag(layer: str) -> str:
    """RMS gradient per element of a layer (``grad_explode``): ``diag/grad_rms/<layer>``."""
    return tag("grad_rms", layer)


def grad_relative_tag(layer: str) -> str:
    """``||g_W|| / ||W||`` of a comparable weight matrix (``grad_vanish``, ``grad_layer_spread``)."""
    return tag("grad_relative", layer)


def grad_blocks_tag() -> str:
    """L2 norm of the blocks' weight-matrix gradients (``grad_collapse``): ``diag/grad_blocks/norm``."""
    return tag("grad_blocks", "norm")


# -- parsers ----------------------------------------------------------------------------------------------

_GRAD = prefix("grad_norm")
_GRAD_TOTAL = re.compile(r"^diag/grad_norm/total(?:/optimizer_(?P<i>[0-9]+))?$")
_HEAD = re.compile(r"^diag/attn_entropy/(?P<module>.+)/head_(?P<head>[0-9]+)$")
_MEAN = re.compile(r"^diag/attn_entropy/(?P<module>.+)/mean$")
_THRESHOLD = prefix("threshold")
#: Regular expression (TensorBoard custom scalars, matched from the start) of the per-layer gradient norms,
#: excluding every total.
GRAD_LAYER_PATTERN = r"diag/grad_norm/(?!total(/optimizer_[0-9]+)?$)"
#: Regular expression of the global gradient norms of every optimizer.
GRAD_TOTAL_PATTERN = r"diag/grad_norm/total(/optimizer_[0-9]+)?$"


def grad_total_optimizer(name: str) -> int | None:
    """The optimizer index of a global-norm tag, or ``None`` when ``name`` is not one.

    Example:
        >>> grad_total_optimizer("diag/grad_norm/total"), grad_total_optimizer("diag/grad_norm/total/optimizer_2")
        (0, 2)
        >>> grad_total_optimizer("diag/grad_norm/encoder") is None
        True
    """
    match = _GRAD_TOTAL.match(name)
    if match is None:
        return None
    return int(match["i"]) if match["i"] is not None else 0


def grad_layer(name: str) -> str | None:
    """The layer of a per-layer gradient-norm tag; ``None`` for the totals and for other tags."""
    if not name.startswith(_GRAD) or grad_total_optimizer(name) is not None:
        return None
    return name[len(_GRAD) :]


def attn_head(name: str) -> tuple[str, int] | None:
    """``(module, head)`` of a per-head entropy tag, else ``None``."""
    match = _HEAD.match(name)
    return (match["module"], int(match["head"])) if match else None


def attn_mean(name: str) -> str | None:
    """The module of a mean-entropy tag, else ``None``."""
    match = _MEAN.match(name)
    return match["module"] if match else None


def threshold_rule(name: str) -> str | None:
    """The rule of a ``diag/threshold/<rule>`` tag, else ``None``."""
    return name[len(_THRESHOLD) :] if name.startswith(_THRESHOLD) else None


# -- probes (SharpnessProbe, QuantizationProbe) -------------------------------------------------------------
# diag/sharpness/<measure>, diag/sharpness/layer/<layer>; diag/quant/<measure>, diag/quant/layer/<layer>/<measure>

__all__ += ["quant_layer", "quant_layer_tag", "quant_tag", "sharpness_layer_tag", "sharpness_tag"]

_QUANT_LAYER = re.compile(r"^diag/quant/layer/(?P<layer>.+)/(?P<measure>[a-z_]+)$")


def sharpness_tag(measure: str) -> str:
    """``diag/sharpness/<measure>`` (``gap``, ``relative_gap``, ``loss``, ``perturbed_loss``, ``grad_norm``)."""
    return family_tag("sharpness", measure)


def sharpness_layer_tag(layer: str) -> str:
    """``diag/sharpness/layer/<layer>``: the SAM gap with only that layer perturbed."""
    return family_tag("sharpness", "layer", layer)


def quant_tag(measure: str) -> str:
    """``diag/quant/<measure>`` (``end_to_end``, ``loss_float``, ``loss_int8``, ``worst_layer_ratio``,
    ``max_error_pct``)."""
    return family_tag("quant", measure)


def quant_layer_tag(layer: str, measure: str) -> str:
    """``diag/quant/layer/<layer>/<measure>``.

    Example:
        >>> quant_layer(quant_layer_tag("encoder.0", "relative_mse"))
        ('encoder.0', 'relative_mse')
    """
    return family_tag("quant", "layer", layer, measure)


def quant_layer(name: str) -> tuple[str, str] | None:
    """``(layer, measure)`` of a ``diag/quant/layer/<layer>/<measure>`` tag, else ``None``."""
    match = _QUANT_LAYER.match(name)
    return (match["layer"], match["measure"]) if match else None


def errors_tag(*parts: str) -> str:
    """An ErrorAnalysis tag: ``errors_tag("rate")`` -> ``diag/errors/rate``."""
    return family_tag("errors", *parts)


def robustness_tag(*parts: str) -> str:
    """A RobustnessProbe tag: ``robustness_tag("swap", "drop")`` -> ``diag/robustness/swap/drop``."""
    return family_tag("robustness", *parts)


# -- silent errors (issue 22): GradientFlowMonitor's update sample, AnomalyAlarm's replica checksums ---------
# diag/updates/<layer> (share of sampled elements with a non-zero gradient the step left unchanged),
# diag/replicas/max_rel_diff and diag/replicas/agree (1 when every replica holds the same parameters).

__all__ += ["replicas_tag", "updates_layer", "updates_unchanged_tag"]

_UPDATES = prefix("updates")


def updates_unchanged_tag(layer: str) -> str:
    """Share of a layer's sampled elements left unchanged by the measured step: ``diag/updates/<layer>``.

    Example:
        >>> updates_unchanged_tag("encoder.0")
        'diag/updates/encoder.0'
    """
    return tag("updates", layer)


def updates_layer(name: str) -> str | None:
    """The layer of a ``diag/updates/<layer>`` tag, else ``None``."""
    return name[len(_UPDATES) :] if name.startswith(_UPDATES) else None


def replicas_tag(measure: Literal["max_rel_diff", "agree"]) -> str:
    """A replica-agreement series of ``ddp_desync``: ``diag/replicas/max_rel_diff`` or ``diag/replicas/agree``.

    Example:
        >>> replicas_tag("agree")
        'diag/replicas/agree'
    """
    return tag("replicas", measure)
