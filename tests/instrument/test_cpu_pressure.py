"""The CPU pressure reader: the kernel's cumulative ``some`` stall time, or ``None`` where there is none."""

from __future__ import annotations

from lightning_diag.instrument.clocks import TimeSource
from lightning_diag.instrument.cpu_pressure import CpuPressure


def test_reads_the_some_total_in_seconds(tmp_path):
    path = tmp_path / "cpu"
    path.write_text(
        "some avg10=0.50 avg60=1.00 avg300=2.00 total=1234567\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    )
    reader = CpuPressure(str(path))
    assert reader.read() == 1.234567
    path.write_text("some avg10=0.50 avg60=1.00 avg300=2.00 total=2234567\n")
    assert reader.read() == 2.234567  # read afresh each time


def test_a_missing_or_unreadable_file_is_not_known_and_not_tried_again(tmp_path):
    assert CpuPressure(str(tmp_path / "absent")).read() is None
    path = tmp_path / "cpu"
    path.write_text("full total=5\n")
    reader = CpuPressure(str(path))
    assert reader.read() is None
    path.write_text("some avg10=0.50 total=1000000\n")
    assert reader.read() is None  # a system without pressure stays without it


def test_the_time_source_reads_a_pressure_that_never_falls():
    source = TimeSource()
    first, second = source.pressure(), source.pressure()
    assert (first is None) == (second is None)
    if first is not None and second is not None:
        assert second >= first >= 0
