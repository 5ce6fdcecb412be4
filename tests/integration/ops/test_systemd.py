"""systemd integration: the notify protocol and the unit file."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from daemon_harness import REPO, eventually, start_daemon

from kvtierd.config import load_config


def receive(sock: socket.socket, into: list[str], seconds: float) -> None:
    """Appends the next message of ``sock`` to ``into``, if one comes within ``seconds``."""
    sock.settimeout(max(seconds, 0.001))
    try:
        into.append(sock.recv(4096).decode())
    except TimeoutError:
        pass


def receive_for(sock: socket.socket, seconds: float) -> list[str]:
    """Every message of ``sock`` for ``seconds`` (a window in which something must
    not come: it waits on purpose)."""
    messages: list[str] = []
    until = time.monotonic() + seconds
    while (left := until - time.monotonic()) > 0:
        receive(sock, messages, left)
    return messages


def messages_until(sock: socket.socket, done, timeout: float) -> list[str]:  # noqa: ANN001
    """The messages of ``sock`` until ``done(messages)`` holds; AssertionError after
    ``timeout`` seconds. Wakes at each message."""
    messages: list[str] = []
    eventually(
        lambda: done(messages), timeout, lambda: f"messages: {messages}",
        wake=lambda seconds: receive(sock, messages, seconds),
    )  # fmt: skip
    return messages


def test_notify_ready_watchdog_and_stopping(tmp_path):
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(path)
        daemon = start_daemon(env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"})
        try:
            messages = messages_until(  # within 1 s: a watchdog ping every 100 ms
                listener,
                lambda got: (
                    any(m.startswith("READY=1") for m in got)
                    and sum(m == "WATCHDOG=1" for m in got) >= 3
                ),
                1.0,
            )
            assert any(m.startswith("READY=1") for m in messages), messages
            assert messages.index(next(m for m in messages if m.startswith("READY=1"))) >= 0
            assert sum(m == "WATCHDOG=1" for m in messages) >= 3  # every 100 ms
            assert daemon.stop() == 0
            messages_until(listener, lambda got: "STOPPING=1" in got, 0.3)
        finally:
            daemon.cleanup()


def test_watchdog_meant_for_another_pid_is_ignored(tmp_path):
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(path)
        daemon = start_daemon(
            env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000", "WATCHDOG_PID": "1"}
        )
        try:
            # on purpose: 0.6 s, six watchdog periods in which no ping may come
            messages = receive_for(listener, 0.6)
            assert any(m.startswith("READY=1") for m in messages)
            assert "WATCHDOG=1" not in messages
        finally:
            daemon.stop()
            daemon.cleanup()


def test_example_config_is_valid():
    config = load_config(str(REPO / "deploy/systemd/kvtierd.toml"), env={})
    assert config.server.listen == ("unix:///run/kvtierd/kvtierd.sock",)
    assert config.memory.budget == 64 << 30
    # a private directory the daemon makes on the shared tmpfs (issue #29: files planted
    # at the daemon's names in /dev/shm itself)
    assert config.memory.shm_dir == "/dev/shm/kvtierd"
    (tier,) = config.tiers  # inside the unit's StateDirectory, created on first start
    assert tier.settings.root == "/var/lib/kvtierd/fs" and tier.settings.create_root
    unit = (REPO / "deploy/systemd/kvtierd.service").read_text()
    assert "StateDirectory=kvtierd" in unit and "ReadWritePaths=" in unit


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_unit_file_verifies(tmp_path):
    unit = (REPO / "deploy/systemd/kvtierd.service").read_text()
    # verify checks that ExecStart exists: point it at this checkout's kvtierd
    kvtierd = Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv")) / "bin/kvtierd"
    if not kvtierd.exists():
        kvtierd = Path(shutil.which("kvtierd") or "/nonexistent")
    unit = unit.replace("/usr/local/bin/kvtierd", str(kvtierd))
    target = tmp_path / "kvtierd.service"
    target.write_text(unit)
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(target)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    problems = [
        line for line in (result.stdout + result.stderr).splitlines()
        if "kvtierd.service" in line
    ]  # fmt: skip
    assert result.returncode == 0 and not problems, result.stdout + result.stderr
