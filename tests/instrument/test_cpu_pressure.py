"""The CPU pressure reader: the kernel's cumulative ``some`` stall time, or ``None`` where there is none."""

from __future__ import annotations

import pytest

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


def test_other_cpu_is_the_machines_busy_time_less_this_process_tree(tmp_path):
    import os

    from lightning_diag.instrument.cpu_pressure import OtherCpu

    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal (ticks): busy = everything but idle and iowait
    stat.write_text("cpu  1000 10 200 5000 300 5 7 20 0 0\ncpu0 500 5 100 2500 150 2 3 10 0 0\n")
    reader = OtherCpu(str(stat))
    tick = os.sysconf("SC_CLK_TCK")
    assert reader.machine_busy() == (1000 + 10 + 200 + 5 + 7 + 20) / tick
    value = reader.read()
    assert value is not None and value == pytest.approx(reader.machine_busy() - reader.tree_seconds(), abs=0.05)


def test_other_cpu_counts_a_busy_child_as_the_runs_own():
    import multiprocessing
    import time

    from lightning_diag.instrument.cpu_pressure import OtherCpu

    reader = OtherCpu()
    if reader.read() is None:
        pytest.skip("this system keeps no /proc/stat")  # macOS, Windows: the reader says None (tested above)
    before_tree = reader.tree_seconds()
    child = multiprocessing.get_context("fork").Process(target=_spin, args=(0.5,))
    child.start()
    deadline, alive = time.monotonic() + 10.0, 0.0
    while alive <= 0.1 and child.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = reader.tree_seconds() - before_tree  # the live child's CPU time, read from its stat
    child.join()
    done = reader.tree_seconds() - before_tree  # the finished child's, from RUSAGE_CHILDREN
    assert alive > 0.1 and done >= 0.4


def test_a_missing_or_malformed_stat_is_not_known_and_not_tried_again(tmp_path):
    from lightning_diag.instrument.cpu_pressure import OtherCpu

    assert OtherCpu(str(tmp_path / "absent")).read() is None
    stat = tmp_path / "stat"
    stat.write_text("intr 5 6 7\n")
    reader = OtherCpu(str(stat))
    assert reader.read() is None
    stat.write_text("cpu  1 2 3 4 5 6 7 8\n")
    assert reader.read() is None


def _spin(seconds: float) -> None:
    import time

    end = time.process_time() + seconds  # CPU time: the same work on a busy machine
    while time.process_time() < end:
        pass
