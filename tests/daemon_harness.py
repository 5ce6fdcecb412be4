"""Starts the real kvtierd process for tests and talks to it over its Unix socket.

Waiting: :func:`eventually` is the tests' one wait for a condition (in a coroutine,
:func:`eventually_async`). Where the code offers an event it blocks on that event
between two looks (``wake``: a thread's ``join``, an fd's readiness, a pool's
WatchEvents stream through :class:`PoolEvents`); elsewhere it polls. A fixed
``time.sleep`` in a test only lets time pass on purpose (a stall, a lease running
out, a window in which something must *not* happen) and says so beside it; unit
tests have none (they inject a clock: ``tests/unit/test_conventions.py`` checks).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from shm_leftovers import shm_tempdir

from kvtierd_client.wire.proto import pb2, pb2_grpc

if TYPE_CHECKING:
    from kvtierd_client.client import Client

REPO = Path(__file__).resolve().parents[1]
POLL_INTERVAL_S = 0.02  # between two looks at state that offers no event
_T = TypeVar("_T")


@dataclass
class DaemonProcess:
    proc: subprocess.Popen[bytes]
    socket_path: str
    shm_dir: str
    log_path: str
    workdir: str
    env: dict[str, str] | None = None  # the environment it was started with
    # the directory of root's holding ``workdir`` when another user owns that (removed too)
    outer: str = ""
    # the channels of stub(): this object's own, closed by stop()
    _channels: list[grpc.Channel] = field(default_factory=list, init=False, repr=False)

    @property
    def address(self) -> str:
        return "unix://" + self.socket_path

    @property
    def target(self) -> str:
        return "unix:" + self.socket_path

    def stub(self) -> pb2_grpc.KVTierStub:
        channel = grpc.insecure_channel(self.target)
        self._channels.append(channel)
        return pb2_grpc.KVTierStub(channel)

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def region_files(self) -> list[str]:
        return sorted(os.listdir(self.shm_dir)) if os.path.isdir(self.shm_dir) else []

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        for channel in self._channels:
            channel.close()
        self._channels.clear()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(
                    f"daemon did not stop within {timeout}s:\n{self.log()}"
                ) from None
        return self.proc.returncode

    def restart(self, timeout: float = 30.0) -> DaemonProcess:
        """The same command, sockets and directories in a new process (after
        ``stop``); waits for SERVING. Its log goes on in the same file."""
        assert self.proc.poll() is not None, "stop the daemon before restarting it"
        with open(self.log_path, "ab") as log_file:
            proc = subprocess.Popen(
                self.proc.args, stdout=log_file, stderr=subprocess.STDOUT, env=self.env,
                cwd=self.workdir,
            )  # fmt: skip
        again = DaemonProcess(
            proc, self.socket_path, self.shm_dir, self.log_path, self.workdir, self.env,
            self.outer,
        )  # fmt: skip
        wait_serving(again, timeout)
        return again

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        shutil.rmtree(self.outer or self.workdir, ignore_errors=True)


def write_config(directory: str | os.PathLike[str], text: str) -> str:
    """Writes a TOML config file into ``directory``; returns its path."""
    path = os.path.join(directory, f"kvtierd-{time.monotonic_ns()}.toml")
    Path(path).write_text(text)
    return path


def fs_tiers_config(*roots: str | os.PathLike[str], **options: object) -> str:
    """``[[tiers]]`` tables of fs tiers at ``roots`` (consulted in that order)."""
    extra = "".join(f"{key} = {_toml(value)}\n" for key, value in options.items())
    return "".join(
        f'[[tiers]]\ntype = "fs"\nname = "fs{i}"\nroot = "{root}"\n{extra}'
        for i, root in enumerate(roots)
    )


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return f'"{value}"'


def daemon_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvtierd", *args]


LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ \S+: ")


def refused_start(config: str | os.PathLike[str], workdir: str | os.PathLike[str],
                  prefix: Sequence[str] = ()) -> str:  # fmt: skip
    """Runs a daemon with the config file ``config`` (its socket in ``workdir``, a shm
    directory of its own, no metrics; through ``prefix``: nonroot.py's, as another
    user) that must refuse to start: exit code 2, no traceback and, besides its log
    lines, exactly one line on stderr, which is returned."""
    shm = shm_tempdir("kvt-shm-")
    try:
        os.chmod(shm, 0o1777)  # sticky, as /dev/shm: any user's daemon may use it
        result = subprocess.run(
            [*prefix, *daemon_command(
                "--listen", f"unix://{workdir}/kvtierd.sock", "--shm-dir", shm,
                "--metrics-address", "", "--config", str(config),
            )],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        os.rmdir(shm)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if not LOG_LINE.match(line)]
    assert len(lines) == 1, result.stderr
    return lines[0]


def start_daemon(
    *extra_args: str,
    env: dict[str, str] | None = None,
    wait: bool = True,
    timeout: float = 30.0,
    shm_dir: str | None = None,
    config: str | None = "",
    command_prefix: Sequence[str] = (),
    owner: tuple[int, int] | None = None,
) -> DaemonProcess:
    """Starts kvtierd on a fresh socket and (unless given) shm directory; waits for SERVING.

    ``config`` is the text of the TOML file it gets (``""``: primary tier only, no
    secondary tiers); ``None`` runs it without ``--config`` (the embedded default:
    an fs tier under ``$STATE_DIRECTORY``, which is the daemon's workdir here).
    ``command_prefix`` runs the daemon through another command (``nonroot.py``: as
    another user); ``owner`` (uid, gid) then owns its workdir (socket, config).
    """
    workdir = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")  # short: sun_path is 108 bytes
    outer = ""
    if owner is not None:
        # the user's directory inside one of root's (0755), not straight in sticky /tmp:
        # what root hands a user there names that user's daemon to every client
        # (kvtierd_client.wire.trust), as /run/kvtierd does under systemd
        outer, workdir = workdir, os.path.join(workdir, "w")
        os.chmod(outer, 0o755)
        os.mkdir(workdir, 0o700)
        os.chown(workdir, *owner)
    if config is not None:
        extra_args = ("--config", write_config(workdir, config), *extra_args)
    shm_dir = shm_dir or shm_tempdir()
    socket_path = os.path.join(workdir, "kvtierd.sock")
    log_path = os.path.join(workdir, "daemon.log")
    args = [
        "--listen", "unix://" + socket_path,
        "--shm-dir", shm_dir,
        "--metrics-address", "",
        "--log-level", "debug",
        *extra_args,
    ]  # fmt: skip
    # the embedded default's fs tier lives under $STATE_DIRECTORY: keep it in workdir
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "STATE_DIRECTORY": workdir, **(env or {})}
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [*command_prefix, *daemon_command(*args)], stdout=log_file, stderr=subprocess.STDOUT,
            env=full_env, cwd=workdir,
        )  # fmt: skip
    daemon = DaemonProcess(proc, socket_path, shm_dir, log_path, workdir, full_env, outer)
    if wait:
        try:
            wait_serving(daemon, timeout)
        except BaseException:
            daemon.cleanup()
            raise
    return daemon


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for metrics endpoints)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def eventually(
    condition: Callable[[], _T],
    timeout: float,
    what: str | Callable[[], str],
    *,
    wake: Callable[[float], object] | None = None,
    interval: float = POLL_INTERVAL_S,
) -> _T:
    """Returns the first truthy value of ``condition()``, looking again until
    ``timeout`` seconds have passed (it is looked at once more at the deadline);
    then AssertionError naming ``what`` (a callable is called then, for details
    known only at the end: the last answer, a log). An exception ``condition``
    raises ends the wait at once (a daemon that exited, a refused call).

    Between two looks it blocks in ``wake(seconds_left)`` where the code offers an
    event: ``wake`` returns when something ``condition`` reads may have changed,
    or after ``seconds_left`` (``Thread.join``, ``Event.wait``, :meth:`PoolEvents.wait`,
    a ``select`` on an fd). It must not keep returning at once while nothing
    changes. Without ``wake`` it sleeps ``interval`` seconds: a poll, for state
    that offers no event (stats, logs, files).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            details = what() if callable(what) else what
            raise AssertionError(f"not within {timeout}s: {details}")
        if wake is not None:
            wake(left)
        else:
            time.sleep(min(interval, left))


async def eventually_async(
    condition: Callable[[], _T],
    timeout: float,
    what: str | Callable[[], str],
    *,
    interval: float = POLL_INTERVAL_S,
) -> _T:
    """:func:`eventually` inside a coroutine: between two looks it sleeps on the
    event loop (``interval`` seconds), so what ``condition`` waits for (callbacks
    on that loop, a probe's answer) can run meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            details = what() if callable(what) else what
            raise AssertionError(f"not within {timeout}s: {details}")
        await asyncio.sleep(min(interval, left))


class PoolEvents:
    """A pool's WatchEvents stream as something to wake :func:`eventually` with:
    :meth:`wait` returns at the pool's next event. The stream starts after the
    pool's last event at construction, so no later event is missed, and a reader
    thread queues them (gRPC's stream iterator has no timeout of its own). Make
    it *before* the action whose events it waits for; close it (or use ``with``).
    """

    def __init__(self, client: Client, pool: str) -> None:
        after_seq = client.get_stats(pool).pools[0].last_event_seq
        self._stream = client.watch_events(pool, after_seq=after_seq)
        # events in arrival order; None once the stream ended (then _ended says why)
        self._arrived: queue.SimpleQueue[pb2.Event | None] = queue.SimpleQueue()
        self._ended: str | None = None
        self._reader = threading.Thread(target=self._read, name="pool-events", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for event in self._stream:
                self._arrived.put(event)
            self._ended = "the stream ended"
        except Exception as err:  # reported by wait(), in the test's thread
            self._ended = f"the stream failed: {err!r}"
        self._arrived.put(None)

    def wait(self, seconds: float) -> pb2.Event | None:
        """The next event of the pool, or None after ``seconds`` without one.
        AssertionError once the stream ended: no event can come any more."""
        try:
            event = self._arrived.get(timeout=seconds)
        except queue.Empty:
            return None
        if event is None:
            self._arrived.put(None)  # every later wait fails too
            raise AssertionError(f"no more events of the pool: {self._ended}")
        return event

    def close(self) -> None:
        self._stream.cancel()
        self._reader.join(timeout=10)

    def __enter__(self) -> PoolEvents:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def wait_serving(daemon: DaemonProcess, timeout: float = 30.0) -> None:
    """Until the daemon's health service answers SERVING; AssertionError with its
    log if it exits first or is not SERVING within ``timeout`` seconds."""

    def serving() -> bool:
        if not daemon.alive():
            raise AssertionError(f"daemon exited with {daemon.proc.returncode}:\n{daemon.log()}")
        return os.path.exists(daemon.socket_path) and health_status(daemon) == "SERVING"

    eventually(serving, timeout, lambda: f"daemon SERVING:\n{daemon.log()}", interval=0.05)


def health_status(daemon: DaemonProcess, service: str = "") -> str:
    with grpc.insecure_channel(daemon.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def wait_ticket_refused(stub: pb2_grpc.KVTierStub, metadata: Sequence[tuple[str, str]]) -> None:
    """Waits (30 s) until a call carrying ``metadata``, a closed ticket's, is refused
    UNAUTHENTICATED: the daemon learns asynchronously that a ticket's connection closed."""

    def refused() -> bool:
        try:
            stub.GetStats(pb2.GetStatsRequest(), metadata=metadata, timeout=5)
        except grpc.RpcError as err:
            return err.code() == grpc.StatusCode.UNAUTHENTICATED
        return False

    eventually(refused, 30, "the closed ticket refused")


def wait_tier_jobs(stub: pb2_grpc.KVTierStub, pool: str, timeout: float = 30.0) -> None:
    """Waits until none of ``pool``'s secondary-tier jobs is in flight (cascade pins
    and promotion reservations are transient). Polls GetStats: a job that fails
    sends no event."""
    last: list[pb2.PoolStats] = []

    def idle() -> bool:
        last[:] = [stub.GetStats(pb2.GetStatsRequest(pool=pool)).pools[0]]
        return all(tier.jobs_in_flight == 0 for tier in last[0].tiers[1:])

    eventually(idle, timeout, lambda: f"tier jobs of pool {pool} done; still {last}", interval=0.01)


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (VmHWM), in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


KVTIERCTL = str(Path(sys.executable).parent / "kvtierctl")


def ctl(daemon_address: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [KVTIERCTL, "--address", daemon_address, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped. SIGSTOP takes effect
    asynchronously: in a multi-threaded process the thread the kernel picks has to
    run to start the group stop, and meanwhile the others go on (on a busy machine
    long enough to answer a request)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
        return False
    for task in tasks:
        try:
            stat = Path(f"/proc/{pid}/task/{task}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
            continue
        if stat.rsplit(")", 1)[1].split()[0] not in ("T", "t"):
            return False
    return bool(tasks)


def gone(pid: int) -> bool:
    """The process is dead (reaped, or a zombie). A process reaped between the open of
    its stat file and the read makes the read fail with ESRCH (ProcessLookupError)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
        return True


def running(pids: list[int]) -> list[int]:
    """Those of ``pids`` that have not exited (a zombie has)."""
    return [pid for pid in pids if not gone(pid)]


def children_running(pid: int, module: str) -> list[int]:
    """Process ids of ``pid``'s children (every thread's) running ``python -m module``."""
    found: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            children = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
        except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
            continue  # the thread ended
        for child in map(int, children):
            try:
                command = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
                continue
            if module.encode() in command and not gone(child):
                found.append(child)
    return found


class Exits:
    """A ``wake`` for :func:`eventually` that returns when one of some processes exits
    (its pidfd becomes readable, zombie or reaped) or when the time left runs out. A
    process that exited is not waited for again, so the wake never spins."""

    def __init__(self, *pids: int) -> None:
        self._fds: list[int] = []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # gone already: nothing to wait for
                self._fds.append(os.pidfd_open(pid))

    def __call__(self, left: float) -> None:
        if not self._fds:
            time.sleep(min(left, POLL_INTERVAL_S))  # nothing left to wait for: a poll
            return
        ready, _, _ = select.select(self._fds, [], [], left)
        for fd in ready:
            self._fds.remove(fd)
            os.close(fd)

    def __del__(self) -> None:
        for fd in self._fds:
            os.close(fd)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of one scrape. A scrape the endpoint's
    rate limit refuses (429, a test polling it) is made again after its Retry-After,
    for at most 30 s."""
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
                assert response.headers["Content-Type"].startswith("text/plain")
                text = response.read().decode()
            break
        except urllib.error.HTTPError as err:
            if err.code != 429 or time.monotonic() > deadline:
                raise
            time.sleep(float(err.headers.get("Retry-After", "1")))
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)
