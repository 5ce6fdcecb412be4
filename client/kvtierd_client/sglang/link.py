"""The backend's connection to kvtierd: its session generations, reconnects and failures.

A :class:`Generation` is one session of the rank's pool, the region it maps and
the copy engines over that mapping. Failure model (the data path never raises):

* ``Unavailable`` / ``DeadlineExceeded`` (daemon down, restarting, hung): every
  call is a miss for ``retry_interval`` seconds, then the daemon is asked again;
* ``NotFound`` (the daemon forgot the session: it restarted, or the lease ran out):
  the generation is retired and the next call opens a new session and maps the
  (possibly new) region; pins and reservations of the old one died with it;
* any other refusal (``ResourceExhausted``: the pool does not fit the budget any
  more; ``FailedPrecondition``: the pool exists with another geometry;
  ``PermissionDenied``...): misses for ``retry_interval`` seconds, like a daemon
  that is down.

Each kind is logged once per ``log_interval`` (:class:`QuietLog`).

Threads: SGLang's prefetch, prefetch-I/O and backup threads call at once (and the
scheduler thread, for ``clear``). ``_lock`` guards ``_current``, ``_down_until``
and the counters; a reconnect runs under ``_reconnect`` (one at a time: other
threads get a miss meanwhile instead of queueing behind it). A generation counts
its users, and a retired one unmaps its region when its last user is done, so a
copy in flight in one thread never loses its mapping to another thread's
reconnect.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvtierd_client.client import Client, Session
from kvtierd_client.copy_engine import CopyEngine
from kvtierd_client.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    KvtierError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvtierd_client.region import AttachedRegion, attach_announced
from kvtierd_client.sglang.host_pages import HostPages
from kvtierd_client.sglang.pool_plan import PoolPlan
from kvtierd_client.sglang.quiet_log import QuietLog
from kvtierd_client.sglang.settings import StorageSettings

__all__ = ["DaemonLink", "Generation", "LinkStatistics", "describe_refusal"]

log = logging.getLogger(__name__)


class Generation:
    """One session of the pool, its region mapping and the copy engines over it.

    Engines are not thread-safe, so each caller takes one for the duration of a
    copy (:meth:`engine`) and gives it back; at most one engine per concurrent
    caller is ever made. ``_users``, ``_idle`` and ``_retired`` are guarded by
    ``_lock``. Invariant: once retired with no user left, the engines are closed
    and the region unmapped (the session itself is closed by the link).
    """

    def __init__(self, number: int, session: Session, region: AttachedRegion, pages: HostPages):
        self.number = number
        self.session = session
        self.region = region
        self._pages = pages
        self._lock = threading.Lock()
        self._idle: list[CopyEngine] = []
        self._users = 0
        self._retired = False

    @contextmanager
    def engine(self) -> Iterator[CopyEngine]:
        """A copy engine of this generation for the calling thread alone."""
        with self._lock:
            engine = self._idle.pop() if self._idle else None
        if engine is None:
            engine = CopyEngine(self.region, self._pages.tensors)
        try:
            yield engine
        finally:
            with self._lock:
                keep = not self._retired
                if keep:
                    self._idle.append(engine)
            if not keep:
                engine.close()

    def enter(self) -> bool:
        """Counts a user; False (nothing counted) once retired."""
        with self._lock:
            if self._retired:
                return False
            self._users += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self._users -= 1
            done = self._retired and self._users == 0
        if done:
            self._release()

    def retire(self) -> None:
        """No new users; unmaps once the current ones are done. Idempotent."""
        with self._lock:
            if self._retired:
                return
            self._retired = True
            done = self._users == 0
        if done:
            self._release()

    def _release(self) -> None:
        with self._lock:
            engines, self._idle = self._idle, []
        for engine in engines:
            engine.close()
        self.region.close()


@dataclass(frozen=True)
class LinkStatistics:
    """A snapshot of the link's counters."""

    generation: int  # the newest session's number (0: never connected)
    connected: bool
    reconnects: int  # sessions opened after the first
    failures: int  # calls that failed (each a miss)


def describe_refusal(err: KvtierError, settings: StorageSettings, plan: PoolPlan) -> str:
    """One line saying why the daemon refused (or did not answer) ``plan``'s
    ``OpenSession`` and what to change."""
    where = settings.address
    if isinstance(err, (Unavailable, DeadlineExceeded)):
        return (
            f"kvtierd is not reachable at {where} ({err}); start the daemon or fix "
            "kvtierd_address in --hicache-storage-backend-extra-config"
        )
    if isinstance(err, ResourceExhausted):
        return (
            f"kvtierd at {where} refused pool {plan.name!r}: {err}; set (or lower) "
            "kvtierd_pool_bytes or raise the daemon's memory.budget"
        )
    if isinstance(err, FailedPrecondition):
        return (
            f"kvtierd pool {plan.name!r} exists with another block size or layout than "
            f"this host pool's pages need (block_bytes={plan.block_bytes}, page of "
            f"{plan.page_bytes} bytes): {err}; use another kvtierd_pool or restart the daemon"
        )
    return f"kvtierd at {where} refused pool {plan.name!r}: {err}"


class DaemonLink:
    """The current generation of one rank's pool, reconnects and failure handling.

    ``clock``: monotonic seconds. ``client`` is owned (closed by :meth:`close`).
    """

    def __init__(
        self,
        settings: StorageSettings,
        plan: PoolPlan,
        pages: HostPages,
        quiet: QuietLog,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.plan = plan
        self._pages = pages
        self._quiet = quiet
        self._clock = clock
        self.client = Client(settings.address, timeout=settings.timeout, token=settings.token)
        self._lock = threading.Lock()
        self._reconnect = threading.Lock()
        self._current: Generation | None = None
        self._numbers = 0
        self._down_until = 0.0
        self._failures = 0
        self._retired_rpcs = 0  # round trips of the sessions before the current one
        self._closed = False

    def connect(self, *, first: bool = False) -> Generation:
        """Opens a session of the pool and maps its region (a new generation).

        ``first``: at registration, with the client's long ``OpenSession`` deadline
        (a new pool's region is allocated then); later reconnects use the per-call
        timeout and are tried again after ``retry_interval``. Raises
        ``KvtierError`` (the daemon refused or did not answer) or OSError / ValueError
        (the region could not be mapped); nothing is kept then.
        """
        plan = self.plan
        session = self.client.open_session(
            plan.name,
            block_bytes=plan.block_bytes,
            num_blocks=plan.num_blocks,
            layout=plan.layout,
            eviction_policy=self.settings.eviction_policy,
            client_name=f"sglang-{plan.scope}/pid{os.getpid()}",
            queue_completions=True,
            timeout=None if first else self.settings.timeout,
        )
        try:
            region = attach_announced(
                session.region, session_id=session.session_id, daemon_uid=session.daemon_uid
            )
        except BaseException:
            _close_quietly(session)
            raise
        with self._lock:
            self._numbers += 1
            gen = Generation(self._numbers, session, region, self._pages)
            old, self._current = self._current, gen
            self._down_until = 0.0
        if old is not None:
            self._retire(old)
        return gen

    def failed_to_start(self) -> None:
        """The first :meth:`connect` failed: the data path asks again after
        ``retry_interval`` (and logs what it gets then)."""
        with self._lock:
            self._failures += 1
            self._down_until = self._clock() + self.settings.retry_interval

    @contextmanager
    def use(self) -> Iterator[Generation | None]:
        """The current generation, held for the caller (None while the daemon is
        considered down or a reconnect is under way in another thread)."""
        gen = self._usable()
        if gen is None or not gen.enter():
            yield None
            return
        try:
            yield gen
        finally:
            gen.leave()

    def _usable(self) -> Generation | None:
        with self._lock:
            if self._closed or self._clock() < self._down_until:
                return None
            if self._current is not None:
                return self._current
        if not self._reconnect.acquire(blocking=False):
            return None
        try:
            with self._lock:
                if self._current is not None or self._closed:
                    return self._current
            try:
                gen = self.connect()
            except (KvtierError, OSError, ValueError) as err:
                self._down(kind(err), f"kvtierd: reconnecting pool {self.plan.name} failed: {err}")
                return None
            log.warning(
                "kvtierd: new session %s on pool %s (region %s)",
                gen.session.session_id, self.plan.name, gen.region.path,
            )  # fmt: skip
            self._quiet.forget("unavailable")
            return gen
        finally:
            self._reconnect.release()

    def failed(self, gen: Generation, op: str, err: KvtierError) -> None:
        """``op`` of ``gen`` failed with ``err`` (a miss for the caller); see the module doc."""
        with self._lock:
            self._failures += 1
        if isinstance(err, NotFound):
            with self._lock:
                current = self._current is gen
                if current:
                    self._current = None
            if current:
                self._retire(gen)
                _close_quietly(gen.session)
                self._quiet.log(
                    logging.WARNING, "gone", "kvtierd: %s: session %s is gone (%s); "
                    "opening a new one", op, gen.session.session_id, err,
                )  # fmt: skip
            return
        self._down(kind(err), f"kvtierd: {op} failed: {err}")

    def _down(self, what: str, text: str) -> None:
        with self._lock:
            self._down_until = self._clock() + self.settings.retry_interval
        self._quiet.log(
            logging.WARNING, what, "%s; serving misses, trying again after %gs",
            text, self.settings.retry_interval,
        )  # fmt: skip

    def _retire(self, gen: Generation) -> None:
        with self._lock:
            self._retired_rpcs += gen.session.rpcs
        gen.retire()

    def round_trips(self) -> int:
        """Daemon calls made by this link's sessions (keepalives not counted)."""
        with self._lock:
            current = self._current.session.rpcs if self._current is not None else 0
            return self._retired_rpcs + current

    def statistics(self) -> LinkStatistics:
        with self._lock:
            return LinkStatistics(
                generation=self._numbers,
                connected=self._current is not None,
                reconnects=max(0, self._numbers - 1),
                failures=self._failures,
            )

    def close(self) -> None:
        """Retires the generation and closes the client (the daemon releases the
        session's pins and reservations). Idempotent."""
        with self._lock:
            self._closed = True
            gen, self._current = self._current, None
        if gen is not None:
            self._retire(gen)
        self.client.close()


def kind(err: BaseException) -> str:
    """The log kind of a failure (one line per kind and period)."""
    if isinstance(err, (Unavailable, DeadlineExceeded)):
        return "unavailable"
    if isinstance(err, KvtierError):
        return "refused"
    return "region"


def _close_quietly(session: Session) -> None:
    try:
        session.close()
    except KvtierError:
        pass  # the daemon is gone or forgot it: nothing held survives anyway
