"""The exporter's asks for snapshots (``kvtierd.ops.metrics_exporter.Snapshots``),
against a real socket pair whose other end plays the daemon: a scrape is answered
by an ask sent after it arrived, one ask is out at a time, and a frame over the
limit ends the channel."""

from __future__ import annotations

import asyncio
import socket

import pytest

from kvtierd.ops.metrics_exporter import ASK, FRAME, TEXT, ChannelClosed, Snapshots


class Daemon:
    """The daemon's end of the channel, driven by the test."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    async def asks(self) -> bytes:
        """Every byte the exporter sent (waits for at least one)."""
        loop = asyncio.get_running_loop()
        return await loop.sock_recv(self.sock, 64)

    def pending(self) -> bytes:
        try:
            return self.sock.recv(64, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return b""

    async def answer(self, body: bytes, length: int | None = None) -> None:
        frame = FRAME.pack(len(body) if length is None else length, TEXT) + body
        await asyncio.get_running_loop().sock_sendall(self.sock, frame)


async def channel(max_bytes: int = 1 << 20) -> tuple[Snapshots, Daemon, asyncio.Task[None]]:
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=ours)
    snapshots = Snapshots(reader, writer, max_bytes)
    return snapshots, Daemon(theirs), asyncio.create_task(snapshots.run())


async def settled() -> None:
    """Lets every ready task run until they all wait (a few loop turns)."""
    for _ in range(10):
        await asyncio.sleep(0)


def test_one_ask_at_a_time_and_the_scrapes_that_came_meanwhile_share_the_next():
    """The answer to an ask sent before a scrape arrived may miss what the scrape's
    client just did: that scrape waits for the next ask, sent once the first is
    answered, and shared by every scrape that arrived in between."""

    async def scenario() -> None:
        snapshots, daemon, running = await channel()
        early = asyncio.create_task(snapshots.fresh())
        assert await daemon.asks() == ASK
        late = [asyncio.create_task(snapshots.fresh()) for _ in range(3)]
        await settled()
        assert daemon.pending() == b"", "a second ask while the first is out"
        await daemon.answer(b"before")
        assert await early == (TEXT, b"before")
        assert await daemon.asks() == ASK  # one, for the three
        await daemon.answer(b"after")
        assert [await s for s in late] == [(TEXT, b"after")] * 3
        await settled()
        assert daemon.pending() == b"", "an ask nobody waits for"
        running.cancel()

    asyncio.run(scenario())


def test_a_frame_over_the_limit_ends_the_channel_and_its_scrapes():
    async def scenario() -> None:
        snapshots, daemon, running = await channel(max_bytes=1024)
        scrape = asyncio.create_task(snapshots.fresh())
        assert await daemon.asks() == ASK
        await daemon.answer(b"", length=1025)
        await running  # ends: the exporter exits
        with pytest.raises(ChannelClosed):
            await scrape

    asyncio.run(scenario())
