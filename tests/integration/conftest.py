"""Fixtures shared by the integration tests of several subjects (each starts real
processes: daemons on real sockets, redis-server, files on a real filesystem).

The helpers they build on live beside ``tests/conftest.py``: ``daemon_harness``
(daemons, waits), ``engine_harness`` (an engine's session and region), ``redis_harness``,
``warm_harness``, ``lane_harness``, ``raw_calls`` and ``users_harness``.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from daemon_harness import DaemonProcess, start_daemon
from users_harness import ThrowawayAccounts, require_root


@pytest.fixture
def fs_root(tmp_path: Path) -> Path:
    root = tmp_path / "fs"
    root.mkdir()
    return root


@pytest.fixture
def key_prefix() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def daemons() -> Iterator[Callable[[str], DaemonProcess]]:
    """Starts daemons (each its own socket and shm dir); stops them all afterwards."""
    started: list[DaemonProcess] = []

    def start(config: str) -> DaemonProcess:
        daemon = start_daemon("--memory-budget", "64MiB", config=config)
        started.append(daemon)
        return daemon

    try:
        yield start
        for daemon in started:
            assert daemon.stop() == 0, daemon.log()
    finally:
        for daemon in started:
            daemon.cleanup()


@pytest.fixture
def make_daemon():
    """Starts daemons with the given flags; stops them (exit 0 expected) afterwards."""
    started: list[DaemonProcess] = []

    def start(*args: str) -> DaemonProcess:
        started.append(start_daemon("--memory-budget", "64MiB", *args))
        return started[-1]

    yield start
    for daemon in started:
        try:
            assert daemon.stop() == 0, daemon.log()
        finally:
            daemon.cleanup()


@pytest.fixture
def accounts() -> Iterator[ThrowawayAccounts]:
    require_root()
    made = ThrowawayAccounts()
    try:
        yield made
    finally:
        made.remove_all()


@pytest.fixture
def warm_daemon():
    daemons: list[DaemonProcess] = [start_daemon("--lease", "2s", "--write-quarantine", "1s")]
    yield daemons
    for daemon in daemons:
        daemon.stop(signal.SIGKILL)
    daemons[-1].cleanup()


@pytest.fixture
def sticky_root() -> Iterator[str]:
    """An fs root like /tmp: world-writable with the sticky bit (the start-up root
    check accepts it: others cannot swap the daemon's own entries)."""
    root = tempfile.mkdtemp(prefix="kvt-sticky-", dir="/tmp")
    os.chmod(root, 0o1777)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


# a throw-away local user (root only), for the attacks another user makes
from local_users import other_user  # noqa: E402, F401
