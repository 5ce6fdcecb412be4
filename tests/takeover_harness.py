"""A daemon taking over from another (``--takeover``) and a client's tight call loop
across it, for the takeover tests and the restart-gap benchmark
(docs/operations/upgrades.md).

:class:`CallLoop` runs in a thread: a session on ``pool`` answering Lookups of
``keys`` (every tenth call a KeepAlive) as fast as it can, a new session when the
daemon forgot the old one. It counts every call that failed because nothing
accepted the connection (``connection refused``, or no socket file at the path)
and records when each call succeeded, so the longest interval between two
successful calls is the gap a client saw.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from daemon_harness import LOG_LINE, DaemonProcess, eventually

from kvtierd_client.client import Client, LookupResult
from kvtierd_client.errors import KvtierError, NotFound

if TYPE_CHECKING:
    from local_users import LocalUser

# what gRPC and the fast lane say when no process accepts at the socket path
REFUSALS = ("connection refused", "no such file or directory", "failed to connect")


def is_refusal(err: BaseException) -> bool:
    text = str(err).lower()
    return isinstance(err, ConnectionRefusedError | FileNotFoundError) or any(
        words in text for words in REFUSALS
    )


def take_over(old: DaemonProcess, *extra: str, wait: bool = True) -> DaemonProcess:
    """Starts a daemon with ``old``'s command plus ``--takeover`` (and ``extra``),
    its log in a file of its own; with ``wait``, returns once it is ready and
    ``old`` has exited."""
    log_path = os.path.join(old.workdir, f"daemon-{time.monotonic_ns()}.log")
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [*old.proc.args, "--takeover", *extra], stdout=log_file,
            stderr=subprocess.STDOUT, env=old.env, cwd=old.workdir,
        )  # fmt: skip
    new = DaemonProcess(proc, old.socket_path, old.shm_dir, log_path, old.workdir, old.env)
    if wait:
        eventually(
            lambda: _ready(new), 60.0, lambda: f"the new daemon ready:\n{new.log()}",
            interval=0.05,
        )  # fmt: skip
        old.proc.wait(60.0)
    return new


def refused_takeover(old: DaemonProcess, *extra: str) -> tuple[DaemonProcess, str]:
    """A takeover of ``old`` that must refuse to start: exit code 2, no traceback,
    one line on stderr besides its log lines. Returns the process and that line."""
    new = take_over(old, *extra, wait=False)
    try:
        eventually(lambda: not new.alive(), 60.0, lambda: f"the takeover's exit:\n{new.log()}")
    finally:
        if new.alive():
            new.proc.kill()
            new.proc.wait()
    assert new.proc.returncode == 2, new.log()
    assert "Traceback" not in new.log(), new.log()
    lines = [line for line in new.log().splitlines() if not LOG_LINE.match(line)]
    assert len(lines) == 1, new.log()
    return new, lines[0]


# Run as the attacker (the system python, standard library only): creates an empty
# regular file, mode 0644, at DIRECTORY/PREFIX<pid> for each pid of FIRST-LAST ranges.
_PLANT = """
import os, sys
directory, prefix = sys.argv[1], sys.argv[2]
made = 0
for span in sys.argv[3:]:
    first, last = map(int, span.split("-"))
    for pid in range(first, last + 1):
        path = os.path.join(directory, prefix + str(pid))
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
        made += 1
print(made)
"""
PLANTED_PIDS = 32768  # how many pids the attacker covers (every one where pid_max is 32768)
_RESERVED_PIDS = 300  # the kernel hands these out only before the first wrap


def plant_for_every_pid(attacker: LocalUser, directory: str, prefix: str) -> set[int]:
    """The red team's attack on predictable names: ``attacker`` plants a regular
    file at ``directory/prefix<pid>`` for every pid the next process can get (all
    of them where ``kernel.pid_max`` is 32768, else the next 32,768 after the
    last pid handed out). Returns the pids covered."""
    with open("/proc/sys/kernel/pid_max") as f:
        pid_max = int(f.read())
    if pid_max <= PLANTED_PIDS:
        spans = [(1, pid_max - 1)]
    else:
        with open("/proc/sys/kernel/ns_last_pid") as f:
            first = int(f.read()) + 1
        last = first + PLANTED_PIDS - 1
        spans = [(first, min(last, pid_max - 1))]
        if last >= pid_max:  # wraps
            spans.append((_RESERVED_PIDS, _RESERVED_PIDS + last - pid_max))
    done = attacker.run_python(_PLANT, directory, prefix, *(f"{a}-{b}" for a, b in spans))
    assert done.returncode == 0, done.stderr
    pids = {pid for first, last in spans for pid in range(first, last + 1)}
    assert int(done.stdout) == len(pids)
    return pids


def _ready(daemon: DaemonProcess) -> bool:
    if not daemon.alive():
        raise AssertionError(f"daemon exited with {daemon.proc.returncode}:\n{daemon.log()}")
    return "kvtierd ready" in daemon.log()


@dataclass
class CallLoop:
    """A tight loop of calls against ``address`` in a thread (module doc)."""

    address: str
    pool: str
    keys: list[bytes]
    block_bytes: int
    num_blocks: int
    successes: list[float] = field(default_factory=list)  # time.monotonic() of each
    refused: list[str] = field(default_factory=list)  # each refusal's message
    failures: dict[str, int] = field(default_factory=dict)  # other errors by class
    answers: list[list[LookupResult]] = field(default_factory=list)  # the last Lookups
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> CallLoop:
        self._thread = threading.Thread(target=self._run, name="call-loop", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30.0)
            assert not self._thread.is_alive(), "the call loop did not stop"

    def succeeded_since(self, moment: float) -> int:
        return sum(1 for at in self.successes if at >= moment)

    def longest_gap(self) -> float:
        """The longest interval between two successful calls (seconds)."""
        times = self.successes
        return max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)

    def _run(self) -> None:
        with Client(self.address) as client:
            session = None
            calls = 0
            while not self._stop.is_set():
                try:
                    if session is None:
                        session = client.open_session(
                            self.pool, block_bytes=self.block_bytes,
                            num_blocks=self.num_blocks, layout="l1", keepalive=False,
                        )  # fmt: skip
                    calls += 1
                    if calls % 10 == 0:
                        session.keep_alive()
                    else:
                        answer = session.lookup(self.keys)
                        self.answers = [*self.answers[-9:], answer]
                    self.successes.append(time.monotonic())
                except NotFound:
                    session = None  # the daemon restarted: a new session
                except (KvtierError, OSError) as err:
                    if is_refusal(err):
                        self.refused.append(str(err))
                    name = type(err).__name__
                    self.failures[name] = self.failures.get(name, 0) + 1


def log_of(daemon: DaemonProcess) -> str:
    return Path(daemon.log_path).read_text(errors="replace")
