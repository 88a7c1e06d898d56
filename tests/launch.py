"""How the suite launches its multi-process runs (DDP, ``ddp_spawn``, FSDP2/TP, gloo scripts): every launcher in
``tests/`` goes through :func:`run` or :func:`started`.

* **Ports.** Lightning's DDP and ``ModelParallelStrategy`` meet at an ``env://`` rendezvous (``MASTER_ADDR`` and
  ``MASTER_PORT``, a TCPStore on rank zero); they take no ``file://`` store. Lightning's own choice of port (bind
  to port 0, close, hand the number on) races with every other process on the machine. :func:`reserve_port`
  instead leaves the port it hands out in TIME_WAIT, so that the kernel gives it to no other ``bind(("", 0))``
  for a minute (another test's launch, another suite on the machine), while torch's TCPStore, which listens with
  ``SO_REUSEADDR``, binds it at once. The scripts that call ``init_process_group`` themselves use a ``file://``
  store in ``tmp_path`` and need no port at all.
* **Process groups.** Each launched command starts its own session (``start_new_session=True``): the script,
  the ranks Lightning starts from it and their workers share one process group. On a timeout, on any exception
  while waiting (pytest-timeout's signal, ``KeyboardInterrupt``, a failed assertion in a ``with`` block) and after
  a normal exit, the whole group is killed (SIGKILL), so a rank that outlived rank zero cannot wait at the
  rendezvous for the rest of the day.
* **Nothing left.** Every group started is remembered; :func:`leftovers` names any process still alive in one of
  them (``tests/conftest.py`` checks it at the end of the session) and :func:`kill_all` ends them.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

__all__ = ["LAUNCHED", "kill_all", "kill_group", "leftovers", "members", "reserve_port", "run", "started"]

#: ``{process-group id (the leader's pid): the leader's start time}`` of every group this process launched. The
#: start time tells our group from a later one whose leader was given the same pid after ours was gone.
LAUNCHED: dict[int, str] = {}


def reserve_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` for ``MASTER_PORT`` that no other ``bind`` to port 0 is handed for about a minute.

    The port is bound with ``SO_REUSEADDR``, listened on, connected to and accepted; the accepted side is closed
    first, so it is that side (local port = the port) that waits in TIME_WAIT.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((host, 0))
        server.listen(1)
        port = int(server.getsockname()[1])
        with socket.create_connection((host, port)) as client:
            accepted, _ = server.accept()
            accepted.close()  # this end closes first: TIME_WAIT holds the port
            client.recv(1)  # wait for the FIN, so that the close completes before the client's
    return port


def _env(env: Mapping[str, str] | None) -> dict[str, str]:
    out = dict(os.environ if env is None else env)
    out["MASTER_ADDR"] = "127.0.0.1"
    out["MASTER_PORT"] = str(reserve_port())
    return out


def _stat(pid: int | str) -> tuple[str, int, str] | None:
    """(state, process group, start time) of process ``pid``, or ``None`` once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ..., starttime (field 22)
    return fields[0], int(fields[2]), fields[19]


def members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid`` (without ``/proc``: ``[pgid]`` while the group has
    any process, zombies included)."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            got = _stat(entry)
            if got is not None and got[1] == pgid and got[0] != "Z":
                out.append(int(entry))
    return out


def _ours(pgid: int) -> bool:
    """Whether group ``pgid`` is still the one launched: no process holds its number as a different leader (a
    pid stays reserved while any process is in the group it leads, so leaderless members are ours)."""
    leader = _stat(pgid)
    return leader is None or leader[2] == LAUNCHED.get(pgid)


def _killpg(pgid: int) -> None:
    if _ours(pgid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL every process of ``proc``'s group (its own session), then reap ``proc``."""
    _killpg(proc.pid)
    proc.wait()


def run(
    args: Sequence[str],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    grace: float = 30.0,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(args, capture_output=True, text=True, timeout=timeout)`` in a session of its own, with a
    reserved ``MASTER_PORT``; its whole process group is killed when it ends, times out or the wait is interrupted.

    The other ranks share the leader's output pipes: once the leader has exited, they get ``grace`` seconds to
    finish (write their results) and close them, then the group is killed, rather than waiting for the timeout.

    Raises:
        subprocess.TimeoutExpired: After ``timeout`` seconds (the group already killed), with the output so far.
    """
    deadline = time.monotonic() + timeout
    leader_done: float | None = None
    note = ""
    with started(args, env=env, cwd=cwd) as proc:
        while True:
            try:
                out, err = proc.communicate(timeout=max(0.01, min(1.0, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if leader_done is None and proc.poll() is not None:
                    leader_done = now
                if leader_done is not None and now - leader_done >= grace:
                    kill_group(proc)
                    out, err = proc.communicate()
                    note = f"\nlaunch: processes still running {grace:g} s after the leader exited were killed\n"
                    break
                if now >= deadline:
                    kill_group(proc)
                    out, err = proc.communicate()
                    raise subprocess.TimeoutExpired(list(args), timeout, out, err) from None
    return subprocess.CompletedProcess(list(args), proc.returncode, out, err + note)


@contextlib.contextmanager
def started(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    capture: bool = True,
) -> Iterator[subprocess.Popen[str]]:
    """Start ``args`` in a session of its own (``MASTER_ADDR``/``MASTER_PORT`` set, output piped unless
    ``capture=False``); on leaving the block, however it is left, kill its whole process group."""
    pipe = subprocess.PIPE if capture else subprocess.DEVNULL
    proc = subprocess.Popen(
        list(args), stdout=pipe, stderr=pipe, text=True, env=_env(env), cwd=cwd, start_new_session=True
    )
    got = _stat(proc.pid)
    LAUNCHED[proc.pid] = got[2] if got is not None else ""
    try:
        yield proc
    finally:
        kill_group(proc)  # a rank that outlived the leader, a worker, a grandchild: none survives the block


def leftovers() -> dict[int, list[int]]:
    """``{process group: its live processes}`` for every launched group that still has one."""
    return {pgid: pids for pgid in sorted(LAUNCHED) if _ours(pgid) and (pids := members(pgid))}


def kill_all() -> None:
    """SIGKILL every launched group that still has a live process."""
    for pgid in leftovers():
        _killpg(pgid)


atexit.register(kill_all)  # pytest ending early (-x, an internal error) takes the groups with it
