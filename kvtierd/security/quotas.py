"""Per-principal memory quotas.

A principal's ``memory_quota`` bounds the region bytes of the pools its
patterns match, together: the pools it may open, whoever created them. A new
pool is admitted only if, for every principal with a quota whose patterns
match it, the pools already matched (created and being created) plus the new
one fit that quota. The check runs in the same event-loop turn that charges
the pool to the global budget (``PoolTable``), so two creations can never both
fit the last free bytes of a quota.

Pools live until the daemon stops, so a quota is given back only by a restart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvtierd.errors import ResourceExhausted
from kvtierd.security.principals import Principal
from kvtierd.util.units import format_bytes


class PoolQuotas:
    """Immutable: built from the configured principals."""

    def __init__(self, principals: Sequence[Principal]) -> None:
        self._limited = tuple(p for p in principals if p.memory_quota > 0)

    def __bool__(self) -> bool:
        return bool(self._limited)

    def check(self, pool: str, size: int, charged: Mapping[str, int]) -> None:
        """Raises ``ResourceExhausted`` with the numbers when the new pool ``pool``
        of ``size`` bytes does not fit a quota. ``charged``: bytes of every pool
        that exists or is being created, by name (``pool`` not among them)."""
        for principal in self._limited:
            if not principal.may_reach(pool):
                continue
            mine = {name: size for name, size in charged.items() if principal.may_reach(name)}
            used = sum(mine.values())
            if used + size <= principal.memory_quota:
                continue
            raise ResourceExhausted(
                f"pool {pool!r} needs {format_bytes(size)} but principal {principal.name!r} has a "
                f"memory_quota of {format_bytes(principal.memory_quota)} and its pools "
                f"({principal.describe_pools()}) take {format_bytes(used)} in {len(mine)} "
                f"pools ({', '.join(sorted(mine)) or 'none'}); free "
                f"{format_bytes(max(principal.memory_quota - used, 0))}. Ask for fewer blocks "
                "or raise memory_quota"
            )
