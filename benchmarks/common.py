"""Shared pieces: a table row, percentile helpers, a daemon launcher, CPU time of a pid."""

from __future__ import annotations

import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


@dataclass(frozen=True)
class Row:
    group: str
    name: str
    value: float
    unit: str
    floor: str = ""  # what the value is compared with
    ratio: float | None = None  # value / floor (or floor / value for latencies: see notes)
    target: str = ""

    def cells(self) -> list[str]:
        ratio = "" if self.ratio is None else f"{self.ratio:.2f}x"
        return [self.group, self.name, f"{self.value:,.3f}".rstrip("0").rstrip("."), self.unit,
                self.floor, ratio, self.target]  # fmt: skip


def print_table(rows: list[Row]) -> str:
    """Prints the markdown table of ``rows`` and returns it."""
    text = format_table(rows)
    print(text, flush=True)
    return text


def format_table(rows: list[Row]) -> str:
    """``rows`` as a markdown table, the columns padded to their widest cell."""
    header = ["group", "benchmark", "value", "unit", "floor (same run)", "ratio", "target"]
    table = [header] + [row.cells() for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"
             for r in table]  # fmt: skip
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def machine() -> str:
    cpu = "unknown cpu"
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(l.split(":", 1)[1].strip() for l in handle if "model name" in l)  # noqa: E741
    except (OSError, StopIteration):
        pass
    return (
        f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, {platform.system()}"
    )


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_anon_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("RssAnon not found")


class BenchDaemon:
    """A real kvtierd process on a temporary socket and shm directory."""

    def __init__(
        self, *args: str, shm_dir: str | None = None, env: dict[str, str] | None = None
    ) -> None:
        """``shm_dir``: an existing one (kept at close: warm restarts), else a new one.
        ``env``: the daemon's environment (default: this process's), e.g. a
        ``PYTHONPATH`` that runs another checkout's daemon for a before/after (it
        then runs in its work directory, so this checkout's sources stay out of
        its path)."""
        self.workdir = tempfile.mkdtemp(prefix="kvtb-", dir="/tmp")
        self._own_shm_dir = shm_dir is None
        self.shm_dir = shm_dir or tempfile.mkdtemp(prefix="kvtierd-bench-", dir="/dev/shm")
        self.socket = os.path.join(self.workdir, "kvtierd.sock")
        self.address = "unix://" + self.socket
        self.log = open(os.path.join(self.workdir, "daemon.log"), "wb")  # noqa: SIM115
        if "--config" not in args:  # primary tier only unless the caller configures tiers
            config = os.path.join(self.workdir, "primary-only.toml")
            with open(config, "w") as f:
                f.write("# no [[tiers]]: the primary tier alone\n")
            args = ("--config", config, *args)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtierd", "--listen", self.address, "--shm-dir",
             self.shm_dir, "--metrics-address", "", "--log-level", "warning", *args],
            stdout=self.log, stderr=subprocess.STDOUT, env=env,
            # another checkout's daemon (env): not this one's from the current directory
            cwd=self.workdir if env is not None else None,
        )  # fmt: skip
        self._wait_serving()

    def _wait_serving(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtierd exited with {self.proc.returncode}")
            if os.path.exists(self.socket):
                with grpc.insecure_channel("unix:" + self.socket) as channel:
                    try:
                        health_pb2_grpc.HealthStub(channel).Check(
                            health_pb2.HealthCheckRequest(), timeout=1
                        )
                        return
                    except grpc.RpcError:
                        pass
            time.sleep(0.05)
        raise RuntimeError("kvtierd did not become ready")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if self._own_shm_dir:
            shutil.rmtree(self.shm_dir, ignore_errors=True)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> BenchDaemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
