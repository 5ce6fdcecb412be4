"""kvtierd.ops.takeover's probe of the daemon to replace: only a live socket of this
uid served by a process of this uid; anything else is refused or is nothing."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvtierd.errors import StartupError
from kvtierd.ops.takeover import find_running_daemon, waited_for


def test_nothing_at_the_path_or_a_stale_socket_is_nothing_to_replace(tmp_path: Path):
    path = str(tmp_path / "k.sock")
    assert find_running_daemon(path) is None
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)  # bound, never listening: a crashed daemon's file
    stale.close()
    assert find_running_daemon(path) is None


def test_a_live_socket_of_this_process_names_this_process(tmp_path: Path):
    path = str(tmp_path / "k.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(4)
        found = find_running_daemon(path)
        assert found is not None and found.pid == os.getpid()
        os.close(found.pidfd)


@pytest.mark.parametrize("kind", ["regular file", "symlink"])
def test_a_planted_file_at_the_path_is_refused_not_followed(tmp_path: Path, kind: str):
    target = tmp_path / "real.sock"
    path = tmp_path / "k.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(target))
        listener.listen(4)
        if kind == "symlink":
            path.symlink_to(target)
        else:
            path.write_text("")
        with pytest.raises(StartupError, match="is not a socket .*not replaced"):
            find_running_daemon(str(path))


# Holds a pidfd of the pid in argv[1] (0: of a child of its own) until its stdin ends.
_WAITER = """
import os, subprocess, sys
pid = int(sys.argv[1])
child = None
if pid == 0:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    pid = child.pid
fd = os.pidfd_open(pid)
print("holding", flush=True)
sys.stdin.read()
if child is not None:
    child.stdin.close()
    child.wait()
"""


def _waiter(pid: int) -> subprocess.Popen[str]:
    waiter = subprocess.Popen(
        [sys.executable, "-c", _WAITER, str(pid)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert waiter.stdout is not None and waiter.stdout.readline() == "holding\n"
    return waiter


def test_a_process_holding_a_pidfd_of_a_live_non_child_waits_for_it():
    """What a daemon that took another over looks like from outside (the chain a
    takeover refuses): the pid its pidfd names while that process lives, then
    none; a pidfd of its own child (a worker) is not a predecessor."""
    predecessor = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    waiter = _waiter(predecessor.pid)
    parent = _waiter(0)
    try:
        assert waited_for(waiter.pid) == predecessor.pid
        assert waited_for(parent.pid) is None
        predecessor.communicate()
        assert waited_for(waiter.pid) is None
        assert waited_for(os.getpid()) is None
    finally:
        for process in (predecessor, waiter, parent):
            process.communicate()
