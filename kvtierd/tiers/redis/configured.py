"""A configured redis tier: one ``type = "redis"`` ``[[tiers]]`` entry and what its pools share.

One :class:`ConfiguredRedisTier` per configured redis tier for the daemon's life.
Its pools share one redis-py client (a thread-safe connection pool: at most
``threads`` connections are busy at once, one per I/O thread), one
:class:`~kvtierd.tiers.fs.iopool.IoPool` of ``threads`` I/O threads with the
write-queue limits and one rate-limited fault log. ``capacity`` bounds each
pool's tier (it evicts its own blocks).

No connection is made at start: a server that is down when the daemon starts is
a fault like any other (the tier's jobs fail, counted, until it answers).
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat

import redis

from kvtierd.ratelimit import RateLimitedLog
from kvtierd.tiers.base import JobCallback
from kvtierd.tiers.configured import ConfiguredTier, PoolBinding, TierCheckError
from kvtierd.tiers.fs.iopool import IoPool
from kvtierd.tiers.redis.settings import RedisTierSettings
from kvtierd.tiers.redis.tier import FAULT_LOG_INTERVAL_S, RedisTier

log = logging.getLogger("kvtierd.tiers.redis")


def read_password(path: str) -> str:
    """The password in ``path`` (first line); TierCheckError if others may read it."""
    try:
        st = os.stat(path)
        if st.st_mode & (stat.S_IRGRP | stat.S_IROTH):
            raise TierCheckError(
                "password_file", f"password file {path} is readable by others: chmod 600 it"
            )
        with open(path, encoding="utf-8") as f:
            return f.readline().rstrip("\r\n")
    except OSError as exc:
        raise TierCheckError(
            "password_file", f"cannot read password file {path}: {exc.strerror or exc}"
        ) from None


def make_client(settings: RedisTierSettings, password: str | None) -> redis.Redis:
    """A client of the first URL (standalone; no I/O until the first command)."""
    return redis.Redis.from_url(
        settings.urls[0],
        username=settings.username or None,
        password=password,
        socket_timeout=settings.timeout,
        socket_connect_timeout=settings.timeout,
        max_connections=settings.threads + 4,  # I/O threads, and probes sharing them
        retry_on_timeout=False,
        health_check_interval=0,
    )


class ConfiguredRedisTier(ConfiguredTier):
    """One configured redis tier: settings, the client and the I/O threads."""

    type_name = "redis"

    def __init__(self, name: str, settings: RedisTierSettings) -> None:
        super().__init__(name, settings)
        self.settings: RedisTierSettings = settings
        self.faults = RateLimitedLog(log, FAULT_LOG_INTERVAL_S)
        self._password: str | None = None
        self._client: redis.Redis | None = None
        self._io: IoPool | None = None
        self._pools = 0

    def check(self) -> None:
        """Reads the password file (refused if others may read it). The server is
        not asked: one that is down now is a fault the tier lives through."""
        if self.settings.password_file:
            self._password = read_password(self.settings.password_file)

    def create(
        self, pool: PoolBinding, on_done: JobCallback, loop: asyncio.AbstractEventLoop
    ) -> RedisTier:
        s = self.settings
        if self._client is None:
            self._client = make_client(s, self._password)
        if self._io is None:
            self._io = IoPool(
                loop,
                read_threads=(s.threads + 1) // 2,
                write_threads=s.threads // 2,
                max_queue_jobs=s.max_queue_jobs,
                max_queue_bytes=s.max_queue_bytes,
                name=f"kvtierd-{self.name}",
            )
        self._pools += 1
        return RedisTier(
            self.name,
            self._client,
            key_prefix=s.key_prefix,
            pool_name=pool.pool_name,
            block_bytes=pool.block_bytes,
            layout=pool.layout,
            region_buffer=pool.region_buffer,
            capacity_bytes=s.capacity,
            on_done=on_done,
            loop=loop,
            io_pool=self._io,
            ttl_s=s.ttl,
            presence_ttl_s=s.presence_ttl,
            faults=self.faults,
        )

    async def drain(self) -> None:
        if self._io is not None:
            await self._io.drain()

    def shutdown(self) -> None:
        """Fails queued jobs, joins the I/O threads, closes the connections. Idempotent."""
        if self._io is not None:
            self._io.shutdown()
        if self._client is not None:
            self._client.close()
