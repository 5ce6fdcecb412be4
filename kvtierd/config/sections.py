"""The configuration's frozen tree: one dataclass per section, and :class:`Config`
holding them. Built once by :func:`kvtierd.config.loader.load_config`, then passed
down; nothing changes it.

A section's fields have no defaults: each key's default is written once, in
:data:`kvtierd.config.options.OPTIONS`, and the loader fills every field."""

from __future__ import annotations

from dataclasses import dataclass

from kvtierd.security.config import SecurityConfig
from kvtierd.tiers.configured import TierSettings


@dataclass(frozen=True, slots=True)
class ServerConfig:
    listen: tuple[str, ...]  # normalized listen addresses
    metrics_address: str  # "" = off
    socket_group: str  # "" = the daemon's own group
    shutdown_grace: float  # seconds
    fast_lane: bool  # offer sessions the '<socket>.lane' fast lane (kvtierd.api.fastlane)
    takeover: bool  # replace the daemon serving the Unix sockets (kvtierd.ops.takeover)
    # pool globs whose series /metrics shows; None ("auto"): all, none with principals
    metrics_pool_labels: tuple[str, ...] | None


@dataclass(frozen=True, slots=True)
class MemoryConfig:
    shm_dir: str
    budget: int  # bytes, all regions together
    default_pool_blocks: int
    prefault: bool
    warm_restart: bool  # keep regions + journal at stop; adopt them at the pool's next open
    warm_restart_checksum_bytes: int  # bytes of a row its checksum covers (0: whole rows)
    warm_restart_max_lag: float  # seconds a completion may wait for its journal record


@dataclass(frozen=True, slots=True)
class SessionsConfig:
    lease: float  # seconds
    write_quarantine: float  # seconds
    max_sessions: int


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    max_keys_per_call: int
    max_pools: int
    events_retained: int  # per pool
    events_retained_bytes: int  # per pool
    removals_retained_bytes: int  # per pool, Explain's history
    max_watch_streams: int  # all pools together
    max_unread_watch_streams: int  # per principal
    watch_write_timeout: float  # seconds
    promotion_hold: float  # seconds; 0 = no promotion holds
    remote_lookup_wait: float  # seconds a Lookup may wait for remote tiers; 0: never


@dataclass(frozen=True, slots=True)
class KvEventsConfig:
    """``[kv_events]``: the KV-event publisher routers read (kvtierd.kvevents)."""

    endpoint: str  # "" = off; tcp://HOST:PORT or ipc:///path
    replay_endpoint: str  # "" = no replays
    connect: bool  # connect to the endpoint (a subscriber binds it) instead of binding
    pools: tuple[str, ...]  # the pools published
    model: str  # the topic's model
    identity: str  # the topic's identity ("" = the host name)
    engines: tuple[str, ...]  # if any: each message once per engine, topic kv@<engine>@<model>
    principal: str  # the principal every published pool belongs to (with principals)
    max_description_bytes: int  # all pools' block descriptions together
    replay_bytes: int  # the replay window

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint)


@dataclass(frozen=True, slots=True)
class LogConfig:
    level: str


@dataclass(frozen=True, slots=True)
class TierConfig:
    """One secondary tier: its type, its name (a metrics label) and typed settings
    (the settings dataclass of its type, see :mod:`kvtierd.tiers.registry`)."""

    type: str
    name: str
    settings: TierSettings
    key: str = ""  # where it was configured ("tiers[0]"), for error messages


@dataclass(frozen=True, slots=True)
class Config:
    server: ServerConfig
    memory: MemoryConfig
    sessions: SessionsConfig
    limits: LimitsConfig
    security: SecurityConfig
    log: LogConfig
    kv_events: KvEventsConfig
    tiers: tuple[TierConfig, ...] = ()
