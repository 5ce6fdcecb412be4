"""Every scalar option of the daemon, declared once in :data:`OPTIONS`: its section,
key, reader, default, help and flag. The command line (``kvtierd --help``), the
``KVTIERD_<SECTION>_<KEY>`` environment names and the configuration reference of the
docs are derived from this table."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtierd.config.values import (
    DurationIn,
    SizeIn,
    abs_file_or_empty,
    boolean,
    choice,
    directory,
    event_endpoint,
    int_in,
    listen_list,
    metrics_address_value,
    name_list,
    plain_text,
    pool_label_patterns,
    topic_part,
)
from kvtierd.records.events import EVENT_OVERHEAD_BYTES, MAX_EVENT_BYTES
from kvtierd.records.history import KEY_OVERHEAD_BYTES as REMOVAL_OVERHEAD_BYTES
from kvtierd.records.history import RECORD_BYTES as REMOVAL_RECORD_BYTES
from kvtierd.security import config as security_config
from kvtierd_client.wire.address import default_socket_path

LOG_LEVELS = ("debug", "info", "warning", "error")
MAX_BLOCK_BYTES = 1 << 30
# a Lookup waits at most this long for remote tiers (limits.remote_lookup_wait): longer
# than a scheduler step, an engine would rather recompute
MAX_REMOTE_LOOKUP_WAIT = 1.0


def default_shm_dir() -> str:
    """``memory.shm_dir`` when none is configured: a directory of the daemon's user's
    own under the shared tmpfs, made at start (0750; docs/security.md, "A shared
    shm_dir and files other users plant there"), so that two users' daemons never
    contend for the same region and journal names: ``/dev/shm/kvtierd`` for root,
    ``/dev/shm/kvtierd-<uid>`` for any other user."""
    uid = os.geteuid()
    return "/dev/shm/kvtierd" if uid == 0 else f"/dev/shm/kvtierd-{uid}"


@dataclass(frozen=True, slots=True)
class Option:
    """One scalar configuration key, declared once."""

    section: str
    key: str
    parse: Callable[[Any], Any]
    default: Callable[[], Any]
    help: str
    flag: str | None = None  # command-line flag, when this key has one
    repeatable: bool = False  # flag may be given several times (lists)

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.key}"

    @property
    def env(self) -> str:
        return f"KVTIERD_{self.section}_{self.key}".upper()

    def default_text(self) -> str:
        """The default as the configuration would write it (``--help``): '1GiB',
        '10s', 'true', '' for an empty string. Computed now: the default socket
        depends on the user and ``$XDG_RUNTIME_DIR``."""
        value = self.default()
        if value is None:  # decided at start (server.metrics_pool_labels)
            return "auto"
        show = getattr(self.parse, "show", None)
        if show is not None:
            return str(show(value))
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, tuple):
            return ", ".join(value)
        return repr(value) if value == "" else str(value)


OPTIONS: tuple[Option, ...] = (
    Option(
        "server",
        "listen",
        listen_list,
        lambda: ("unix://" + default_socket_path(),),
        "address to serve on: unix:///abs/path or HOST:PORT (TCP needs tokens)",
        flag="--listen",
        repeatable=True,
    ),
    Option(
        "server",
        "metrics_address",
        metrics_address_value,
        lambda: "127.0.0.1:9464",
        "Prometheus endpoint HOST:PORT ('' turns it off)",
        flag="--metrics-address",
    ),
    Option(
        "server",
        "metrics_pool_labels",
        pool_label_patterns,
        lambda: None,
        "pools whose series the metrics endpoint shows (with their names): 'auto' (every "
        "pool, none when [[security.principals]] are configured: the endpoint asks no "
        "identity) or pool name globs, comma-separated on the command line ('' for none)",
        flag="--metrics-pool-labels",
    ),
    Option(
        "server",
        "socket_group",
        plain_text,
        lambda: "",
        "group owning the Unix socket and region files ('' = the daemon's group)",
        flag="--socket-group",
    ),
    Option(
        "server",
        "shutdown_grace",
        DurationIn(0.0, 300.0),
        lambda: 5.0,
        "how long in-flight calls may finish after SIGTERM",
        flag="--shutdown-grace",
    ),
    Option(
        "server",
        "fast_lane",
        boolean,
        lambda: True,
        "offer each session opened over a Unix socket a fast lane for its hot calls (Lookup, "
        "Touch, Prepare/Complete Load/Store, Batch, KeepAlive): framed protobuf on the "
        "'<socket>.lane' socket next to it; false: every call goes through gRPC",
        flag="--fast-lane",
    ),
    Option(
        "server",
        "takeover",
        boolean,
        lambda: False,
        "replace the daemon (of this user) serving these Unix sockets without a refused "
        "connection: serve them under temporary names, rename them over its paths, then "
        "stop it and adopt its pools once it has exited; nothing to replace: an ordinary "
        "start (docs: operations/upgrades)",
        flag="--takeover",
    ),
    Option(
        "memory",
        "shm_dir",
        directory,
        default_shm_dir,
        "directory of the region files and warm-restart journals (a tmpfs); created, the "
        "daemon's own (0750, or 0700 with principals), when missing. Default: a private "
        "directory per user, /dev/shm/kvtierd for root, /dev/shm/kvtierd-<uid> otherwise; "
        "not a shared one such as /dev/shm itself",
        flag="--shm-dir",
    ),
    Option(
        "memory",
        "budget",
        SizeIn(4096, 1 << 50),
        lambda: 1 << 30,
        "bytes of shared memory for all pools' regions together",
        flag="--memory-budget",
    ),
    Option(
        "memory",
        "default_pool_blocks",
        int_in(1, 1 << 31),
        lambda: 1024,
        "pool capacity in blocks when OpenSession asks for 0",
        flag="--default-pool-blocks",
    ),
    Option(
        "memory",
        "prefault",
        boolean,
        lambda: True,
        "populate region pages at creation (no page faults on the copy path)",
        flag="--prefault",
    ),
    Option(
        "memory",
        "warm_restart",
        boolean,
        lambda: True,
        "keep region files and a journal at stop so the next daemon adopts every ready "
        "block (verified by checksum) instead of starting the pool empty",
        flag="--warm-restart",
    ),
    Option(
        "memory",
        "warm_restart_checksum_bytes",
        SizeIn(0, 1 << 30),
        lambda: 64 << 10,
        "bytes of each completed row the warm-restart checksum covers: the whole row if "
        "it is not larger (0: always the whole row), else evenly spaced 4 KiB pages "
        "including the first and last",
        flag="--warm-restart-checksum-bytes",
    ),
    Option(
        "memory",
        "warm_restart_max_lag",
        DurationIn(0.01, 3600.0),
        lambda: 1.0,
        "how far the warm-restart journal may lag the completed stores: a block completed "
        "longer ago survives a crash; a batch journaled later is logged as a WARNING "
        "(kvtierd_journal_lag_seconds shows the lag)",
        flag="--warm-restart-max-lag",
    ),
    Option(
        "sessions",
        "lease",
        DurationIn(0.1, 3600.0),
        lambda: 10.0,
        "a session not kept alive this long is closed and its pins released",
        flag="--lease",
    ),
    Option(
        "sessions",
        "write_quarantine",
        DurationIn(0.0, 3600.0),
        lambda: 10.0,
        "how long the rows of a store left unfinished by an expired or closed session "
        "stay unused (its writer may still be copying into them)",
        flag="--write-quarantine",
    ),
    Option(
        "sessions",
        "max_sessions",
        int_in(1, 1 << 20),
        lambda: 4096,
        "open sessions at most",
        flag="--max-sessions",
    ),
    Option(
        "limits",
        "max_keys_per_call",
        int_in(1, 1 << 20),
        lambda: 65536,
        "keys in one RPC at most",
        flag="--max-keys-per-call",
    ),
    Option("limits", "max_pools", int_in(1, 4096), lambda: 64, "pools at most", flag="--max-pools"),
    Option(
        "limits",
        "events_retained",
        int_in(16, 1 << 24),
        lambda: 65536,
        "events each pool keeps for TakeEvents / WatchEvents",
        flag="--events-retained",
    ),
    Option(
        "limits",
        "promotion_hold",
        DurationIn(0.0, 600.0),
        lambda: 2.0,
        "how long a block promoted from a secondary tier for a Lookup (and the ready "
        "blocks that Lookup waits with) stays pinned for the engine that asked, unless a "
        "session pins it first; held blocks are never evicted ('0s' turns holds off)",
        flag="--promotion-hold",
    ),
    Option(
        "limits",
        "remote_lookup_wait",
        DurationIn(0.0, MAX_REMOTE_LOOKUP_WAIT),
        lambda: 0.005,
        "how long a Lookup whose keys miss the primary and every local tier may wait for "
        "the remote tiers (redis, a shared fs root) to say whether they hold them: what "
        "they hold answers HIT_PENDING in that Lookup; past the wait it answers MISS and "
        "the probe goes on for the next Lookup ('0s': never wait, always that path)",
        flag="--remote-lookup-wait",
    ),
    Option(
        "limits",
        "events_retained_bytes",
        # at most 1 GiB: one TakeEvents answer may carry them all, and gRPC and
        # protobuf messages stay below 2 GiB
        SizeIn(MAX_EVENT_BYTES, 1 << 30),
        lambda: 64 << 20,
        "bytes of events each pool keeps for TakeEvents / WatchEvents (each event: its "
        f"keys as sent, 2-3 bytes each beyond the key, plus {EVENT_OVERHEAD_BYTES} bytes; "
        "what they take in the daemon's memory); the oldest go first, as for events_retained",
        flag="--events-retained-bytes",
    ),
    Option(
        "limits",
        "removals_retained_bytes",
        SizeIn(64 << 10, 1 << 40),
        lambda: 16 << 20,
        "bytes of recent removals each pool remembers for Explain (keys plus "
        f"{REMOVAL_OVERHEAD_BYTES} bytes per key and {REMOVAL_RECORD_BYTES} per record "
        "it holds: what they take in the daemon's memory)",
        flag="--removals-retained-bytes",
    ),
    Option(
        "limits",
        "max_watch_streams",
        int_in(1, 1 << 16),
        lambda: 64,
        "WatchEvents streams open at once (all pools); more are refused with "
        "RESOURCE_EXHAUSTED. Shared fairly between principals: each may always open "
        "max_watch_streams / principals, more only while the free places cover the "
        "others' unused shares. A stream ended for not reading (watch_write_timeout) gives "
        "its place back at once",
        flag="--max-watch-streams",
    ),
    Option(
        "limits",
        "max_unread_watch_streams",
        int_in(1, 1 << 16),
        lambda: 64,
        "WatchEvents streams of one principal (all local callers are one without "
        "principals) that were ended for not reading and whose clients have not read "
        "that end yet; each holds its last event (up to 64 KiB) until its client reads "
        "or goes. At the limit that principal's new streams are refused with "
        "RESOURCE_EXHAUSTED",
        flag="--max-unread-watch-streams",
    ),
    Option(
        "limits",
        "watch_write_timeout",
        DurationIn(0.05, 3600.0),
        lambda: 10.0,
        "a WatchEvents stream whose client has not taken an event for this long ends "
        "with OUT_OF_RANGE; a fast lane whose client leaves its answers unread this long, "
        "or takes longer than this to send one frame, is cut (its session is left to its "
        "lease)",
        flag="--watch-write-timeout",
    ),
    *(
        Option(security_config.SECTION, o.key, abs_file_or_empty, lambda: "", o.help, flag=o.flag)
        for o in security_config.FILE_OPTIONS
    ),
    Option(
        "log",
        "level",
        choice(*LOG_LEVELS),
        lambda: "info",
        "log level: " + ", ".join(LOG_LEVELS),
        flag="--log-level",
    ),
    Option(
        "kv_events",
        "endpoint",
        event_endpoint,
        lambda: "",
        "where the KV-event publisher routers (llm-d, Dynamo) read sends vLLM's event "
        "format: tcp://HOST:PORT or ipc:///abs/path ('' = off, the default; events carry "
        "the prompts' token ids: docs/security.md)",
        flag="--kv-events-endpoint",
    ),
    Option(
        "kv_events",
        "replay_endpoint",
        event_endpoint,
        lambda: "",
        "a ROUTER socket answering replays of the recent events (what a subscriber that "
        "saw a sequence gap asks for); '' = none",
    ),
    Option(
        "kv_events",
        "connect",
        boolean,
        lambda: False,
        "connect the publisher to the endpoint (a subscriber binds it, as llm-d's "
        "indexer does) instead of binding it",
    ),
    Option(
        "kv_events",
        "pools",
        name_list,
        lambda: (),
        "the pools whose blocks are published (exact names; required with an endpoint)",
    ),
    Option(
        "kv_events",
        "model",
        topic_part,
        lambda: "default",
        "the model name each message's topic carries (kv@<identity>@<model>)",
    ),
    Option(
        "kv_events",
        "identity",
        topic_part,
        lambda: "",
        "who the topic credits (kv@<identity>@<model>; '' = the host name)",
    ),
    Option(
        "kv_events",
        "engines",
        name_list,
        lambda: (),
        "the engines of this node sharing the pools: each message is sent once per "
        "engine, topic kv@<engine>@<model> (llm-d credits each pod); empty: once, under "
        "identity (Dynamo: register the endpoint under each engine's instance id)",
    ),
    Option(
        "kv_events",
        "principal",
        plain_text,
        lambda: "",
        "with [[security.principals]]: the principal every published pool belongs to "
        "(its patterns match them, no other principal's do); required then",
    ),
    Option(
        "kv_events",
        "max_description_bytes",
        SizeIn(1 << 20, 1 << 40),
        lambda: 64 << 20,
        "memory the published pools' block descriptions (token ids, hashes) may take "
        "together; past it the least recently stored are published as removed and dropped",
    ),
    Option(
        "kv_events",
        "replay_bytes",
        SizeIn(64 << 10, 1 << 34),
        lambda: 8 << 20,
        "the recent messages kept for replays (and the most a slow subscriber's "
        "backlog holds before messages to it are dropped)",
    ),
)

SECTIONS = ("server", "memory", "sessions", "limits", "security", "log", "kv_events", "tiers")
