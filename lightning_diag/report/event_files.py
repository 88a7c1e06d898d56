"""Reading the ``diag/`` scalars of TensorBoard event files for ``lightning-diag report``.

Each file is streamed record by record (TFRecord framing, each record checked against its CRC-32C, parsed with
TensorBoard's own ``Event`` protobuf), keeping only ``diag/`` tags, the ``diag/thresholds`` texts and the marker of
a custom-scalars dashboard layout, so a run's memory is that of its diagnostics, whatever else (the user's metrics,
images, histograms) its event files hold. What cannot be read is said in the caller's ``problems``, never raised
for a damaged record. Imports neither torch nor Lightning.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from lightning_diag.report.safe_read import open_regular
from lightning_diag.report.text import clean, display

__all__ = ["EVENT_PREFIX", "EventData", "Series", "is_event_file", "read_events"]

#: How the name of every TensorBoard event file starts.
EVENT_PREFIX = "events.out.tfevents"
_LAYOUT_TAG = "custom_scalars__config__"

Series = list[tuple[int, float]]


@dataclasses.dataclass
class EventData:
    """What the event files of a run's folders hold for the report.

    Attributes:
        scalars: ``diag/`` scalar tag -> ``(step, value)`` points in step order.
        texts: ``(tag, text)`` of each ``diag/thresholds`` text entry, in file order.
        has_layout: Whether the files hold a custom-scalars dashboard layout.
    """

    scalars: dict[str, Series] = dataclasses.field(default_factory=dict)
    texts: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    has_layout: bool = False


def is_event_file(name: str) -> bool:
    """Whether a file name is that of a TensorBoard event file."""
    return name.startswith(EVENT_PREFIX)


def read_events(directory: Path, found: EventData, problems: list[str]) -> None:
    """Add the ``diag/`` scalars and thresholds texts of the event files in ``directory`` to ``found``.

    The files are read in name order; a file that cannot be opened is skipped and said in ``problems``. Points
    of a folder are added to ``found`` (and its texts) once all its files are read.
    """
    held: dict[str, Series] = {}
    texts: list[tuple[str, str]] = []
    for path in sorted(p for p in directory.iterdir() if is_event_file(p.name)):
        points: dict[str, Series] = {}
        try:
            fh = open_regular(path)
        except OSError as err:
            problems.append(f"{display(path)}: skipped: {clean(err)}")
            continue
        with fh:
            texts += _read_event_file(fh, path, found, points, problems)
        _append_file(held, points, path, problems)
    for name, series in held.items():
        found.scalars[name] = sorted(found.scalars.get(name, []) + series, key=lambda p: p[0])
    found.texts += texts


def _read_event_file(
    fh: BinaryIO, path: Path, found: EventData, points: dict[str, Series], problems: list[str]
) -> list[tuple[str, str]]:
    """Add the ``diag/`` points of one open event file to ``points``; return its ``diag/thresholds`` texts."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.util import tensor_util

    texts: list[tuple[str, str]] = []
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
            if not name.startswith("diag/"):
                continue
            kind = value.WhichOneof("value")
            if kind == "simple_value":
                points.setdefault(name, []).append((step, float(value.simple_value)))
            elif kind == "tensor":
                if value.tensor.string_val:
                    if name.startswith("diag/thresholds"):
                        texts += [(name, raw.decode("utf-8", "replace")) for raw in value.tensor.string_val]
                    continue
                array = tensor_util.make_ndarray(value.tensor)
                if array.size == 1:
                    points.setdefault(name, []).append((step, float(array.reshape(-1)[0])))
    if not_events:
        problems.append(f"{display(path)}: {not_events} record(s) that are not events were skipped")
    return texts


def _append_file(held: dict[str, Series], points: dict[str, Series], path: Path, problems: list[str]) -> None:
    """Add one event file's points to those of the earlier files of its folder.

    A file whose series start at or before a step the earlier files already hold is a new fit (two fits logged
    into one ``diag/`` folder, or a resume from an earlier checkpoint): as TensorBoard does, the earlier
    points from that step on are dropped, so no point is counted twice. Said once per file in ``problems``.
    """
    restart: int | None = None
    for name, series in points.items():
        series.sort(key=lambda p: p[0])
        before = held.get(name, [])
        if before and series and series[0][0] <= before[-1][0]:
            first = series[0][0]
            restart = first if restart is None else min(restart, first)
            before = [p for p in before if p[0] < first]
        held[name] = before + series
    if restart is not None:
        problems.append(
            f"{display(path)}: a second fit (or a resume) logged into the same folder, restarting at step "
            f"{restart}: the earlier files' points from that step on are left out, as TensorBoard does"
        )


def _records(fh: BinaryIO, path: Path, problems: list[str]) -> Iterator[bytes]:
    """The records of a TFRecord event file, each checked against its CRC-32C.

    A record whose data fails its checksum (a flipped byte) is skipped and the reading goes on; a damaged
    length ends the file; each is said in ``problems``. A torn last record (a run killed mid-write, or still
    writing) ends the file silently, as in TensorBoard.
    """
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

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
