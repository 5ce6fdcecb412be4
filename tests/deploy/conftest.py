"""Fixtures of tests/deploy (``make test-deploy``): a container runtime, the repository's
image built from the working tree, and containers / volumes removed after each test.

The whole directory skips, with the reason, only where no container runtime can start
(:class:`container_harness.RuntimeUnavailable`); a base image or a build that fails is an
error, not a skip. ``make test`` leaves this directory out (it needs minutes and root).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from container_harness import (
    Docker,
    RuntimeUnavailable,
    build_image,
    connect,
    ensure_base_image,
    filesystem_type,
)

PROBE_DIR = Path(__file__).resolve().parent
PROBE = "/probe/engine_probe.py"  # where PROBE_DIR is mounted in engine containers
PYTHON = "/opt/kvtierd/bin/python"  # the image's venv: kvtierd_client and numpy
METRICS_PORT = 9464
_names = itertools.count()


@pytest.fixture(scope="session")
def docker() -> Iterator[Docker]:
    """A docker daemon that answers, the base image and a fresh build of the image."""
    try:
        runtime = connect()
    except RuntimeUnavailable as exc:
        pytest.skip(f"no container runtime can start here: {exc}")
    try:
        made = ensure_base_image(runtime)
        build_image(runtime)
        timings = ", ".join(f"{k} {v:.1f}" for k, v in runtime.timings.items())
        print(
            f"\ndocker at {runtime.host} ({'started here' if runtime.started else 'running'}), "
            f"base image {'made' if made else 'reused'}; {timings}"
        )
        yield runtime
    finally:
        runtime.close()


@dataclass
class Containers:
    """The containers and volumes one test made (removed at teardown, even on failure)."""

    docker: Docker
    prefix: str
    names: list[str] = field(default_factory=list)
    volumes: list[str] = field(default_factory=list)

    def run(self, *args: str, timeout: float = 120) -> str:
        """``docker run -d ARGS``; the container (``--name`` in ARGS) is tracked."""
        name = args[args.index("--name") + 1]
        self.names.append(name)
        return self.docker.run("run", "-d", *args, timeout=timeout).stdout.strip()

    def state(self, name: str) -> dict:
        return json.loads(self.docker.run("inspect", "--format", "{{json .State}}", name).stdout)

    def logs(self, name: str) -> str:
        result = self.docker.run("logs", name, check=False)
        return result.stdout + result.stderr

    def wait_healthy(self, name: str, timeout: float = 180) -> float:
        """Seconds until the container's healthcheck says ``healthy`` (fails the test with
        the log when it exits or turns unhealthy)."""
        started = time.monotonic()
        while True:
            state = self.state(name)
            health = state.get("Health", {}).get("Status")
            if health == "healthy":
                return time.monotonic() - started
            if not state["Running"] or health == "unhealthy":
                pytest.fail(f"{name}: {state}\n{self.logs(name)}")
            if time.monotonic() - started > timeout:
                pytest.fail(f"{name} not healthy after {timeout} s: {state}\n{self.logs(name)}")
            time.sleep(0.2)

    def wait_serving(self, name: str, timeout: float = 120) -> float:
        """Seconds until ``kvtierd-health`` run inside the container exits 0 (asked every
        0.1 s: finer than the healthcheck's interval, for the start time)."""
        started = time.monotonic()
        while True:
            if self.exec(name, "kvtierd-health", "--timeout", "1", check=False).returncode == 0:
                return time.monotonic() - started
            if time.monotonic() - started > timeout:
                pytest.fail(f"{name} not SERVING after {timeout} s:\n{self.logs(name)}")
            time.sleep(0.1)

    def ip(self, name: str) -> str:
        fmt = "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}"
        return self.docker.run("inspect", "--format", fmt, name).stdout.strip()

    def scrape(self, name: str) -> str:
        url = f"http://{self.ip(name)}:{METRICS_PORT}/metrics"
        with urllib.request.urlopen(url, timeout=20) as response:
            return response.read().decode()

    def stop(self, name: str, grace: int = 60) -> int:
        """``docker stop`` (SIGTERM, SIGKILL after ``grace`` s); the exit code."""
        self.docker.run("stop", "-t", str(grace), name, timeout=grace + 60)
        return int(self.state(name)["ExitCode"])

    def exec(self, name: str, *command: str, check: bool = True, timeout: float = 180):
        return self.docker.run("exec", name, *command, check=check, timeout=timeout)

    def probe(self, engine: str, mode: str, pool: str, count: int) -> dict:
        """Runs tests/deploy/engine_probe.py in the engine container; its JSON report."""
        result = self.exec(engine, PYTHON, PROBE, mode, pool, str(count), check=False)
        assert result.returncode == 0, f"engine probe {mode}: {result.stdout}{result.stderr}"
        return json.loads(result.stdout.strip().splitlines()[-1])

    def cleanup(self) -> None:
        for name in reversed(self.names):
            self.docker.run("rm", "-f", "-v", name, check=False, timeout=120)
        for volume in self.volumes:
            self.docker.run("volume", "rm", "-f", volume, check=False)


@pytest.fixture
def containers(docker: Docker) -> Iterator[Containers]:
    made = Containers(docker, prefix=f"kvtierd-test-{os.getpid()}-{next(_names)}")
    try:
        yield made
    finally:
        made.cleanup()


HOST_SHM = Path("/dev/shm")  # this machine's tmpfs, as a node's /dev/shm


@pytest.fixture
def host_tmpfs() -> Iterator[Path]:
    """A fresh directory on this machine's /dev/shm (a tmpfs, as a node's /dev/shm is),
    removed with everything the containers left in it (their files belong to 10001)."""
    if filesystem_type(HOST_SHM) != "tmpfs":
        pytest.skip(f"{HOST_SHM} is not a tmpfs here ({filesystem_type(HOST_SHM)})")
    made = Path(tempfile.mkdtemp(prefix="kvtierd-deploy-test-", dir=HOST_SHM))
    made.chmod(0o755)  # the containers' users pass through it to their hostPaths
    try:
        yield made
    finally:
        shutil.rmtree(made, ignore_errors=True)
