"""The manager's connection to kvtierd: its session generations and failure handling.

Failure model: a daemon that does not answer (``Unavailable``,
``DeadlineExceeded``) turns every lookup into MISS and every ``prepare_store``
into None for ``retry_interval`` seconds, then the manager tries again. A session
the daemon no longer knows (``NotFound``: daemon restarted, lease expired) starts
a new *generation* (an OpenSession a handing-over daemon cancelled is sent once
more at once): a new session, possibly a new region; pins and reservations
of older generations died with their session and are never completed against the
new one. Row ids always travel with the identity of their region
(:class:`~kvtierd_client.vllm.common.RegionIdentity`), so a worker never applies
them to another region.

Owned by one manager, scheduler thread only; no lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from kvtierd_client.client import Client, Session
from kvtierd_client.errors import FailedPrecondition, KvtierError, NotFound
from kvtierd_client.vllm.accounting import ManagerCounters, StepAccounting
from kvtierd_client.vllm.common import KvtierdLoadStoreSpec, RegionIdentity, log
from kvtierd_client.vllm.holdings import Grave

__all__ = ["DaemonConnection", "Generation"]

T = TypeVar("T")


@dataclass
class Generation:
    """One session of the manager and the region its row ids index."""

    number: int
    session: Session
    region: RegionIdentity

    def spec(self, block_ids: Sequence[int]) -> KvtierdLoadStoreSpec:
        """Rows of this generation's region, fenced by its session (the worker checks
        the session's lease beacon before it copies)."""
        session = self.session
        return KvtierdLoadStoreSpec(
            block_ids,
            self.region,
            lease_beacon=session.lease_beacon().path,
            session_id=session.session_id,
        )


class DaemonConnection:
    """The current generation (None while disconnected), reconnects and failures.

    ``client`` is owned from here on (closed by :meth:`close`); ``reopen`` opens a
    new session of the pool ``pool_name`` through it (a new generation), tried again
    ``retry_interval`` seconds after a failure. ``on_session_lost``
    runs when the daemon forgot the current session: the manager drops what it
    held and this step's answers. ``counters`` and ``accounting`` are the
    manager's; every call made through :meth:`call` is counted there.

    Invariants: ``generation`` is None or the newest generation; generation
    numbers only grow; ``_down_until`` is a monotonic time before which no call
    is made and no reconnect tried.
    """

    def __init__(
        self,
        client: Client,
        first: Session,
        reopen: Callable[[], Session],
        *,
        pool_name: str,
        retry_interval: float,
        counters: ManagerCounters,
        accounting: StepAccounting,
        on_session_lost: Callable[[], None],
    ) -> None:
        self.client = client
        self._reopen = reopen
        self._pool_name = pool_name
        self._retry_interval = retry_interval
        self._counters = counters
        self._accounting = accounting
        self._on_session_lost = on_session_lost
        self.generation: Generation | None = Generation(1, first, RegionIdentity.of_session(first))
        self._last_generation = 1
        self._down_until = 0.0  # monotonic; calls short-circuit before it

    def usable(self) -> Generation | None:
        """The current generation, reconnecting after ``retry_interval`` if there is none;
        None while the daemon is considered down."""
        if time.monotonic() < self._down_until:
            return None
        if self.generation is not None:
            return self.generation
        try:
            session = self._open()
            region = RegionIdentity.of_session(session)
        except (KvtierError, OSError) as err:
            self._down_until = time.monotonic() + self._retry_interval
            self._counters.rpc_failures += 1
            log.warning("kvtierd: reopening pool %s failed: %s", self._pool_name, err)
            return None
        self._last_generation += 1
        self.generation = Generation(self._last_generation, session, region)
        self._counters.reconnects += 1
        log.warning(
            "kvtierd: new session %s on pool %s (region %s); blocks of the old session "
            "are forgotten", session.session_id, self._pool_name, region.path,
        )  # fmt: skip
        return self.generation

    def _open(self) -> Session:
        """A new session (one round trip, counted). An OpenSession the daemon cut
        with CANCELLED is sent once more at once: a daemon handing its sockets to its
        successor (docs/operations/upgrades.md) cancels the calls in flight with its
        GOAWAY, and the next call reaches the successor; waiting ``retry_interval``
        for it served a second of misses after every upgrade."""
        self._accounting.on_open_session()
        try:
            return self._reopen()
        except KvtierError as err:
            if err.code is not grpc.StatusCode.CANCELLED:
                raise
            log.info(
                "kvtierd: reopening pool %s was cancelled (%s); once more", self._pool_name, err
            )
        self._accounting.on_open_session()
        return self._reopen()

    def call(
        self,
        gen: Generation,
        rpc: str,
        fn: Callable[..., T],
        *args: Any,
        quiet: bool = False,
        **kwargs: Any,
    ) -> T | None:
        """``fn(*args, **kwargs)``, a daemon operation ``rpc`` of ``gen``; None after a
        failure, which it handles (see the module doc). ``quiet``: a
        ``FailedPrecondition`` is logged at debug level only (completions of keys
        the daemon already forgot)."""
        self._accounting.on_call(rpc, gen.session.queue_completions)
        try:
            result = fn(*args, **kwargs)
        except KvtierError as err:
            self._failed(gen, rpc, err, quiet=quiet)
            return None
        self._counters.ops[rpc] += 1
        return result

    def send_queued(self) -> None:
        """Sends the session's queued completions now (one ``Batch``, none if empty)."""
        gen = self.generation
        self._accounting.queued_at = None
        if gen is not None:
            self.call(gen, "Flush", gen.session.flush, quiet=True)

    def release_pins(self, gen: Generation, keys: list[bytes], *, unused: bool = False) -> None:
        """Releases ``gen``'s pins on ``keys``, one entry per pin (queued
        ``CompleteLoad``; ``keys`` is consumed). ``unused``: lookup pins no load
        claimed, which the daemon then does not count as loads (its loaded bytes are
        the blocks the workers were given to copy)."""
        # A key pinned n times is released in n calls (keys are unique per call).
        while keys:
            batch = list(dict.fromkeys(keys))
            for k in batch:
                keys.remove(k)
            self.call(
                gen, "CompleteLoad", gen.session.complete_load, batch, unused=unused, quiet=True
            )

    def release_grave(self, grave: Grave, gen: Generation | None) -> None:
        """Frees the reservations and releases the pins of ``grave``, if ``gen`` (the
        generation current when the graves fell due) took them; else they died with
        their session."""
        if gen is None or grave.generation != gen.number:
            return
        if grave.reserved:
            complete = gen.session.complete_store
            self.call(gen, "CompleteStore", complete, grave.reserved, False, quiet=True)
        pins = grave.pins()
        if pins:
            self.release_pins(gen, pins)

    def live_session_rpcs(self) -> int:
        """Round trips the current session counted (0 while disconnected)."""
        return 0 if self.generation is None else self.generation.session.rpcs

    def close(self) -> None:
        """Closes the client (the daemon releases the session's pins and reservations)."""
        self.generation = None
        self.client.close()

    def _failed(self, gen: Generation, rpc: str, err: KvtierError, quiet: bool) -> None:
        self._counters.rpc_failures += 1
        if isinstance(err, NotFound):
            if self.generation is gen:
                log.warning(
                    "kvtierd: %s: session %s is gone (%s)", rpc, gen.session.session_id, err
                )
                self._session_lost()
            return
        if isinstance(err, FailedPrecondition) and quiet:
            log.debug("kvtierd: %s: %s", rpc, err)
            return
        if time.monotonic() >= self._down_until:
            log.warning(
                "kvtierd: %s failed (%s); serving misses for %.1fs",
                rpc, err, self._retry_interval,
            )  # fmt: skip
        self._down_until = time.monotonic() + self._retry_interval

    def _session_lost(self) -> None:
        """Forgets the dead session: its round trips go to the dead count, its queue
        is lost, and the manager drops its pins, reservations and this step's answers."""
        self._accounting.on_session_lost(self.live_session_rpcs())
        self.generation = None
        self._on_session_lost()
