"""Reading the ``diag/`` scalars (and a few of the user's) of TensorBoard event files for ``lightning-diag report``.

Each file is streamed record by record (TFRecord framing, each record checked against its CRC-32C, parsed with
TensorBoard's own ``Event`` protobuf), keeping only ``diag/`` tags, the ``diag/thresholds`` texts, the count of the
``diag/alerts`` table, the marker of a custom-scalars dashboard layout, and the user's scalars the caller asks for
(the losses, learning rates and epoch a plain run is judged on), so a run's memory is that of its diagnostics and
losses, whatever else (the user's other metrics, images, histograms) its event files hold. Each file is read on its
own (:func:`read_event_files`); :func:`split_fits` groups the files of a folder into fits and :func:`merge_files`
joins a fit's files. What cannot be read is said in the caller's ``problems``, never raised for a damaged record.
Imports neither torch nor Lightning.
"""

from __future__ import annotations

import dataclasses
import os
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from lightning_diag.core.tags import ALERTS_TAG
from lightning_diag.report.safe_read import open_regular
from lightning_diag.report.text import clean, display

__all__ = [
    "EVENT_PREFIX",
    "EventData",
    "EventFile",
    "Series",
    "TagFilter",
    "is_event_file",
    "merge_files",
    "read_event_files",
    "split_fits",
    "written_order",
]

#: How the name of every TensorBoard event file starts.
EVENT_PREFIX = "events.out.tfevents"
_LAYOUT_TAG = "custom_scalars__config__"
#: The head of the alert table the library writes under ``diag/alerts`` at each alert (the fit's count so far).
_NUMBERS = re.compile(r"(\d+)")
_ALERT_COUNT = re.compile(r"^\*\*(\d+) alerts?, newest first\*\*")

Series = list[tuple[int, float]]
#: Which tags outside ``diag/`` to keep (a plain run's losses, learning rates, epoch): name -> keep it.
TagFilter = Callable[[str], bool]


def _diag_only(name: str) -> bool:
    return False


@dataclasses.dataclass
class EventData:
    """What the event files of a run's folders hold for the report.

    Attributes:
        scalars: ``diag/`` scalar tag -> ``(step, value)`` points in step order.
        texts: ``(tag, text)`` of each ``diag/thresholds`` text entry, in file order.
        has_layout: Whether the files hold a custom-scalars dashboard layout.
        user: The user's own scalars the caller asked for (``keep``), tag -> points in step order.
        alert_count: The alerts the fit wrote, from its last ``diag/alerts`` table (``None``: no table).
    """

    scalars: dict[str, Series] = dataclasses.field(default_factory=dict)
    texts: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    has_layout: bool = False
    user: dict[str, Series] = dataclasses.field(default_factory=dict)
    alert_count: int | None = None


@dataclasses.dataclass
class EventFile:
    """One event file's points, as read (each series in step order).

    Attributes:
        path: The file.
        data: Its ``diag/`` scalars, texts, layout marker, kept user scalars and alert count.
    """

    path: Path
    data: EventData

    @property
    def order(self) -> tuple[tuple[int, str], ...]:
        """Sort key: the order the files were written in (:func:`written_order`), across folders too."""
        return written_order(self.path.name)


def is_event_file(name: str) -> bool:
    """Whether a file name is that of a TensorBoard event file."""
    return name.startswith(EVENT_PREFIX)


def written_order(name: str) -> tuple[tuple[int, str], ...]:
    """Sort key of event-file names in the order they were created: ``events.out.tfevents.<time>.<host>.<pid>.
    <counter><suffix>`` with its numbers compared as numbers (counter 10 after 9, which name order puts first).

    Example:
        >>> names = ["events.out.tfevents.1700000000.h.7.10", "events.out.tfevents.1700000000.h.7.9"]
        >>> [n.rsplit(".", 1)[-1] for n in sorted(names, key=written_order)]
        ['9', '10']
    """
    return tuple((int(part), "") if part.isdigit() else (-1, part) for part in _NUMBERS.split(name))


def read_event_files(directory: Path, problems: list[str], keep: TagFilter = _diag_only) -> list[EventFile]:
    """Every event file of ``directory``, in the order written; one that cannot be opened is skipped and said.

    Args:
        directory: The folder.
        problems: Where what cannot be read is said.
        keep: Which tags outside ``diag/`` to keep (the user's scalars a plain run is judged on).
    """
    files: list[EventFile] = []
    for path in sorted((p for p in directory.iterdir() if is_event_file(p.name)), key=lambda p: written_order(p.name)):
        try:
            fh = open_regular(path)
        except OSError as err:
            problems.append(f"{display(path)}: skipped: {clean(err)}")
            continue
        data = EventData()
        with fh:
            _read_event_file(fh, path, data, problems, keep)
        for series in (*data.scalars.values(), *data.user.values()):
            series.sort(key=lambda p: p[0])
        files.append(EventFile(path, data))
    return files


def split_fits(files: list[EventFile]) -> list[list[EventFile]]:
    """Group event files (in the order written) into fits.

    A file starts a new fit when it shares a series with the current fit and its earliest step is at or before
    the current fit's earliest step: the steps went back to the beginning (two fits logged into one folder, one
    after the other or side by side). A file that starts later, even inside the steps already held, continues the
    fit (a resume from a checkpoint, or a second ``trainer.fit`` that continues the step axis);
    :func:`merge_files` then applies TensorBoard's rule to it.
    """
    fits: list[list[EventFile]] = []
    names: set[str] = set()
    start = 0
    for f in files:
        series = {name: s for name, s in (*f.data.scalars.items(), *f.data.user.items()) if s}
        first = min((s[0][0] for s in series.values()), default=None)
        if fits and first is not None and names & set(series) and first <= start:
            fits.append([f])
            names, start = set(series), first
            continue
        if not fits:
            fits.append([])
        if first is not None:
            start = first if not names else min(start, first)
        fits[-1].append(f)
        names |= set(series)
    return fits or [[]]


def merge_files(files: list[EventFile], problems: list[str]) -> EventData:
    """One fit's files merged in order: a file whose series start inside the steps the earlier files hold (a
    resume from an earlier checkpoint) replaces their points from that step on, as TensorBoard does, said once per
    file in ``problems``; the alert counts of the files add up."""
    out = EventData()
    counts = [f.data.alert_count for f in files if f.data.alert_count is not None]
    out.alert_count = sum(counts) if counts else None
    for f in files:
        restart = _append(out.scalars, f.data.scalars)
        user_restart = _append(out.user, f.data.user)
        if restart is None:
            restart = user_restart
        out.texts += f.data.texts
        out.has_layout = out.has_layout or f.data.has_layout
        if restart is not None:
            problems.append(
                f"{display(f.path)}: a resume logged into the same folder, restarting at step {restart}: the "
                "earlier files' points from that step on are left out, as TensorBoard does"
            )
    return out


def _read_event_file(fh: BinaryIO, path: Path, found: EventData, problems: list[str], keep: TagFilter) -> None:
    """Add the ``diag/`` points (and those of the kept user tags) of one open event file to ``found``, with its
    ``diag/thresholds`` texts, layout marker and alert count."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.util import tensor_util

    not_events = 0
    for record in _records(fh, path, problems):
        try:
            event = Event.FromString(record)
        except Exception:  # a record whose checksum matched but that is no event
            not_events += 1
            continue
        if not event.HasField("summary"):
            continue
        step = int(event.step)
        for value in event.summary.value:
            name = value.tag
            if name == _LAYOUT_TAG:
                found.has_layout = True
                continue
            if name.startswith("diag/"):
                points = found.scalars
            elif keep(name):
                points = found.user
            else:
                continue
            kind = value.WhichOneof("value")
            if kind == "simple_value":
                points.setdefault(name, []).append((step, float(value.simple_value)))
            elif kind == "tensor":
                if value.tensor.string_val:
                    if name.startswith("diag/thresholds"):
                        found.texts += [(name, raw.decode("utf-8", "replace")) for raw in value.tensor.string_val]
                    elif name.startswith(ALERTS_TAG + "/") or name == ALERTS_TAG:
                        match = _ALERT_COUNT.match(value.tensor.string_val[0].decode("utf-8", "replace"))
                        if match:
                            found.alert_count = max(found.alert_count or 0, int(match.group(1)))
                    continue
                array = tensor_util.make_ndarray(value.tensor)
                if array.size == 1:
                    points.setdefault(name, []).append((step, float(array.reshape(-1)[0])))
    if not_events:
        problems.append(f"{display(path)}: {not_events} record(s) that are not events were skipped")


def _append(held: dict[str, Series], points: dict[str, Series]) -> int | None:
    """Add one file's points to those of the earlier files of its fit; the step a series restarted at (the
    earlier points from there on dropped), or ``None``."""
    restart: int | None = None
    for name, series in points.items():
        before = held.get(name, [])
        if before and series and series[0][0] <= before[-1][0]:
            first = series[0][0]
            restart = first if restart is None else min(restart, first)
            before = [p for p in before if p[0] < first]
        held[name] = before + series
    return restart


def _masked_crc32c() -> Callable[[bytes], int]:
    """TensorBoard's masked CRC-32C: computed in C by ``google_crc32c`` where it is installed (a run's worth of
    records in microseconds), else TensorBoard's own pure-Python one (the same numbers, about 50x slower)."""
    try:
        import google_crc32c  # optional: the report does not need it
    except ImportError:
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

        return masked_crc32c
    value = google_crc32c.value

    def masked(data: bytes) -> int:
        crc = value(data)
        return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    return masked


def _records(fh: BinaryIO, path: Path, problems: list[str]) -> Iterator[bytes]:
    """The records of a TFRecord event file, each checked against its CRC-32C.

    A record whose data fails its checksum (a flipped byte) is skipped and the reading goes on; a damaged
    length ends the file; each is said in ``problems``. A torn last record (a run killed mid-write, or still
    writing) ends the file silently, as in TensorBoard.
    """
    masked_crc32c = _masked_crc32c()
    size = os.fstat(fh.fileno()).st_size
    pos, damaged = 0, 0
    while True:
        head = fh.read(12)
        if len(head) < 12:
            break  # the end, or a torn last record
        header = head[:8]
        (length,) = struct.unpack("<Q", header)
        if struct.unpack("<I", head[8:])[0] != masked_crc32c(header):
            problems.append(
                f"{display(path)}: damaged at byte {pos} (a record length fails its checksum): the "
                f"{size - pos} bytes from there on are left out"
            )
            break
        if pos + 12 + length + 4 > size:
            break  # torn last record
        record = fh.read(length)
        crc = fh.read(4)
        pos += 12 + length + 4
        if len(record) < length or len(crc) < 4:
            break
        if struct.unpack("<I", crc)[0] != masked_crc32c(record):
            damaged += 1
            continue
        yield record
    if damaged:
        problems.append(f"{display(path)}: {damaged} damaged record(s) (checksum mismatch) left out")
