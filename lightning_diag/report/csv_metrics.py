"""Reading a ``CSVLogger``'s ``metrics.csv`` for ``lightning-diag report``.

Lightning's ``CSVLogger`` writes one row per logging step: a ``step`` column, an ``epoch`` column and one column
per logged name, empty where the name was not logged at that step (``NaN`` and ``inf`` as Python writes them).
:func:`read_metrics_csv` returns the columns the caller keeps as ``(step, value)`` series. The file is read as a
regular file (a FIFO is refused) and a row that cannot be read is counted and said once. Imports neither torch nor
Lightning.

Example:
    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "metrics.csv"
    >>> _ = path.write_text("epoch,step,train_loss,val_loss\\n0,9,0.9,\\n0,9,,1.1\\n1,19,nan,\\n")
    >>> series = read_metrics_csv(path, lambda name: "loss" in name or name == "epoch", [])
    >>> series["train_loss"], series["val_loss"]
    ([(9, 0.9), (19, nan)], [(9, 1.1)])
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from pathlib import Path

from lightning_diag.report.event_files import Series
from lightning_diag.report.safe_read import read_regular
from lightning_diag.report.text import clean, display

__all__ = ["METRICS_CSV", "read_metrics_csv"]

#: The file name ``CSVLogger`` writes in each version folder.
METRICS_CSV = "metrics.csv"
_STEP = "step"


def read_metrics_csv(path: Path, keep: Callable[[str], bool], problems: list[str]) -> dict[str, Series]:
    """The kept columns of a ``metrics.csv`` (and every ``diag/`` column), name -> points in step order.

    A file that cannot be read, or has no ``step`` column, is said in ``problems`` and gives nothing; rows whose
    step or value is not a number are skipped and counted.
    """
    try:
        text = read_regular(path).decode("utf-8", "replace")
    except OSError as err:
        problems.append(f"{display(path)}: skipped: {clean(err)}")
        return {}
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if not header or _STEP not in header:
        problems.append(f"{display(path)}: no `{_STEP}` column; not a CSVLogger metrics file, skipped")
        return {}
    step_at = header.index(_STEP)
    columns = [(i, name) for i, name in enumerate(header) if i != step_at and (name.startswith("diag/") or keep(name))]
    out: dict[str, Series] = {}
    bad = 0
    for row in reader:
        try:
            step = int(float(row[step_at]))
        except (ValueError, IndexError, OverflowError):
            bad += 1
            continue
        for i, name in columns:
            cell = row[i] if i < len(row) else ""
            if not cell:
                continue
            try:
                out.setdefault(name, []).append((step, float(cell)))
            except ValueError:
                bad += 1
    if bad:
        problems.append(f"{display(path)}: {bad} cell(s) or row(s) that are not numbers were skipped")
    for series in out.values():
        series.sort(key=lambda p: p[0])
    return out
