"""kvtierd.ops.takeover's probe of the daemon to replace: only a live socket of this
uid served by a process of this uid; anything else is refused or is nothing."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from kvtierd.errors import StartupError
from kvtierd.ops.takeover import find_running_daemon


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
