"""A configured redis tier: one ``type = "redis"`` ``[[tiers]]`` entry and what its pools share.

One :class:`ConfiguredRedisTier` per configured redis tier for the daemon's life.
Its pools share one :class:`~kvtierd.tiers.redis.link.RedisLink` (the redis-py
client, standalone or Cluster: thread-safe connection pools, at most
``threads`` connections busy at once per node, one per I/O thread), one
:class:`~kvtierd.tiers.iopool.IoPool` of ``threads`` I/O threads with the
write-queue limits, one :class:`~kvtierd.tiers.redis.prober.Prober` (the
presence probes of every pool: one in flight per node, on threads of its own, so
a probe never waits behind block transfers) and one rate-limited fault log. ``capacity`` bounds each
pool's tier (it evicts its own blocks); ``fleet_capacity`` bounds each pool's blocks of every
daemon together (:mod:`kvtierd.tiers.redis.fleetlru`).

No connection is made at start: a server that is down when the daemon starts is
a fault like any other (the tier's jobs fail, counted, until it answers). The
first pool's ``prepare`` (off the loop) asks the server its mode.

Health: every ``info_interval`` a loop timer submits one
:meth:`RedisLink.refresh_health` to the I/O threads (at most one in flight);
its answer is handed to every pool's tier on the loop (:meth:`RedisTier.on_health`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import weakref

import redis

from kvtierd.tiers.base import JobCallback
from kvtierd.tiers.configured import ConfiguredTier, PoolBinding, TierCheckError
from kvtierd.tiers.integrity import KeyRing
from kvtierd.tiers.iopool import Outcome
from kvtierd.tiers.keyfiles import integrity_words, load_keyring
from kvtierd.tiers.redis.access import check_tls, explain
from kvtierd.tiers.redis.faultlog import FAULT_LOG_INTERVAL_S
from kvtierd.tiers.redis.link import RedisLink
from kvtierd.tiers.redis.nodefaults import NodeFaults
from kvtierd.tiers.redis.prober import Prober
from kvtierd.tiers.redis.settings import RedisTierSettings
from kvtierd.tiers.redis.tier import RedisTier
from kvtierd.util.ratelimit import RateLimitedLog

log = logging.getLogger(__name__)


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


class ConfiguredRedisTier(ConfiguredTier):
    """One configured redis tier: settings, the client and the I/O threads."""

    type_name = "redis"

    def __init__(self, name: str, settings: RedisTierSettings) -> None:
        super().__init__(name, settings)
        self.settings: RedisTierSettings = settings
        self.faults = RateLimitedLog(log, FAULT_LOG_INTERVAL_S)
        self._password: str | None = None
        self.keys: KeyRing | None = None  # read by check()
        self._link: RedisLink | None = None
        self._prober: Prober | None = None
        self._pools = 0
        # the pools' tiers, told each health refresh (a closed pool's tier goes away)
        self._tiers: weakref.WeakSet[RedisTier] = weakref.WeakSet()
        self._health_timer: asyncio.TimerHandle | None = None
        self._health_in_flight = False
        self._closed = False

    def check(self) -> None:
        """Reads the password file (refused if others may read it), loads the TLS
        files and reads the integrity keys. The server is not asked: one that is down
        (or refuses the tier) now is a fault the tier lives through."""
        if self.settings.password_file:
            self._password = read_password(self.settings.password_file)
        check_tls(self.settings)
        self.keys = load_keyring(
            self.settings.integrity_key_file, self.settings.integrity_verify_key_file
        )

    def describe(self) -> str:
        return super().describe() + integrity_words(self.keys, True)

    def create(
        self, pool: PoolBinding, on_done: JobCallback, loop: asyncio.AbstractEventLoop
    ) -> RedisTier:
        s = self.settings
        if self._link is None:
            self._link = RedisLink(s, self._password, self.name)
        io_pool = self.io_pool(
            loop,
            read_threads=(s.threads + 1) // 2,
            write_threads=s.threads // 2,
            max_queue_jobs=s.max_queue_jobs,
            max_queue_bytes=s.max_queue_bytes,
        )
        if self._prober is None:
            self._prober = Prober(self._link, loop, self.name)
        self._pools += 1
        tier = RedisTier(
            self.name,
            self._link,
            key_prefix=s.key_prefix,
            pool_name=pool.pool_name,
            block_bytes=pool.block_bytes,
            layout=pool.layout,
            region_buffer=pool.region_buffer,
            region_rows=pool.region_rows,
            capacity_bytes=s.capacity,
            on_done=on_done,
            loop=loop,
            io_pool=io_pool,
            ttl_s=s.ttl,
            presence_ttl_s=s.presence_ttl,
            faults=self.faults,
            integrity=self.keys,
            prober=self._prober,
            fleet_capacity_bytes=s.fleet_capacity,
        )
        self._tiers.add(tier)
        if self._health_timer is None and not self._closed:
            self._health_timer = loop.call_later(s.info_interval, self._refresh_health, loop)
        return tier

    def _refresh_health(self, loop: asyncio.AbstractEventLoop) -> None:
        """Loop timer: one health refresh off the loop, then the next timer."""
        self._health_timer = None
        if self._closed or self._io is None or self._link is None:
            return
        if not self._health_in_flight:
            self._health_in_flight = True
            self._io.submit_read([self._link.refresh_health], self._health_done)
        self._health_timer = loop.call_later(
            self.settings.info_interval, self._refresh_health, loop
        )

    def _health_done(self, outcomes: list[Outcome]) -> None:
        self._health_in_flight = False
        outcome = outcomes[0]
        if not outcome.ok:
            error = outcome.error
            logged = NodeFaults.node_down(error)  # the link logged it, once
            if isinstance(error, redis.RedisError) and not logged:
                self.faults.warning(
                    ("health", self.name), "redis tier %s: health check failed: %s",
                    self.name, explain(error, self.settings),
                )  # fmt: skip
            return
        for tier in list(self._tiers):
            tier.on_health(outcome.value)

    def shutdown(self) -> None:
        """Stops the health timer, fails queued jobs, joins the I/O threads, closes
        the connections. Idempotent."""
        self._closed = True
        if self._health_timer is not None:
            self._health_timer.cancel()
            self._health_timer = None
        if self._prober is not None:
            self._prober.close()
        super().shutdown()
        if self._link is not None:
            self._link.close()
