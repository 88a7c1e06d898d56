"""A model's position capacity: how many positions its position encoding covers (``position_overflow``).

Looked for, in this order of preference, the smallest found wins (the binding limit):

* ``config.max_position_embeddings`` of a Hugging Face model (any module with a ``config``; GPT-2's
  ``n_positions`` is the same attribute);
* the number of rows of an ``nn.Embedding`` whose name's last component is a position embedding (``wpe``,
  ``pos``, ``pos_emb``, ``pos_embed``, ``pos_embedding``, ``position_embeddings``, ``position_embedding``,
  ``positional_embedding``);
* the length of a learned position parameter of the same names (``[1, L, d]`` or ``[L, d]``);
* a rotary cache buffer (``cos_cached``, ``sin_cached``, ``rope_cache``, ``freqs_cis``): its first dimension.
"""

from __future__ import annotations

import re

import torch
from torch import nn

__all__ = ["position_capacity"]

_POSITION_NAME = re.compile(
    r"wpe|pos|pos_emb|pos_embed|pos_embedding|position_embeddings?|positional_embedding|embed_positions"
)
_ROPE_CACHE = re.compile(r"cos_cached|sin_cached|rope_cache|freqs_cis")


def position_capacity(model: nn.Module) -> tuple[int, str] | None:
    """``(positions, where)`` of the tightest position limit found in ``model``, or ``None``.

    Example:
        >>> net = nn.Module()
        >>> net.wpe = nn.Embedding(128, 8)
        >>> position_capacity(net)
        (128, '`wpe` (nn.Embedding rows)')
        >>> position_capacity(nn.Linear(2, 2)) is None
        True
    """
    found: list[tuple[int, str]] = []
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        limit = getattr(config, "max_position_embeddings", None) if config is not None else None
        if isinstance(limit, int) and limit > 0:
            found.append((limit, f"`{name or 'model'}.config.max_position_embeddings`"))
        last = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Embedding) and _POSITION_NAME.fullmatch(last):
            offset = int(getattr(module, "offset", 0) or 0)  # BART's learned positions start at row 2
            found.append((module.num_embeddings - offset, f"`{name}` (nn.Embedding rows)"))
        for pname, param in module.named_parameters(recurse=False):
            if _POSITION_NAME.fullmatch(pname) and param.dim() in (2, 3):
                found.append((int(param.shape[-2]), f"`{name + '.' if name else ''}{pname}` (learned positions)"))
        for bname, buf in module.named_buffers(recurse=False):
            if _ROPE_CACHE.fullmatch(bname) and isinstance(buf, torch.Tensor) and buf.dim() >= 1:
                found.append((int(buf.shape[0]), f"`{name + '.' if name else ''}{bname}` (rotary cache)"))
    return min(found) if found else None
