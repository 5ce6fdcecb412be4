"""A /metrics flood by another user (issue #40, item 4): what it costs the daemon,
and whether Prometheus still gets its scrapes.

Three scenarios on one daemon, in rounds (``--rounds``, alternating), each a window
of :data:`WINDOW_S` seconds:

* **quiet**: the probe and Prometheus only;
* **flood, 1 source**: a process of a throw-away user, :data:`THREADS` threads each
  asking ``GET /metrics`` over a new connection to 127.0.0.1 as fast as it can;
* **flood, 128 sources**: the same, each connection from the next of
  127.0.0.2-127.0.0.129 (bound before connecting).

In every window the probe (this process) makes a 32-key Lookup every 2 ms
(``benchmarks.local_attack.probe``) and "Prometheus", a process of a second
throw-away user, scrapes :data:`SCRAPES` times, one a second, each within 10 s (its
default ``scrape_timeout``). Measured: the probe's p50 / p99, the CPU of the daemon
(its own process), of its metrics exporter (the child serving the endpoint: none
before issue #40) and of the attacker, what the attacker was answered, and how many
scrapes Prometheus got.

``python -m benchmarks metrics-flood`` (this checkout), or ``python -m
benchmarks.metrics_flood --base DIR`` to run another checkout's daemon in the same
rounds (``DIR`` as ``benchmarks.local_attack`` takes it). Needs root (``useradd``,
``setpriv``) and ``/usr/bin/python3`` for the other users' processes.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import BenchDaemon, Row, cpu_seconds, percentile
from benchmarks.local_attack import Build, build_of, probe
from kvtierd_client.client import Client

GROUP = "metrics flood"
THREADS = 32
SOURCES = (1, 128)
WINDOW_S = 16.0  # the probe's window; Prometheus's 16 scrapes, one a second, fit in it
BUILD_UP_S = 1.0  # the flood runs this long before the window
SCRAPES = 16
SCRAPE_TIMEOUT_S = 10.0
SYSTEM_PYTHON = "/usr/bin/python3"  # any user may run it
EXPORTER = b"kvtierd.ops.metrics_exporter"

ATTACKER = textwrap.dedent("""
    import http.client, itertools, json, os, sys, threading, time
    port, threads, sources = (int(a) for a in sys.argv[1:4])
    seconds = float(sys.argv[4])
    counts, lock, turn = {}, threading.Lock(), itertools.count()
    end = time.monotonic() + seconds

    def flood():
        seen = {}
        while time.monotonic() < end:
            source = ("127.0.0.%d" % (2 + next(turn) % sources), 0) if sources > 1 else None
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=5,
                                               source_address=source)
                c.request("GET", "/metrics")
                response = c.getresponse()
                response.read()
                key = str(response.status)
                c.close()
            except (OSError, http.client.HTTPException):
                key = "error"
            seen[key] = seen.get(key, 0) + 1
        with lock:
            for key, n in seen.items():
                counts[key] = counts.get(key, 0) + n

    started = time.monotonic()
    workers = [threading.Thread(target=flood) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    times = os.times()
    print(json.dumps({"counts": counts, "seconds": time.monotonic() - started,
                      "cpu": times.user + times.system}))
""")

PROMETHEUS = textwrap.dedent("""
    import http.client, json, sys, time
    port, count, timeout = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    answers, slowest, next_at = {}, 0.0, time.monotonic()
    for _ in range(count):
        started = time.monotonic()
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
            c.request("GET", "/metrics")
            response = c.getresponse()
            body = response.read()
            key = str(response.status)
            if key == "200" and b"kvtierd_sessions_open" not in body:
                key = "200 without metrics"
            c.close()
        except (OSError, http.client.HTTPException):
            key = "error"
        took = time.monotonic() - started
        key = key if took <= timeout else "late"
        answers[key] = answers.get(key, 0) + 1
        slowest = max(slowest, took)
        next_at += 1.0
        time.sleep(max(0.0, next_at - time.monotonic()))
    print(json.dumps({"answers": answers, "slowest": slowest}))
""")


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int

    def command(self, script: str, *args: object) -> list[str]:
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups",
                "--", SYSTEM_PYTHON, "-c", script, *map(str, args)]  # fmt: skip


@contextmanager
def throwaway_users(count: int) -> Iterator[list[User]]:
    made: list[User] = []
    try:
        for _ in range(count):
            name = f"kvtb{secrets.token_hex(3)}"
            subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                            "/usr/sbin/nologin", "--user-group", name],
                           check=True, capture_output=True)  # fmt: skip
            entry = pwd.getpwnam(name)
            made.append(User(name, entry.pw_uid, entry.pw_gid))
        yield made
    finally:
        for user in made:
            subprocess.run(["userdel", user.name], capture_output=True, check=False)


@dataclass
class Figures:
    """One build's one scenario, every round together."""

    probe: list[float] = field(default_factory=list)
    daemon_cpu: float = 0.0
    exporter_cpu: float = 0.0
    attacker_cpu: float = 0.0
    attacker_seconds: float = 0.0
    attacker_counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    scrapes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    slowest_scrape: float = 0.0
    windows: int = 0


def exporter_pids(daemon_pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{daemon_pid}/task"):
        try:
            children = Path(f"/proc/{daemon_pid}/task/{task}/children").read_text().split()
            for child in map(int, children):
                if EXPORTER in Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0"):
                    found.append(child)
        except OSError:
            continue
    return found


def exporter_cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            total += cpu_seconds(pid)
        except OSError:
            pass  # it exited (replaced): its CPU is lost to the figure
    return total


def window(
    daemon: BenchDaemon, client: Client, port: int, sources: int, users: list[User],
    figures: Figures,
) -> None:  # fmt: skip
    """One window: the flood (``sources`` 0: none) builds up, then the probe and
    Prometheus run while the CPU of the daemon and its exporter is counted."""
    attacker_user, prometheus_user = users
    attacker = None
    if sources:
        attacker = subprocess.Popen(
            attacker_user.command(ATTACKER, port, THREADS, sources, BUILD_UP_S + WINDOW_S),
            stdout=subprocess.PIPE, text=True, cwd="/",
        )  # fmt: skip
        threading.Event().wait(BUILD_UP_S)
    pid = daemon.proc.pid
    exporters = exporter_pids(pid)
    before = cpu_seconds(pid), exporter_cpu(exporters)
    prometheus = subprocess.Popen(
        prometheus_user.command(PROMETHEUS, port, SCRAPES, SCRAPE_TIMEOUT_S),
        stdout=subprocess.PIPE, text=True, cwd="/",
    )  # fmt: skip
    samples, _ = probe(client, f"probe/{sources}", WINDOW_S)
    figures.daemon_cpu += cpu_seconds(pid) - before[0]
    figures.exporter_cpu += exporter_cpu(exporters) - before[1]
    figures.probe.extend(samples)
    figures.windows += 1
    scraped = json.loads(prometheus.communicate(timeout=SCRAPES * SCRAPE_TIMEOUT_S + 60)[0])
    for key, count in scraped["answers"].items():
        figures.scrapes[key] += count
    figures.slowest_scrape = max(figures.slowest_scrape, scraped["slowest"])
    if attacker is not None:
        flood = json.loads(attacker.communicate(timeout=120)[0])
        for key, count in flood["counts"].items():
            figures.attacker_counts[key] += count
        figures.attacker_seconds += flood["seconds"]
        figures.attacker_cpu += flood["cpu"] * WINDOW_S / flood["seconds"]


def rows(build: Build, figures: dict[int, Figures]) -> list[Row]:
    quiet = figures[0]

    def p(samples: list[float], q: float) -> float:
        return percentile(samples, q) * 1e6

    def share(seconds: float, f: Figures) -> float:
        return seconds / (f.windows * WINDOW_S) * 100

    out: list[Row] = []
    for sources, f in figures.items():
        group = f"{GROUP} ({build.name}): " + (
            "quiet" if not sources else f"{THREADS} threads, {sources} source(s)"
        )
        flood = bool(sources)
        out += [
            Row(group, "probe Lookup p50", p(f.probe, 0.5), "µs"),
            Row(group, "probe Lookup p99", p(f.probe, 0.99), "µs",
                "quiet p99" if flood else "", p(f.probe, 0.99) / p(quiet.probe, 0.99)
                if flood else None, "<= 1.5x quiet" if flood else ""),
            Row(group, "daemon CPU", share(f.daemon_cpu, f), "% of a core",
                f"quiet {share(quiet.daemon_cpu, quiet):.1f}" if flood else "", None,
                "<= quiet + 10" if flood else ""),
            Row(group, "exporter CPU", share(f.exporter_cpu, f), "% of a core"),
            Row(group, "Prometheus scrapes answered 200",
                f.scrapes.get("200", 0) / f.windows, f"of {SCRAPES}", "", None,
                ">= 15" if flood else ""),
            Row(group, "Prometheus slowest scrape", f.slowest_scrape, "s"),
        ]  # fmt: skip
        if flood:
            seconds = f.attacker_seconds
            out += [
                Row(group, "attacker CPU", share(f.attacker_cpu, f), "% of a core"),
                *(Row(group, f"attacker requests answered {key}", n / seconds, "/s")
                  for key, n in sorted(f.attacker_counts.items())),
            ]  # fmt: skip
        other = {k: n for k, n in f.scrapes.items() if k != "200"}
        if other:
            out.append(Row(group, f"Prometheus's other answers: {json.dumps(other)}", 0.0, ""))
    return out


def run(builds: tuple[Build, ...] = (Build("this", None),), rounds: int = 2) -> list[Row]:
    missing = [tool for tool in ("useradd", "userdel", "setpriv") if not shutil.which(tool)]
    if os.geteuid() != 0 or missing or not os.access(SYSTEM_PYTHON, os.X_OK):
        why = f"needs root, {SYSTEM_PYTHON}, useradd, userdel and setpriv"
        return [Row(GROUP, f"skipped: {why}", 0.0, "")]
    figures = {b.name: {s: Figures() for s in (0, *SOURCES)} for b in builds}
    with throwaway_users(2) as users, _daemons(builds) as running:
        for number in range(rounds):
            for build, (daemon, client, port) in zip(builds, running, strict=True):
                for sources in (0, *SOURCES):
                    print(f"  round {number + 1}, {build.name}, sources {sources} ...",
                          file=sys.stderr, flush=True)  # fmt: skip
                    window(daemon, client, port, sources, users, figures[build.name][sources])
    return [row for build in builds for row in rows(build, figures[build.name])]


@contextmanager
def _daemons(builds: tuple[Build, ...]) -> Iterator[list[tuple[BenchDaemon, Client, int]]]:
    running: list[tuple[BenchDaemon, Client, int]] = []
    try:
        for build in builds:
            port = _free_port()
            daemon = BenchDaemon("--metrics-address", f"127.0.0.1:{port}", env=build.env)
            running.append((daemon, Client(daemon.address), port))
        yield running
    finally:
        for daemon, client, _ in running:
            client.close()
            daemon.close()


def _free_port() -> int:
    with socket.socket() as probe_socket:
        probe_socket.bind(("127.0.0.1", 0))
        return int(probe_socket.getsockname()[1])


def main() -> int:
    from benchmarks.common import machine, print_table

    parser = argparse.ArgumentParser(prog="python -m benchmarks.metrics_flood", description=__doc__)
    parser.add_argument("--base", help="another checkout whose daemon runs the rounds too")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the three windows")
    args = parser.parse_args()
    builds = (Build("this", None),) + ((build_of(args.base),) if args.base else ())
    with open("/proc/loadavg") as load:
        print(f"machine: {machine()}; load {load.read().split()[0]} at the start")
    print_table(run(builds, args.rounds))
    with open("/proc/loadavg") as load:
        print(f"load {load.read().split()[0]} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
