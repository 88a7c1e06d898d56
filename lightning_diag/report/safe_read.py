"""Reading a run's files safely: regular files only (a FIFO or device is refused, never waited on), and JSON that
raises only ``ValueError`` (numbers out of range, nesting too deep and lone surrogates included).

Used by :mod:`lightning_diag.report.load`, :mod:`lightning_diag.report.event_files` and the other readers of a
run's files. Imports neither torch nor Lightning.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any, BinaryIO

from lightning_diag.report.text import display, no_surrogates

__all__ = ["NotRegularFileError", "loads", "open_regular", "read_json", "read_regular"]


class NotRegularFileError(OSError):
    """Raised by :func:`read_regular` for a FIFO, socket, device or directory in place of a file."""


def read_regular(path: str | os.PathLike[str]) -> bytes:
    """The bytes of ``path``, read only when it is a regular file (a symbolic link to one is followed).

    Opened without blocking, so a FIFO in place of a file is refused at once instead of waiting for a writer.

    Raises:
        NotRegularFileError: If ``path`` is not a regular file.
        OSError: If it cannot be opened or read.
    """
    with open_regular(path) as fh:
        return fh.read()


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """``path`` opened for binary reading when it is a regular file, as :func:`read_regular` checks it.

    Raises:
        NotRegularFileError: If ``path`` is not a regular file.
        OSError: If it cannot be opened.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(f"not a regular file ({_kind(mode)}): {display(path)}")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a file"


def _parse_int(text: str) -> int | float:
    # A number too long for an int (Python caps int() at 4300 digits) or for a float reads as a float (inf).
    return int(text) if len(text) < 300 else float(text)


def _no_surrogates(obj: Any) -> Any:
    """``obj`` with lone surrogates (valid JSON ``"\\ud800"``, not encodable as UTF-8) replaced by U+FFFD."""
    if isinstance(obj, str):
        return no_surrogates(obj)
    if isinstance(obj, dict):
        return {_no_surrogates(k): _no_surrogates(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_no_surrogates(v) for v in obj]
    return obj


def loads(text: str) -> Any:
    """``json.loads`` that raises only ``ValueError``: for numbers out of range and nesting too deep too.

    Lone surrogates are replaced by U+FFFD.
    """
    try:
        return _no_surrogates(json.loads(text, parse_int=_parse_int))
    except RecursionError as err:
        raise ValueError("nested too deeply") from err


def read_json(path: str | os.PathLike[str]) -> Any:
    """A JSON file read with :func:`read_regular` (UTF-8, lone surrogates replaced by U+FFFD).

    Raises:
        OSError: If it is not a regular file or cannot be read.
        ValueError: If it is not valid UTF-8 or JSON (nesting too deep included).
    """
    return loads(read_regular(path).decode("utf-8"))
