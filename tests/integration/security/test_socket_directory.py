"""The directory of a Unix listen socket (docs/security.md, "Sockets and transports"): the
daemon makes it one level deep, removes it at stop when it made it, and serves only in
one of its own; a real daemon each time, as root or as a throw-away user."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import (
    LOG_LINE,
    DaemonProcess,
    daemon_command,
    start_daemon,
    wait_serving,
    write_config,
)
from nonroot import as_user_prefix, require_nonroot_daemon
from shm_leftovers import shm_tempdir

from kvtierd.config.options import default_shm_dir
from kvtierd_client.client import Client


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory of root's in /tmp that others may traverse (0755)."""
    path = Path(tempfile.mkdtemp(prefix="kvt-sd-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _refused(listen: str, workdir: Path) -> str:
    """The one stderr line of a start refused for ``listen`` (exit code 2)."""
    shm = shm_tempdir()
    try:
        result = subprocess.run(
            daemon_command("--config", write_config(workdir, ""), "--listen", listen,
                           "--shm-dir", shm, "--metrics-address", ""),
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if not LOG_LINE.match(line)]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_a_missing_socket_directory_is_made_one_level_deep_and_removed_at_stop(base):
    made = base / "run"
    daemon = start_daemon("--listen", f"unix://{made}/kvtierd.sock")
    try:
        info = os.stat(made)
        assert stat.S_IMODE(info.st_mode) == 0o750 and info.st_uid == os.geteuid()
        assert f"socket directory {made} created" in daemon.log()
        assert daemon.stop() == 0, daemon.log()
        assert not made.exists()  # removed with its sockets
    finally:
        daemon.cleanup()


def test_a_chain_of_missing_directories_is_refused_and_nothing_is_made(base):
    deep = base / "a" / "b"
    line = _refused(f"unix://{deep}/kvtierd.sock", base)
    assert "server.listen" in line and f"{base / 'a'}, where {deep} would be made" in line, line
    assert not (base / "a").exists()


@pytest.mark.parametrize("mode", [0o770, 0o777])
def test_a_socket_directory_others_may_write_is_refused(base, mode):
    shared = base / "shared"
    shared.mkdir()
    shared.chmod(mode)
    line = _refused(f"unix://{shared}/kvtierd.sock", base)
    assert f"cannot listen in {shared}" in line and "chmod go-w" in line, line
    assert list(shared.iterdir()) == []


def test_a_sticky_socket_directory_is_served_with_a_warning(base):
    sticky = base / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    daemon = start_daemon("--listen", f"unix://{sticky}/kvtierd.sock")
    try:
        assert "a directory anyone may create names in (sticky)" in daemon.log()
        assert os.stat(sticky / "kvtierd.sock").st_uid == os.geteuid()
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.cleanup()


def test_a_socket_directory_the_daemons_user_cannot_reach_is_one_line(accounts):
    """A non-root daemon whose listen path lies in root's 0700 directory: exit code 2
    and one line naming the option, the directory and the daemon's user (was: exit 1
    and a bare ``[Errno 13]``)."""
    require_nonroot_daemon()
    user = accounts.user()
    hidden = Path(tempfile.mkdtemp(prefix="kvt-hidden-", dir="/tmp"))  # root's, 0700
    shm = Path(shm_tempdir())
    try:
        os.chown(shm, user.uid, user.gid)
        result = subprocess.run(
            [*as_user_prefix(user), *daemon_command(
                "--config", "/dev/null", "--listen", f"unix://{hidden}/kvtierd.sock",
                "--shm-dir", str(shm), "--metrics-address", "")],
            capture_output=True, text=True, timeout=60, cwd="/",
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        lines = [line for line in result.stderr.splitlines() if not LOG_LINE.match(line)]
        assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
        assert "server.listen" in lines[0] and f"cannot reach {hidden}" in lines[0], lines
        assert f"{user.name} (uid {user.uid})" in lines[0], lines
    finally:
        shutil.rmtree(hidden, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def test_the_built_in_shm_dir_is_a_directory_of_each_users_own(accounts):
    """Without ``--shm-dir`` a non-root daemon keeps its regions in
    ``/dev/shm/kvtierd-<uid>``, made at start as its own (0750): two users' daemons never
    contend for names there."""
    require_nonroot_daemon()
    user = accounts.user()
    workdir = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))
    expected = f"/dev/shm/kvtierd-{user.uid}"
    os.chown(workdir, user.uid, user.gid)
    config = write_config(workdir, "")
    socket_path = workdir / "kvtierd.sock"
    log_path = workdir / "daemon.log"
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [*as_user_prefix(user), *daemon_command(
                    "--config", config, "--listen", f"unix://{socket_path}",
                    "--metrics-address", "")],
                stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
            )  # fmt: skip
        daemon = DaemonProcess(proc, str(socket_path), expected, str(log_path), str(workdir))
        wait_serving(daemon)
        with (
            Client(daemon.address, daemon_user=user.uid) as client,
            client.open_session("p", block_bytes=4096, num_blocks=4) as session,
        ):
            assert os.path.dirname(session.region.path) == expected
        info = os.stat(expected)
        assert info.st_uid == user.uid and stat.S_IMODE(info.st_mode) == 0o750
        assert default_shm_dir() == "/dev/shm/kvtierd"  # this test's own (root) default
        assert daemon.stop() == 0, daemon.log()
    finally:
        shutil.rmtree(expected, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)
