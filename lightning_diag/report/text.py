"""Text that ``lightning-diag report`` and ``compare`` print or write: safe for its format and for a terminal.

Everything shown comes from files a run (or someone else) wrote: alert messages, sources, rule and callback
names, hyperparameters, folder names. Before it is shown it is made

* printable: control characters (ESC, BEL, CR, LF, ...) are removed or, for line breaks and tabs, turned into
  a space, so nothing reaches a terminal as an escape sequence and a value never starts a new markdown line;
  lone surrogates and bytes that are not UTF-8 (a folder name, a damaged file) become ``U+FFFD``;
* escaped for its format: :func:`md` for markdown (the ``<`` and ``&`` that open raw HTML or an entity, and
  ``\\ ` [ ] |``, so no raw HTML, link or code span can be injected), :func:`html.escape` for HTML (the
  renderers' own), :func:`url` for a link.

Imports neither torch nor Lightning.

Example:
    >>> clean("ok\\x1b[31m red\\x07\\r\\nnext")
    'ok[31m red  next'
    >>> md("<script>alert(1)</script> | [x](javascript:y) <= 5 &amp;")
    '&lt;script>alert(1)&lt;/script> \\\\| \\\\[x\\\\](javascript:y) <= 5 &amp;amp;'
    >>> url("my run #2/loss.png")
    'my%20run%20%232/loss.png'
"""

from __future__ import annotations

import os
import re
from pathlib import PurePath
from urllib.parse import quote

__all__ = ["clean", "display", "md", "no_surrogates", "url"]

# C0 controls, DEL and C1 controls; line breaks and tabs are turned into spaces first.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
_BREAKS = re.compile("[\r\n\t\v\f\x85\u2028\u2029]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_MD_SPECIAL = re.compile(r"([\\`\[\]|])")
# What opens raw HTML, a comment or an autolink (`<` before a letter, `/`, `!` or `?`) and an entity (`&name;`,
# `&#..`): `< 0.1` and `<= 100` stay as they are.
_MD_TAG = re.compile(r"<(?=[A-Za-z/!?])")
_MD_AMP = re.compile(r"&(?=[A-Za-z#])")


def clean(text: object) -> str:
    """``text`` as one printable line: breaks and tabs become spaces, other control characters are removed,
    lone surrogates (from JSON ``\\ud800`` or undecodable file-name bytes) become ``U+FFFD``."""
    s = str(text)
    s = _BREAKS.sub(" ", s)
    s = _CONTROL.sub("", s)
    return _SURROGATE.sub("\ufffd", s)


def no_surrogates(text: str) -> str:
    """``text`` with each lone surrogate (valid in JSON as ``"\\ud800"``, not encodable as UTF-8) as U+FFFD."""
    return _SURROGATE.sub("\ufffd", text)


def display(path: str | os.PathLike[str]) -> str:
    """A path as text: undecodable bytes of a file name as ``U+FFFD``, control characters removed."""
    raw = os.fsencode(path)
    return clean(raw.decode("utf-8", "replace"))


def md(text: object) -> str:
    """``text`` for a markdown table cell or line: :func:`clean`, then the ``<`` that would open raw HTML or an
    autolink as ``&lt;``, the ``&`` that would open an entity as ``&amp;``, and the characters that open code
    spans, links or table cells (``\\ ` [ ] |``) backslash-escaped. ``< 0.1`` and ``<= 100`` stay readable."""
    s = _MD_AMP.sub("&amp;", clean(text))
    s = _MD_TAG.sub("&lt;", s)
    return _MD_SPECIAL.sub(r"\\\1", s)


def url(path: str | os.PathLike[str] | PurePath) -> str:
    """A relative file path as a URL path: each byte outside ``A-Z a-z 0-9 _ . - ~ /`` percent-encoded (a
    run named ``my run #2`` links to ``my%20run%20%232``; undecodable name bytes are encoded as they are)."""
    return quote(os.fsencode(path), safe="/")
