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

from daemon_harness import DaemonProcess, eventually

from kvtierd_client.client import Client, LookupResult
from kvtierd_client.errors import KvtierError, NotFound

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
