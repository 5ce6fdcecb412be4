"""kvtierd.util.sockets: staged sockets published over their paths in one rename,
and a process's stop removing only the socket files that are still its own."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from kvtierd.util.sockets import SocketPlacement


def _listen(placement: SocketPlacement, path: str) -> socket.socket:
    at = placement.bind_name(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(at)
    sock.listen(8)
    placement.record(path, at)
    return sock


def _peer_port(path: str) -> object:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.connect(path)
        return probe.getpeername()


def test_a_staged_socket_is_bound_aside_and_published_over_the_path(tmp_path: Path):
    path = str(tmp_path / "k.sock")
    placement = SocketPlacement(staged=True)
    sock = _listen(placement, path)
    try:
        assert not os.path.exists(path)  # nothing at the path before publish
        placement.publish()
        assert os.listdir(tmp_path) == ["k.sock"]
        _peer_port(path)  # accepts at the path
    finally:
        sock.close()


def test_stop_removes_only_the_sockets_still_its_own(tmp_path: Path):
    """A daemon that took over renamed its socket over the path: the old one's stop
    leaves it there."""
    path = str(tmp_path / "k.sock")
    old = SocketPlacement(staged=True)
    old_sock = _listen(old, path)
    old.publish()
    new = SocketPlacement(takeover=True)
    new_sock = _listen(new, path)
    try:
        new.publish()
        old.remove_own()
        assert new.bound[0].is_at(path)
        _peer_port(path)
        new.forget_links()
        new.remove_own()
        assert os.listdir(tmp_path) == []
    finally:
        old_sock.close()
        new_sock.close()


def test_a_takeover_puts_back_a_path_the_replaced_process_removed(tmp_path: Path):
    """An old daemon that removes its paths whatever is there (one bound at the path):
    restore() puts the new socket back, the same file."""
    path = str(tmp_path / "k.sock")
    new = SocketPlacement(takeover=True)
    sock = _listen(new, path)
    try:
        new.publish()
        os.unlink(path)  # the old daemon's blind removal
        assert new.restore() == [path]
        assert new.bound[0].is_at(path)
        _peer_port(path)
        new.forget_links()
        assert os.listdir(tmp_path) == ["k.sock"]
    finally:
        sock.close()
