"""Local attackers against the fast lane and the metrics endpoint (issue #29):
the figures of the issue, measured on this checkout's daemon and, with
``--base DIR``, on another checkout's daemon in the same run, scenario by
scenario, alternating (``python -m benchmarks.local_attack --base DIR``).

* **lane-cost**: the fast lane's own cost, quiet: 32-key Lookups back to back,
  alternating between the builds' daemons (p50, daemon CPU per call).
* **lanes**: a probe session's 32-key Lookup mean (one call every 2 ms, over its
  lane when it has one), quiet, then after an attacker made
  ``sessions.max_sessions + 64`` lanes of closed sessions (OpenSession, connect
  ``<socket>.lane``, BIND, CloseSession, keep the socket open).
* **partial frames**: the daemon's RSS after 60 lanes each sent all but one byte
  of a frame of ``fast_lane_max_frame_bytes``: lanes of closed sessions, then
  lanes of live sessions.
* **2-byte pieces**: the same with 16 lanes sending 19.8 MiB in all, in 2-byte
  pieces.
* **scrape flood**: the probe's Lookup p50 / p99 in quiet windows and in windows
  where one process scrapes ``/metrics`` as fast as it can and another holds
  thousands of idle connections to it (alternating, three of each); the
  daemon's peak descriptor count and its "event loop stalled" warnings.

Another checkout's daemon runs with ``PYTHONPATH=DIR:DIR/client`` (its generated
stubs must be there: copy ``client/kvtierd_client/_proto``); the attackers and
the probe are this checkout's client in every case.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from benchmarks.common import BenchDaemon, Row, cpu_seconds, percentile
from kvtierd_client.client import Client
from kvtierd_client.wire.lane_frames import BIND, HEADER, METHODS, frame
from kvtierd_client.wire.proto import pb2, pb2_grpc

MIB = 1 << 20
KEYS = [f"probe-{i:012d}-".encode().ljust(36, b"k") for i in range(32)]
PROBE_PERIOD = 0.002  # one probe Lookup every 2 ms, as in the issue
LANE_MAX_SESSIONS = 256  # lanes attack: max_sessions + 64 closed-session lanes
PARTIAL_LANES = 60
PIECE_LANES = 16
PIECE_TOTAL = int(19.8 * MIB)
FLOOD_ROUNDS = 3  # quiet window, flooded window, alternating
FLOOD_WINDOW = 6.0  # seconds of probing per window
IDLE_CONNECTIONS = 8000
COST_ROUNDS = 6
COST_CALLS = 2000
LOOKUP = METHODS["Lookup"][0]


@dataclass(frozen=True)
class Build:
    """Whose daemon runs: ``name`` in the rows, ``env`` its environment (None: this one)."""

    name: str
    env: dict[str, str] | None


def build_of(directory: str) -> Build:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{directory}:{directory}/client"
    return Build("base", env)


# -- the probe -------------------------------------------------------------------------


def probe(client: Client, pool: str, seconds: float) -> tuple[list[float], bool]:
    """Per-call seconds of 32-key Lookups, one every 2 ms for ``seconds``, on a new
    session; and whether that session got a lane."""
    session = client.open_session(pool, block_bytes=4096, num_blocks=64)
    samples: list[float] = []
    try:
        session.lookup(KEYS)  # warm
        next_call = time.perf_counter()
        end = next_call + seconds
        while next_call < end:
            started = time.perf_counter()
            session.lookup(KEYS)
            samples.append(time.perf_counter() - started)
            next_call += PROBE_PERIOD
            pause = next_call - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
        return samples, session.fast_lane
    finally:
        session.close()


def mean_us(samples: list[float]) -> float:
    return sum(samples) / len(samples) * 1e6


# -- raw lanes -------------------------------------------------------------------------


def raw_lane(stub: pb2_grpc.KVTierStub, pool: str, close_session: bool) -> socket.socket | None:
    """A lane bound to a new session of ``pool``, that session closed over gRPC when
    ``close_session``; None when the daemon refused the lane."""
    spec = pb2.PoolSpec(name=pool, block_bytes=4096, num_blocks=16)
    response = stub.OpenSession(pb2.OpenSessionRequest(pool=spec))
    lane = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lane.settimeout(60)
    lane.connect(response.fast_lane_path)
    lane.sendall(frame(BIND, response.fast_lane_token))
    answer = lane.recv(64)
    if close_session:
        stub.CloseSession(pb2.CloseSessionRequest(session_id=response.session_id))
    if len(answer) < HEADER.size or HEADER.unpack_from(answer)[1] != 0:
        lane.close()
        return None
    return lane


def max_frame_bytes(stub: pb2_grpc.KVTierStub) -> int:
    spec = pb2.PoolSpec(name="attack/size", block_bytes=4096, num_blocks=16)
    response = stub.OpenSession(pb2.OpenSessionRequest(pool=spec))
    stub.CloseSession(pb2.CloseSessionRequest(session_id=response.session_id))
    return int(response.fast_lane_max_frame_bytes)


def send_or_drop(lanes: list[socket.socket], send: Callable[[socket.socket], object]) -> int:
    """Calls ``send`` on each lane; a lane the daemon closed is dropped. Lanes left."""
    for lane in list(lanes):
        try:
            send(lane)
        except OSError:
            lanes.remove(lane)
            lane.close()
    return len(lanes)


def vm_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} for {pid}")


# -- scenarios -------------------------------------------------------------------------


def lanes_scenario(build: Build) -> list[Row]:
    group = f"lanes of closed sessions ({build.name})"
    args = ("--max-sessions", str(LANE_MAX_SESSIONS), "--memory-budget", "512MiB")
    with BenchDaemon(*args, env=build.env) as daemon, Client(daemon.address) as client:
        quiet, _ = probe(client, "probe/quiet", 3.0)
        stub = _stub(daemon)
        held = [raw_lane(stub, "attack/lanes", True) for _ in range(LANE_MAX_SESSIONS + 64)]
        attacked, had_lane = probe(client, "probe/attacked", 3.0)
        still_open = sum(1 for lane in held if lane is not None and _open(lane))
        for lane in held:
            if lane is not None:
                lane.close()
    return [
        Row(group, "probe Lookup mean, quiet", mean_us(quiet), "µs"),
        Row(group, "probe Lookup mean, attacked", mean_us(attacked), "µs", "quiet",
            mean_us(attacked) / mean_us(quiet)),
        Row(group, "probe Lookup p50, quiet", percentile(quiet, 0.5) * 1e6, "µs"),
        Row(group, "probe Lookup p50, attacked", percentile(attacked, 0.5) * 1e6, "µs"),
        Row(group, "probe had a lane under attack", float(had_lane), "bool"),
        Row(group, "attacker lanes still open", float(still_open), "lanes"),
    ]  # fmt: skip


def _open(lane: socket.socket) -> bool:
    """Whether the daemon still holds ``lane`` open: what it sent is read, then no
    end of stream and no reset."""
    lane.setblocking(False)
    try:
        while lane.recv(1 << 16):
            pass
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        lane.setblocking(True)


def partial_scenario(build: Build, close_sessions: bool) -> list[Row]:
    kind = "closed" if close_sessions else "live"
    group = f"partial frames, {PARTIAL_LANES} lanes of {kind} sessions ({build.name})"
    with BenchDaemon("--memory-budget", "512MiB", env=build.env) as daemon:
        stub = _stub(daemon)
        claim = max_frame_bytes(stub) - 4  # the frame's length field: kind + body
        before = vm_kib(daemon.proc.pid, "VmRSS")
        lanes = [raw_lane(stub, "attack/partial", close_sessions) for _ in range(PARTIAL_LANES)]
        alive = [lane for lane in lanes if lane is not None]
        body = b"\0" * (claim - 2)  # all but one byte of the frame
        left = send_or_drop(alive, lambda lane: lane.sendall(HEADER.pack(claim, LOOKUP) + body))
        time.sleep(1.0)  # the daemon reads what the sockets still hold
        after, peak = vm_kib(daemon.proc.pid, "VmRSS"), vm_kib(daemon.proc.pid, "VmHWM")
        for lane in alive:
            lane.close()
    return [
        Row(group, "RSS before", before / 1024, "MiB"),
        Row(group, "RSS after", after / 1024, "MiB"),
        Row(group, "peak RSS", peak / 1024, "MiB"),
        Row(group, "lanes that took the whole partial frame", float(left), "lanes"),
    ]


def pieces_scenario(build: Build, close_sessions: bool) -> list[Row]:
    kind = "closed" if close_sessions else "live"
    group = f"2-byte pieces, {PIECE_LANES} lanes of {kind} sessions ({build.name})"
    per_lane = PIECE_TOTAL // PIECE_LANES
    with BenchDaemon("--memory-budget", "512MiB", env=build.env) as daemon:
        stub = _stub(daemon)
        before = vm_kib(daemon.proc.pid, "VmRSS")
        lanes = [raw_lane(stub, "attack/pieces", close_sessions) for _ in range(PIECE_LANES)]
        alive = [lane for lane in lanes if lane is not None]
        send_or_drop(alive, lambda lane: lane.sendall(HEADER.pack(per_lane + 64, LOOKUP)))
        sent = 0
        started = time.monotonic()
        for _ in range(per_lane // 2):
            if not send_or_drop(alive, lambda lane: lane.send(b"ab")):
                break
            sent += 2 * len(alive)
        seconds = time.monotonic() - started
        time.sleep(1.0)
        after, peak = vm_kib(daemon.proc.pid, "VmRSS"), vm_kib(daemon.proc.pid, "VmHWM")
        for lane in alive:
            lane.close()
    return [
        Row(group, "bytes taken by the daemon", sent / MIB, "MiB"),
        Row(group, "seconds sending", seconds, "s"),
        Row(group, "RSS before", before / 1024, "MiB"),
        Row(group, "RSS after", after / 1024, "MiB"),
        Row(group, "peak RSS", peak / 1024, "MiB"),
    ]


def _stub(daemon: BenchDaemon) -> pb2_grpc.KVTierStub:
    return pb2_grpc.KVTierStub(grpc.insecure_channel("unix:" + daemon.socket))


# -- scrape flood ----------------------------------------------------------------------

SCRAPER = textwrap.dedent("""
    import http.client, json, sys, time
    host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    counts = {}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            c = http.client.HTTPConnection(host, port, timeout=5)
            c.request("GET", "/metrics")
            response = c.getresponse()
            response.read()
            key = str(response.status)
            c.close()
        except (OSError, http.client.HTTPException):
            key = "error"
        counts[key] = counts.get(key, 0) + 1
    print(json.dumps({k: v / seconds for k, v in counts.items()}))
""")

IDLER = textwrap.dedent("""
    import asyncio, json, sys, time
    host, port, wanted = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    seconds = float(sys.argv[4])
    stats = {"open": 0, "peak": 0, "opened": 0, "failed": 0}
    end = time.monotonic() + seconds

    async def hold():
        while time.monotonic() < end:
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
            except (OSError, asyncio.TimeoutError):
                stats["failed"] += 1
                await asyncio.sleep(0.1)
                continue
            stats["opened"] += 1
            stats["open"] += 1
            stats["peak"] = max(stats["peak"], stats["open"])
            try:
                await asyncio.wait_for(reader.read(1), max(0.01, end - time.monotonic()))
            except (OSError, asyncio.TimeoutError):
                pass
            stats["open"] -= 1
            writer.close()

    async def main():
        await asyncio.gather(*(hold() for _ in range(wanted)))

    asyncio.run(main())
    print(json.dumps(stats))
""")


class FdSampler:
    """The most descriptors ``pid`` had open, sampled every 0.2 s until ``stop``."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.peak = max(self.peak, len(os.listdir(f"/proc/{self.pid}/fd")))
            except OSError:
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def flood_scenario(build: Build) -> list[Row]:
    """``FLOOD_ROUNDS`` rounds of a quiet window then a flooded one, in one daemon."""
    group = f"scrape flood ({build.name})"
    port = _free_port()
    quiet: list[float] = []
    flooded: list[float] = []
    scraped: list[dict[str, float]] = []
    held = 0
    with BenchDaemon("--metrics-address", f"127.0.0.1:{port}", env=build.env) as daemon, \
            Client(daemon.address) as client:  # fmt: skip
        quiet_fds = len(os.listdir(f"/proc/{daemon.proc.pid}/fd"))
        fds = FdSampler(daemon.proc.pid)
        pid = daemon.proc.pid
        cpu = {"quiet": 0.0, "flood": 0.0, "attackers": 0.0}
        for _ in range(FLOOD_ROUNDS):
            before = cpu_seconds(pid)
            quiet.extend(probe(client, "probe/quiet", FLOOD_WINDOW)[0])
            cpu["quiet"] += cpu_seconds(pid) - before
            children = _children_cpu()
            attackers = [
                _spawn(SCRAPER, "127.0.0.1", port, FLOOD_WINDOW + 1.5),
                _spawn(IDLER, "127.0.0.1", port, IDLE_CONNECTIONS, FLOOD_WINDOW + 1.5),
            ]
            time.sleep(1.0)  # the flood builds up
            before = cpu_seconds(pid)
            flooded.extend(probe(client, "probe/flooded", FLOOD_WINDOW)[0])
            cpu["flood"] += cpu_seconds(pid) - before
            scraper, idler = (json.loads(a.communicate(timeout=120)[0].splitlines()[-1])
                              for a in attackers)  # fmt: skip
            cpu["attackers"] += (_children_cpu() - children) * FLOOD_WINDOW / (FLOOD_WINDOW + 1.5)
            scraped.append(scraper)
            held = max(held, idler["peak"])
        peak_fds = fds.stop()
        with open(os.path.join(daemon.workdir, "daemon.log"), errors="replace") as log:
            stalls = sum("event loop stalled" in line for line in log)

    windows = FLOOD_ROUNDS * FLOOD_WINDOW

    def rate(status: str) -> float:
        return sum(s.get(status, 0.0) for s in scraped) / len(scraped)

    def us(samples: list[float], q: float) -> float:
        return percentile(samples, q) * 1e6

    return [
        Row(group, "probe Lookup p50, quiet", us(quiet, 0.5), "µs"),
        Row(group, "probe Lookup p99, quiet", us(quiet, 0.99), "µs"),
        Row(group, "probe Lookup p50, flood", us(flooded, 0.5), "µs", "quiet p50",
            us(flooded, 0.5) / us(quiet, 0.5)),
        Row(group, "probe Lookup p99, flood", us(flooded, 0.99), "µs", "quiet p99",
            us(flooded, 0.99) / us(quiet, 0.99), "<= 2x quiet"),
        Row(group, "probe Lookup max, quiet", max(quiet) * 1e6, "µs"),
        Row(group, "probe Lookup max, flood", max(flooded) * 1e6, "µs"),
        Row(group, "scrapes answered 200 per second", rate("200"), "/s"),
        Row(group, "scrapes answered 429 per second", rate("429"), "/s"),
        Row(group, "scrape errors per second", rate("error"), "/s"),
        Row(group, "idle connections held at once (attacker's peak)", held, "conns"),
        Row(group, "daemon descriptors, quiet", quiet_fds, "fds"),
        Row(group, "daemon descriptors, flood peak", peak_fds, "fds"),
        Row(group, "event loop stalled warnings", stalls, "lines"),
        *(Row(group, f"CPU of {who} ({window})", cpu[key] / windows * 100, "% of a core")
          for who, window, key in (("the daemon", "quiet", "quiet"),
                                   ("the daemon", "flood", "flood"),
                                   ("the attackers", "flood", "attackers"))),
    ]  # fmt: skip


def lane_cost(builds: tuple[Build, ...]) -> list[Row]:
    """The fast lane's own cost, quiet: a 32-key Lookup back to back on each
    build's daemon (all running at once), ``COST_ROUNDS`` rounds alternating
    between them; p50 and the daemon's CPU per call."""
    daemons = [BenchDaemon("--memory-budget", "256MiB", env=b.env) for b in builds]
    try:
        clients = [Client(d.address) for d in daemons]
        sessions = [c.open_session("probe/cost", block_bytes=4096) for c in clients]
        samples: list[list[float]] = [[] for _ in builds]
        cpu: list[float] = [0.0 for _ in builds]
        for _ in range(COST_ROUNDS):
            for i, (daemon, session) in enumerate(zip(daemons, sessions, strict=True)):
                before = cpu_seconds(daemon.proc.pid)
                for _ in range(COST_CALLS):
                    started = time.perf_counter()
                    session.lookup(KEYS)
                    samples[i].append(time.perf_counter() - started)
                cpu[i] += cpu_seconds(daemon.proc.pid) - before
        for client in clients:
            client.close()
    finally:
        for daemon in daemons:
            daemon.close()
    rows = []
    for build, taken, used in zip(builds, samples, cpu, strict=True):
        group = f"lane Lookup(32 keys), back to back ({build.name})"
        rows.append(Row(group, "p50", percentile(taken, 0.5) * 1e6, "µs"))
        rows.append(Row(group, "daemon CPU per call", used / len(taken) * 1e6, "µs"))
    return rows


def _children_cpu() -> float:
    """CPU seconds of this process's children that ended and were waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _spawn(script: str, *args: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)], stdout=subprocess.PIPE, text=True
    )


def _free_port() -> int:
    with socket.socket() as probe_socket:
        probe_socket.bind(("127.0.0.1", 0))
        return int(probe_socket.getsockname()[1])


# -- entry points ----------------------------------------------------------------------

SCENARIOS: dict[str, Callable[[Build], list[Row]]] = {
    "lanes": lanes_scenario,
    "partial-closed": lambda build: partial_scenario(build, True),
    "partial-live": lambda build: partial_scenario(build, False),
    "pieces-closed": lambda build: pieces_scenario(build, True),
    "pieces-live": lambda build: pieces_scenario(build, False),
    "flood": flood_scenario,
}


def run(
    builds: tuple[Build, ...] = (Build("this", None),), only: tuple[str, ...] = ()
) -> list[Row]:
    """Every scenario (or ``only`` those), each on every build in turn."""
    rows: list[Row] = []
    if not only or "lane-cost" in only:
        print("  lane-cost on every build ...", file=sys.stderr, flush=True)
        rows.extend(lane_cost(builds))
    for name, scenario in SCENARIOS.items():
        if only and name not in only:
            continue
        for build in builds:
            print(f"  {name} on {build.name} ...", file=sys.stderr, flush=True)
            rows.extend(scenario(build))
    return rows


def main() -> int:
    from benchmarks.common import machine, print_table

    parser = argparse.ArgumentParser(prog="python -m benchmarks.local_attack", description=__doc__)
    parser.add_argument("--base", help="another checkout whose daemon runs each scenario too")
    names = ", ".join(["lane-cost", *SCENARIOS])
    parser.add_argument("scenarios", nargs="*", help=f"of {names} (all)")
    args = parser.parse_args()
    builds = (Build("this", None),) + ((build_of(args.base),) if args.base else ())
    with open("/proc/loadavg") as load:
        print(f"machine: {machine()}; load {load.read().split()[0]} at the start")
    print_table(run(builds, tuple(args.scenarios)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
