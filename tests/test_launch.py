"""tests/launch.py: the suite's multi-process launches get a reserved port, their own session, and leave nothing
running when they time out, fail or are interrupted (issue 46)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests import launch

# A leader that forks a child (a "rank" of its own), says both pids, and then both hang: what a rank waiting at a
# rendezvous looks like from outside. `-S`: no site import, so the pids are written well within the timeout.
HANG = """
import os, sys, time
child = os.fork()
if child == 0:
    time.sleep(600)
    os._exit(0)
with open(sys.argv[1], "w") as fh:
    fh.write(f"{os.getpid()} {child}")
print("started", flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _gone(pids: list[int], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(_alive(p) for p in pids)


def _pids(path: Path, within: float = 10.0) -> list[int]:
    deadline = time.monotonic() + within
    while not (path.exists() and path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [int(x) for x in path.read_text().split()]


def test_a_hanging_group_is_killed_with_its_children_when_the_timeout_fires(tmp_path):
    pidfile = tmp_path / "pids"
    with pytest.raises(subprocess.TimeoutExpired) as info:
        launch.run([sys.executable, "-S", "-c", HANG, str(pidfile)], timeout=5)
    assert "started" in info.value.stdout  # the output so far comes with the timeout
    leader, child = _pids(pidfile)
    assert _gone([leader, child]), "a process of the timed-out group is still alive"
    assert leader not in launch.leftovers()


def test_an_interrupted_wait_kills_the_group(tmp_path):
    """pytest-timeout's signal method and Ctrl-C both raise out of the wait: the group goes with them."""
    pidfile = tmp_path / "pids"

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGUSR1, interrupt)
    timer = threading.Timer(0.2, lambda: _pids(pidfile) and os.kill(os.getpid(), signal.SIGUSR1))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            launch.run([sys.executable, "-S", "-c", HANG, str(pidfile)], timeout=120)
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, before)
    assert _gone(_pids(pidfile))


def test_a_group_that_ends_its_leader_loses_its_other_ranks_too(tmp_path):
    """Rank zero exits (crashed or done) while a rank it started still waits: the launcher kills the waiting one."""
    pidfile = tmp_path / "pids"
    code = HANG.replace('print("started", flush=True)\ntime.sleep(600)', 'print("started", flush=True)')
    start = time.monotonic()
    done = launch.run([sys.executable, "-S", "-c", code, str(pidfile)], timeout=60, grace=1)
    assert time.monotonic() - start < 30  # the grace after the leader's exit, not the timeout
    assert done.returncode == 0 and done.stdout == "started\n" and "after the leader exited were killed" in done.stderr
    assert _gone(_pids(pidfile))


def test_leftovers_names_a_live_group_until_its_block_ends(tmp_path):
    pidfile = tmp_path / "pids"
    with launch.started([sys.executable, "-S", "-c", HANG, str(pidfile)]) as proc:
        pids = _pids(pidfile)
        assert sorted(launch.leftovers()[proc.pid]) == sorted(pids)
        assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0)  # a session and group of its own
    assert proc.pid not in launch.leftovers() and _gone(pids)


def test_the_launch_environment_names_a_reserved_port(tmp_path):
    code = "import os; print(os.environ['MASTER_ADDR'], os.environ['MASTER_PORT'])"
    first = launch.run([sys.executable, "-S", "-c", code], timeout=60).stdout.split()
    second = launch.run([sys.executable, "-S", "-c", code], timeout=60).stdout.split()
    assert first[0] == "127.0.0.1" and first[1] != second[1]


def test_a_reserved_port_is_refused_to_a_plain_bind_and_taken_by_a_reusing_listener():
    port = launch.reserve_port()
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # what Lightning's own port choice (bind, close) would need
    with socket.socket() as store:  # what torch's TCPStore does
        store.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        store.bind(("127.0.0.1", port))
        store.listen(1)
