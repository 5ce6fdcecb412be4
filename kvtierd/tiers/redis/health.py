"""What the redis tier knows of its server's health: reachable nodes, round trips,
memory and evictions, summed over the masters (``RedisLink.refresh_health`` reads each
master's ``INFO memory`` and ``INFO stats``; :func:`summarize` adds them up)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# one master's answers: (INFO memory, INFO stats), parsed
NodeInfo = tuple[dict[str, Any], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class ServerHealth:
    """The server as last seen by :meth:`RedisLink.refresh_health` (and between two
    refreshes, the round-trip average kept by every probe).

    ``max_memory_bytes`` is ``maxmemory`` summed over the reachable masters, 0 when
    one of them has none (unbounded: the server grows until its host's RAM);
    ``system_memory_bytes`` the RAM of their hosts (a bound when unbounded).
    ``evicted_keys`` is the servers' cumulative eviction count: when it grows the
    tiers re-probe what they hold (a write never stays for sure).
    """

    mode: str = "unknown"  # "standalone", "cluster" or "unknown" (not reached yet)
    nodes_known: int = 0  # masters in the slot map (1 standalone)
    nodes_reachable: int = 0  # of them, those that answered the last refresh
    round_trip_us: int = 0  # running average of small-command round trips
    max_memory_bytes: int = 0
    used_memory_bytes: int = 0
    system_memory_bytes: int = 0
    evicted_keys: int = 0

    def stats_gauges(self) -> dict[str, int]:
        """What :class:`~kvtierd.tiers.base.TierStats` shows of it, by field name."""
        return {
            "nodes_known": self.nodes_known,
            "nodes_reachable": self.nodes_reachable,
            "round_trip_us": self.round_trip_us,
            "server_capacity_bytes": self.max_memory_bytes,
            "server_used_bytes": self.used_memory_bytes,
        }


def summarize(mode: str, nodes_known: int, answers: Sequence[NodeInfo]) -> ServerHealth:
    """The health of a server whose ``nodes_known`` masters gave ``answers`` (one per
    master that answered). A master without ``maxmemory`` makes the whole server
    unbounded (``max_memory_bytes`` 0)."""
    limits = [int(memory.get("maxmemory", 0) or 0) for memory, _ in answers]
    return ServerHealth(
        mode=mode,
        nodes_known=nodes_known,
        nodes_reachable=len(answers),
        max_memory_bytes=0 if 0 in limits else sum(limits),
        used_memory_bytes=sum(int(memory.get("used_memory", 0) or 0) for memory, _ in answers),
        system_memory_bytes=sum(
            int(memory.get("total_system_memory", 0) or 0) for memory, _ in answers
        ),
        evicted_keys=sum(int(stats.get("evicted_keys", 0) or 0) for _, stats in answers),
    )
