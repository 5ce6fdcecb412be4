"""Bounds on WatchEvents streams: how many are open, how long a write may wait, and
how many ended ones may still hold their last event.

What a stream costs while its client does not read (measured: docs/benchmarks/history.md):
gRPC completes a write once the message fits the client's HTTP/2 flow-control
window (which the client's BDP probing grows to megabytes, in the client's
memory). When the window is full the handler waits in ``context.write`` while
the daemon holds that message about three times: the protobuf message, its
serialized bytes, and gRPC core's copy. Nothing else piles up, because a
stream asks the log for one event at a time and holds no list of them.

So the daemon bounds, per stream and in total:

* each message: events are split to at most ``MAX_EVENT_BYTES`` (64 KiB) when
  they are logged (:mod:`kvtierd.records.events`);
* the number of open streams: ``limits.max_watch_streams`` (all pools); one more
  is refused with RESOURCE_EXHAUSTED. They are shared fairly between principals,
  as peer tickets are (:mod:`kvtierd.util.fairshare`): each principal may always
  open its share (``max_watch_streams`` / principals), and more only while the
  free places still cover every other principal's unused share;
* the wait: a write that has not completed within ``limits.watch_write_timeout``
  ends the stream with OUT_OF_RANGE. gRPC queues that status behind the message
  already handed to it, so a client that reads later receives every event it
  was sent, then the status, and resumes from the last seq it received;
* the ended streams whose end is still unread: a stream being ended (its status
  queued) gives its open place back at once, and counts as *unread* until the
  status has left or its client went away, for that long holding gRPC core's
  copy of its last message (grpc.aio has no server-side cancel that would drop
  it). Each principal (every local caller is one without principals) may have
  ``limits.max_unread_watch_streams`` of them; at that many its new streams are
  refused, other principals' are not.

So a client that stops reading cannot keep the others' streams out, and the
memory of the streams it left is bounded by the two limits.
Event-loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import grpc

from kvtierd.errors import KvtierdError, OutOfRange, ResourceExhausted
from kvtierd.util.fairshare import FairShares

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WatchStats:
    open_streams: int
    unread_streams: int  # ended, their end not yet read by their clients (all principals)
    refused: int  # streams refused by either limit, ever
    ended_slow: int  # streams ended because a write waited write_timeout, ever


_OPEN, _UNREAD, _CLOSED = "open", "unread", "closed"


class WatchSlot:
    """One stream's place: *open* (counted against ``max_streams``) from
    :meth:`WatchStreams.reserve` until :meth:`ending`, then *unread* (counted
    against its principal's ``max_unread``) until :meth:`close`; ``close`` from
    either state ends it. Each move happens once."""

    __slots__ = ("_streams", "principal", "state")

    def __init__(self, streams: WatchStreams, principal: str) -> None:
        self._streams = streams
        self.principal = principal
        self.state = _OPEN

    def ending(self) -> None:
        """The stream's status is being sent: it stops counting as open."""
        if self.state == _OPEN:
            self.state = _UNREAD
            self._streams._moved_to_unread(self.principal)

    def close(self) -> None:
        """The stream is gone (its status left, or its client)."""
        if self.state != _CLOSED:
            was, self.state = self.state, _CLOSED
            self._streams._closed(self.principal, unread=was == _UNREAD)


class WatchStreams:
    """The daemon's WatchEvents streams.

    ``principals``: the configured principals' names, among whom the open places
    are shared (none: one share, the whole limit).

    Invariants: ``0 <= len(_open) <= max_streams``; ``_open.held(p)`` is the
    number of principal ``p``'s slots in state open; ``_unread[p]`` the number
    of ``p``'s slots in state unread, never 0 (the key goes) and at most
    ``max_unread`` after a ``reserve`` (a slot moves to unread without a check:
    its stream is ending whatever the count, and the count bounds new streams)."""

    def __init__(
        self,
        max_streams: int,
        write_timeout: float,
        max_unread: int = 64,
        principals: Iterable[str] = (),
    ) -> None:
        self.max_streams = max_streams
        self.max_unread = max_unread
        self.write_timeout = write_timeout
        self._open = FairShares(max_streams, principals)
        self._unread: dict[str, int] = {}
        self._refused = 0
        self._ended_slow = 0

    def statistics(self) -> WatchStats:
        return WatchStats(
            len(self._open), sum(self._unread.values()), self._refused, self._ended_slow
        )

    def reserve(self, principal: str) -> WatchSlot:
        """A place for a new stream of ``principal``; raises ResourceExhausted when
        none is free, when the free ones are kept for the other principals' shares,
        or when that principal has ``max_unread`` unread ended streams (nothing
        changed). The caller closes it (:meth:`held`)."""
        unread = self._unread.get(principal, 0)
        if unread >= self.max_unread:
            self._refused += 1
            raise ResourceExhausted(
                f"{unread} WatchEvents streams of {principal!r} were ended for not reading "
                f"and their clients have not read that end; the limit is {self.max_unread} "
                "(limits.max_unread_watch_streams): read those streams to their end or "
                "close them"
            )
        if self._open.full:
            self._refused += 1
            raise ResourceExhausted(
                f"{len(self._open)} WatchEvents streams are open, the limit is "
                f"{self.max_streams} (limits.max_watch_streams); close a stream you no longer "
                "read, or raise the limit"
            )
        if not self._open.within_share(principal):
            self._refused += 1
            raise ResourceExhausted(
                f"principal {principal!r} has {self._open.held(principal)} WatchEvents streams "
                f"open; the free places ({self._open.free}) are kept for the other principals' "
                "shares (limits.max_watch_streams / principals); close a stream you no longer "
                "read"
            )
        self._open.take(principal)
        return WatchSlot(self, principal)

    @contextlib.contextmanager
    def held(self, slot: WatchSlot) -> Iterator[WatchSlot]:
        """Closes ``slot`` when the block ends (its stream is gone)."""
        try:
            yield slot
        finally:
            slot.close()

    def _moved_to_unread(self, principal: str) -> None:
        self._open.give_back(principal)
        self._unread[principal] = self._unread.get(principal, 0) + 1

    def _closed(self, principal: str, unread: bool) -> None:
        if not unread:
            self._open.give_back(principal)
            return
        left = self._unread[principal] - 1
        if left:
            self._unread[principal] = left
        else:
            del self._unread[principal]

    async def write(self, context: grpc.aio.ServicerContext, message: object, seq: int) -> None:
        """Sends one message; raises OutOfRange when the client has not made room
        for it within ``write_timeout``. A call the peer already ended surfaces as
        CancelledError, the way gRPC ends a handler whose client cancelled."""
        try:
            await asyncio.wait_for(context.write(message), self.write_timeout)
        except asyncio.TimeoutError:
            self._ended_slow += 1
            log.info(
                "WatchEvents stream of %s ended: event %d not taken within %gs "
                "(limits.watch_write_timeout)",
                context.peer(), seq, self.write_timeout,
            )  # fmt: skip
            raise OutOfRange(
                f"this WatchEvents stream did not take event {seq} within "
                f"{self.write_timeout:g}s (limits.watch_write_timeout); read the stream "
                "continuously, and resume from after_seq = the last seq you received"
            ) from None
        except grpc.aio.InternalError:  # the transport failed the write: the call is gone
            raise asyncio.CancelledError from None


async def end_stream(
    context: grpc.aio.ServicerContext, error: KvtierdError, slot: WatchSlot
) -> None:
    """Ends a stream with ``error``'s status; ``slot`` stops counting as open at once
    and counts as unread until this returns. The status may wait behind the message
    the client has not read (this waits as long: until the client reads or goes);
    if the client goes away meanwhile, nothing is logged."""
    slot.ending()
    try:
        await context.abort(error.code, str(error))
    except grpc.aio.InternalError:
        return  # gRPC ends the call as aborted; its client is gone
