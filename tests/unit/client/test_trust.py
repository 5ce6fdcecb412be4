"""Who can be the daemon (kvtierd_client.wire.trust, _rpc.trusted_daemon and the region's
owner check), on real directories, files and sockets owned by real other uids."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Iterator

import pytest

from kvtierd_client._rpc.trusted_daemon import DaemonCheck
from kvtierd_client.errors import UntrustedAddress
from kvtierd_client.region import attach_region
from kvtierd_client.wire import trust
from kvtierd_client.wire.proto import pb2

OTHER = 65534  # nobody
TRUSTED = frozenset({0, os.geteuid()})


@pytest.fixture
def base() -> Iterator[str]:
    """A fresh directory of root's in /tmp (sticky), 0755."""
    if os.geteuid() != 0:
        pytest.skip("needs root: gives files to other uids")
    path = tempfile.mkdtemp(prefix="kvt-trust-", dir="/tmp")
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _socket_at(path: str, uid: int = 0) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(1)
    os.lchown(path, uid, uid)
    return listener


def _dir(path: str, mode: int, uid: int = 0) -> str:
    os.mkdir(path)
    os.chmod(path, mode)
    os.chown(path, uid, uid)
    return path


def test_a_socket_in_directories_only_their_owners_write_is_placed_by_delegation(base):
    """root's 0755 directory holds one given to another user: that user's socket there
    names its daemon, with nothing configured (the systemd layout: /run/kvtierd)."""
    run = _dir(os.path.join(base, "run"), 0o750, OTHER)
    path = os.path.join(run, "kvtierd.sock")
    with _socket_at(path, OTHER):
        assert trust.daemon_uid(path, TRUSTED) == OTHER


def test_an_entry_of_a_sticky_directory_counts_only_when_a_trusted_user_owns_it(base):
    sticky = _dir(os.path.join(base, "tmp"), 0o1777)
    theirs = _dir(os.path.join(sticky, "kvtierd-vllm"), 0o755, OTHER)
    path = os.path.join(theirs, "kvtierd.sock")
    with _socket_at(path, OTHER):
        with pytest.raises(trust.UntrustedDaemon) as caught:
            trust.daemon_uid(path, TRUSTED)
        message = str(caught.value)
        assert theirs in message and f"uid {OTHER}" in message
        assert "anyone could have made it" in message and trust.DAEMON_USER_ENV in message
        assert trust.daemon_uid(path, TRUSTED | {OTHER}) == OTHER  # told who runs it


def test_the_sticky_directorys_own_owner_may_place_entries_in_it(base):
    sticky = _dir(os.path.join(base, "shared"), 0o1777, OTHER)
    path = os.path.join(sticky, "kvtierd.sock")
    with _socket_at(path, OTHER):
        assert trust.daemon_uid(path, TRUSTED) == OTHER


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o777])
def test_a_directory_others_may_write_without_the_sticky_bit_is_refused(base, mode):
    """Anyone who may write it could rename the daemon's socket aside: refused even for
    a socket of a trusted owner."""
    open_dir = _dir(os.path.join(base, "open"), mode)
    path = os.path.join(open_dir, "kvtierd.sock")
    with _socket_at(path), pytest.raises(trust.UntrustedDaemon) as caught:
        trust.daemon_uid(path, TRUSTED)
    assert "not sticky" in str(caught.value) and f"chmod go-w {open_dir}" in str(caught.value)


def test_a_symlink_is_an_entry_and_its_target_is_walked_too(base):
    sticky = _dir(os.path.join(base, "tmp"), 0o1777)
    private = _dir(os.path.join(base, "private"), 0o755)
    path = os.path.join(private, "kvtierd.sock")
    with _socket_at(path):
        good = os.path.join(private, "link.sock")
        os.symlink(path, good)
        assert trust.daemon_uid(good, TRUSTED) == 0
        planted = os.path.join(sticky, "kvtierd.sock")
        os.symlink(path, planted)
        os.lchown(planted, OTHER, OTHER)  # another user's link to a good socket
        with pytest.raises(trust.UntrustedDaemon, match="anyone could have made it"):
            trust.daemon_uid(planted, TRUSTED)
        theirs = _dir(os.path.join(sticky, "theirs"), 0o755, OTHER)
        with _socket_at(os.path.join(theirs, "s.sock"), OTHER):
            into = os.path.join(private, "into.sock")
            os.symlink(os.path.join(theirs, "s.sock"), into)  # a good link to a bad place
            with pytest.raises(trust.UntrustedDaemon, match="anyone could have made it"):
                trust.daemon_uid(into, TRUSTED)


def test_dot_dot_and_a_loop_of_links_are_walked_as_the_kernel_would(base):
    private = _dir(os.path.join(base, "private"), 0o755)
    path = os.path.join(private, "kvtierd.sock")
    with _socket_at(path):
        assert (
            trust.daemon_uid(os.path.join(private, "..", "private", "kvtierd.sock"), TRUSTED) == 0
        )
    loop = os.path.join(private, "loop")
    os.symlink(loop, loop)
    with pytest.raises(trust.UntrustedDaemon, match="symlinks"):
        trust.placed_entry(loop, TRUSTED, "x")
    with pytest.raises(trust.UntrustedDaemon, match="not an absolute path"):
        trust.placed_entry("relative/kvtierd.sock", TRUSTED, "x")
    with pytest.raises(FileNotFoundError):
        trust.daemon_uid(os.path.join(private, "missing.sock"), TRUSTED)


def test_a_file_is_not_a_socket_and_an_announced_path_must_be_the_daemons(base):
    regular = os.path.join(base, "kvtierd.sock")
    open(regular, "w").close()
    with pytest.raises(trust.UntrustedDaemon, match="not a socket"):
        trust.daemon_uid(regular, TRUSTED)
    os.chown(regular, OTHER, OTHER)  # placed (root's 0755 directory), another user's
    with pytest.raises(trust.UntrustedDaemon, match="not by the daemon's user"):
        trust.require_owned_by(regular, 0, TRUSTED, "the region file")
    assert trust.require_owned_by(regular, OTHER, TRUSTED, "the region file").st_uid == OTHER


def test_a_peer_of_another_uid_is_refused():
    left, right = socket.socketpair(socket.AF_UNIX)
    with left, right:
        trust.require_peer(left, os.geteuid(), "/x.sock", "the lane")
        with pytest.raises(trust.UntrustedDaemon, match="served by"):
            trust.require_peer(left, os.geteuid() + 1, "/x.sock", "the lane")


def test_daemon_users_are_names_or_uids_and_an_unknown_name_is_an_error(monkeypatch):
    monkeypatch.setenv(trust.DAEMON_USER_ENV, "root, 4242")
    assert trust.trusted_uids() == frozenset({0, os.geteuid(), 4242})
    assert 4343 in trust.trusted_uids([4343])
    assert 4444 in trust.trusted_uids("4444")
    monkeypatch.setenv(trust.DAEMON_USER_ENV, "no-such-user-kvt")
    with pytest.raises(ValueError, match="no user named 'no-such-user-kvt'"):
        trust.trusted_uids()


def _answer(region_path: str, fd_socket: str = "", lane: str = "") -> pb2.OpenSessionResponse:
    response = pb2.OpenSessionResponse(session_id="s", fast_lane_path=lane)
    response.region.path = region_path
    response.region.fd_socket = fd_socket
    return response


def test_an_answer_naming_another_users_region_file_or_sockets_is_refused(base):
    """What an OpenSession answer names must be its daemon's: a region file, descriptor
    socket or lane socket of another uid is ``UntrustedAddress``."""
    check = DaemonCheck("unix:///x", "/x")
    mine = os.path.join(base, "mine.region")
    open(mine, "w").close()
    check.check_announced(_answer(mine), 0)
    theirs = os.path.join(base, "theirs.region")
    open(theirs, "w").close()
    os.chown(theirs, OTHER, OTHER)
    with pytest.raises(UntrustedAddress, match="the region file"):
        check.check_announced(_answer(theirs), 0)
    with _socket_at(os.path.join(base, "lane.sock"), OTHER):
        with pytest.raises(UntrustedAddress, match="the fast lane socket"):
            check.check_announced(_answer(mine, lane=os.path.join(base, "lane.sock")), 0)
        with pytest.raises(UntrustedAddress, match="the region descriptor socket"):
            check.check_announced(_answer(mine, fd_socket=os.path.join(base, "lane.sock")), 0)


def test_a_region_the_client_cannot_look_at_needs_the_descriptor_socket(base):
    """With principals the region's directory is the daemon's alone: the answer must
    then offer the descriptor socket (whose server is checked), or nothing is mapped."""
    check = DaemonCheck("unix:///x", "/x")
    missing = os.path.join(base, "gone", "p.region")
    with pytest.raises(UntrustedAddress, match="offers no descriptor socket"):
        check.check_announced(_answer(missing), 0)
    with _socket_at(os.path.join(base, "regions.sock")):
        check.check_announced(_answer(missing, fd_socket=os.path.join(base, "regions.sock")), 0)


def test_a_region_file_of_another_uid_is_never_mapped(base):
    path = os.path.join(base, "p.region")
    with open(path, "wb") as f:
        f.truncate(4096)
    os.chown(path, OTHER, OTHER)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(trust.UntrustedDaemon, match="refusing to map it"):
        attach_region(path, 1, 4096, identity=None, daemon_uid=0)
    assert len(os.listdir("/proc/self/fd")) == before  # its descriptor closed
    attach_region(path, 1, 4096, identity=None, daemon_uid=OTHER).close()
    attach_region(path, 1, 4096, identity=None).close()  # placed: its owner is the daemon's
