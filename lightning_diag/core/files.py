"""The files a run's ``diag/`` folder holds, and the one policy for writing them (stdlib only).

The names are shared by the callbacks that write the files and the report that reads them. Every file the
diagnostics write during training (``thresholds.json``, ``run.json``, ``errors.json``, ``report.md``, the alert
log, the event files) is written under one rule: **a diagnostic never ends a fit because its own output failed**.
A write that fails (a read-only folder, a full disk, a quota, a path that is a file) is reported once per path
through the ``lightning_diag`` logger, naming the path and the error, and the run goes on without that output
(:func:`report_write_failure`). :func:`write_text` and :func:`write_json` apply it to whole files, written
atomically (a temporary file in the same folder, then a rename), so a failed write never leaves a truncated file
in place of a good one; the streaming writers (the alert log, the event files) call
:func:`report_write_failure` themselves and stop writing to a file that failed.

Example:
    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> write_json(os.path.join(folder, "diag", "x.json"), {"a": 1})
    True
    >>> open(os.path.join(folder, "diag", "x.json"), encoding="utf-8").read()
    '{\\n  "a": 1\\n}'
    >>> import shutil; shutil.rmtree(folder)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from typing import Any

__all__ = [
    "ALERTS_FILE",
    "THRESHOLDS_FILE",
    "describe_error",
    "report_write_failure",
    "write_json",
    "write_text",
]

log = logging.getLogger("lightning_diag")

#: The alert log, one JSON object per line (:class:`~lightning_diag.core.alerts.AlertLog`).
ALERTS_FILE = "alerts.jsonl"
#: The thresholds in effect for the fit, by callback and merged (written once per fit on rank zero).
THRESHOLDS_FILE = "thresholds.json"

_reported: set[str] = set()
_lock = threading.Lock()


def describe_error(err: BaseException) -> str:
    """``OSError: [Errno 28] No space left on device`` style: the type and the reason, without the path (the
    message names the path once)."""
    if isinstance(err, OSError) and err.strerror:
        reason = f"[Errno {err.errno}] {err.strerror}" if err.errno is not None else err.strerror
    else:
        reason = str(err)
    return f"{type(err).__name__}: {reason}" if reason else type(err).__name__


def report_write_failure(path: str | os.PathLike[str], err: BaseException) -> bool:
    """Warn, once per path for the process, that ``path`` could not be written and the run goes on without it.

    Thread-safe (the event-file writer reports from its own thread).

    Returns:
        Whether this call warned (``False``: the path was reported before).
    """
    key = os.path.abspath(os.fspath(path))
    with _lock:
        if key in _reported:
            return False
        _reported.add(key)
    log.warning("could not write %s (%s); training goes on without this output", key, describe_error(err))
    return True


def write_text(path: str | os.PathLike[str], text: str) -> bool:
    """Write ``text`` (UTF-8) to ``path`` atomically, creating its folder; a failure is reported, never raised.

    Returns:
        Whether the file was written.
    """
    path = os.fspath(path)
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    try:
        if folder:
            os.makedirs(folder, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        report_write_failure(path, err)
        return False
    return True


def write_json(path: str | os.PathLike[str], obj: Any, **dump_kwargs: Any) -> bool:
    """Write ``obj`` as indented JSON (``json.dumps(obj, indent=2, **dump_kwargs)``) through :func:`write_text`.

    Returns:
        Whether the file was written.
    """
    return write_text(path, json.dumps(obj, indent=2, **dump_kwargs))
