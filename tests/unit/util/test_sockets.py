"""kvtierd.util.sockets: staged sockets published over their paths in one rename,
all or none, at names nobody can plant ahead, and a process's stop removing only
the socket files that are still its own."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import pytest

from kvtierd.util.sockets import PublishError, SocketPlacement


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


def test_staged_and_keep_names_are_random_never_the_pid(tmp_path: Path):
    """The names were ``.NAME.staged-PID`` and ``.NAME.keep-PID``: another user could
    plant a file at each for every pid (issue #40)."""
    path = str(tmp_path / "k.sock")
    first, second = SocketPlacement(takeover=True), SocketPlacement(takeover=True)
    socks = [_listen(first, path), _listen(second, path)]
    try:
        names = {first.bound[0].bound_at, second.bound[0].bound_at}
        assert len(names) == 2
        for name in names:
            assert re.fullmatch(r"\.k\.sock\.staged-[0-9a-f]{16}", os.path.basename(name))
        first.publish()
        (keep,) = set(os.listdir(tmp_path)) - {"k.sock", os.path.basename(second.bound[0].bound_at)}
        assert re.fullmatch(r"\.k\.sock\.keep-[0-9a-f]{16}", keep)
    finally:
        for sock in socks:
            sock.close()


def test_publish_refuses_a_path_holding_anything_but_a_socket_and_creates_nothing(
    tmp_path: Path,
):
    """The old process serves a.sock; a symlink is planted at b.sock (to a.sock). The
    takeover used to rename a.sock over the old socket first; it checks every path
    before the first rename now: nothing renamed, linked or removed."""
    a, b = str(tmp_path / "a.sock"), str(tmp_path / "b.sock")
    old = SocketPlacement(staged=True)
    old_sock = _listen(old, a)
    old.publish()
    os.symlink(a, b)
    new = SocketPlacement(takeover=True)
    socks = [_listen(new, a), _listen(new, b)]
    try:
        before = sorted(os.listdir(tmp_path))
        with pytest.raises(PublishError, match=f"{b} is a symlink to '{a}'.*not a socket"):
            new.publish()
        assert sorted(os.listdir(tmp_path)) == before
        assert old.bound[0].is_at(a) and os.path.islink(b)
        new.remove_own()
        assert sorted(os.listdir(tmp_path)) == ["a.sock", "b.sock"]
    finally:
        old_sock.close()
        for sock in socks:
            sock.close()


def test_a_rename_failing_half_way_puts_the_replaced_sockets_back(tmp_path: Path):
    """Between the checks and the renames the second path becomes a directory (a
    race): the first socket was already renamed over the old one; the old one is
    renamed back, so the process serving it stays reachable."""
    a, b = str(tmp_path / "a.sock"), str(tmp_path / "b.sock")
    old = SocketPlacement(staged=True)
    old_socks = [_listen(old, a), _listen(old, b)]
    old.publish()
    new = SocketPlacement(takeover=True)
    socks = [_listen(new, a), _listen(new, b)]
    try:
        moves = new.prepare()
        os.unlink(b)
        os.mkdir(b)
        with pytest.raises(PublishError, match=f"at {b}: Is a directory.*were put back"):
            new.commit(moves)
        assert old.bound[0].is_at(a)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(a)
            accepted, _ = old_socks[0].accept()  # the old listener's
            accepted.close()
        new.remove_own()
        assert sorted(os.listdir(tmp_path)) == ["a.sock", "b.sock"]
    finally:
        for sock in old_socks + socks:
            sock.close()


def test_restore_never_replaces_a_socket_another_process_put_at_the_path(tmp_path: Path):
    """B took over, then C took B over: when B's predecessor exits, B's restore
    finds C's socket at the path and leaves it (it used to rename its own back)."""
    path = str(tmp_path / "k.sock")
    b = SocketPlacement(takeover=True)
    b_sock = _listen(b, path)
    b.publish()
    c = SocketPlacement(takeover=True)
    c_sock = _listen(c, path)
    try:
        c.publish()
        assert b.restore() == []
        assert c.bound[0].is_at(path)
    finally:
        b_sock.close()
        c_sock.close()
