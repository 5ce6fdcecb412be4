"""Real ``redis-server`` processes for the redis tier's tests.

:class:`RedisServer` runs one standalone server on a free loopback port in a temp
dir of its own (no persistence, no protected mode), and can be killed and started
again on the same port. The fixtures always stop what they started. Without a
``redis-server`` binary (``make test-tools`` installs it as root with apt), the
tests that need one skip and say why.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

START_TIMEOUT_S = 10.0
REDIS_SERVER = shutil.which("redis-server")
SKIP_REASON = "redis-server is not installed (`make test-tools` installs it as root with apt)"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class RedisServer:
    """One standalone redis-server on 127.0.0.1:``port``, files under ``directory``."""

    def __init__(self, *extra: str) -> None:
        if REDIS_SERVER is None:
            pytest.skip(SKIP_REASON)
        self.directory = tempfile.mkdtemp(prefix="kvt-redis-")
        self.port = _free_port()
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return Path(self.directory) / "redis.log"

    def start(self) -> None:
        assert REDIS_SERVER is not None and self.proc is None
        args = [
            REDIS_SERVER,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", self.directory,
            "--save", "",
            "--appendonly", "no",
            "--protected-mode", "no",
            "--logfile", str(self.log_path),
            *self.extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log_path.read_text() if self.log_path.exists() else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}:\n{log}")
            if self.ping():
                return
            time.sleep(0.01)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def ping(self) -> bool:
        """Whether the server answers (PONG, or NOAUTH from one with a password)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: the server is gone at once (its keys with it: no persistence)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One server for the session (tests keep apart by key prefix)."""
    server = RedisServer()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def redis_factory() -> Iterator[Callable[..., RedisServer]]:
    """Servers of the test's own (to kill, to configure): all stopped afterwards."""
    servers: list[RedisServer] = []

    def make(*extra: str) -> RedisServer:
        server = RedisServer(*extra)
        servers.append(server)
        return server

    try:
        yield make
    finally:
        for server in servers:
            server.close()
