"""Bounds on WatchEvents streams: how many are open, and how long a write may wait.

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
* the number of streams: ``limits.max_watch_streams`` (all pools); one more is
  refused with RESOURCE_EXHAUSTED;
* the wait: a write that has not completed within ``limits.watch_write_timeout``
  ends the stream with OUT_OF_RANGE. gRPC queues that status behind the message
  already handed to it, so a client that reads later receives every event it
  was sent, then the status, and resumes from the last seq it received.

A stream keeps its slot until its status has left or its client went away:
gRPC core holds the last message until then, and the slot is what bounds that
memory. Event-loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from kvtierd.errors import KvtierdError, OutOfRange, ResourceExhausted

log = logging.getLogger("kvtierd.watch")


@dataclass(frozen=True, slots=True)
class WatchStats:
    open_streams: int
    refused: int  # streams refused by max_streams, ever
    ended_slow: int  # streams ended because a write waited write_timeout, ever


class WatchStreams:
    """The daemon's WatchEvents streams. Invariant: ``0 <= _open <= max_streams``."""

    def __init__(self, max_streams: int, write_timeout: float) -> None:
        self.max_streams = max_streams
        self.write_timeout = write_timeout
        self._open = 0
        self._refused = 0
        self._ended_slow = 0

    def statistics(self) -> WatchStats:
        return WatchStats(self._open, self._refused, self._ended_slow)

    def reserve(self) -> None:
        """Takes a slot for a new stream; raises ResourceExhausted when none is free
        (nothing changed). The caller releases it with :meth:`held`."""
        if self._open >= self.max_streams:
            self._refused += 1
            raise ResourceExhausted(
                f"{self._open} WatchEvents streams are open, the limit is {self.max_streams} "
                "(limits.max_watch_streams); close a stream you no longer read, or raise "
                "the limit"
            )
        self._open += 1

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Releases the slot :meth:`reserve` took when the block ends."""
        try:
            yield
        finally:
            self._open -= 1
            assert self._open >= 0

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


async def end_stream(context: grpc.aio.ServicerContext, error: KvtierdError) -> None:
    """Ends a stream with ``error``'s status. The status may wait behind messages the
    client has not read; if the client goes away meanwhile, nothing is logged."""
    try:
        await context.abort(error.code, str(error))
    except grpc.aio.InternalError:
        return  # gRPC ends the call as aborted; its client is gone
