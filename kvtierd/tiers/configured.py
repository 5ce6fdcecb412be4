"""The configured-tier contract: what the daemon holds for one ``[[tiers]]`` table.

A tier type (``fs``, ``redis``) brings three things, registered by name in
:mod:`kvtierd.tiers.registry`:

* a frozen settings dataclass (:class:`TierSettings`) and a pure parser of a
  ``[[tiers]]`` table into it, raising :class:`TierOptionError` naming the option;
* a :class:`ConfiguredTier` subclass: one instance per configured tier for the
  daemon's whole life, holding what the pools of that tier share (threads,
  worker processes, a byte budget); the I/O threads, what drains and stops them
  and what a stop dropped are the base class's (:meth:`ConfiguredTier.io_pool`);
* the per-pool tier it creates (a :class:`~kvtierd.tiers.base.SecondaryTier`,
  not started: its start has two steps, ``prepare`` and ``launch``).

Lifecycle, all on the event loop unless said otherwise::

    daemon start     ConfiguredTier.check()          refuses unusable resources
                     (a takeover: check_unlocked(), then lock() once the daemon
                     it replaces has exited)
    per pool         ConfiguredTier.create(...)      no I/O
                     SecondaryTier.prepare()         blocking: off the loop
                     SecondaryTier.launch()          starts threads; jobs may come
    daemon shutdown  ConfiguredTier.drain()          every pool's jobs reported
                     ConfiguredTier.shutdown()       joins shared threads

Errors: :class:`TierOptionError` (configuration; exit code 2),
:class:`TierCheckError` (``check``: exit code 2, naming the option), and
:class:`TierStartError` (``prepare``: the pool is refused with
FAILED_PRECONDITION and the message).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from kvtierd.primary.rows import RegionRows
from kvtierd.tiers.base import JobCallback, SecondaryTier
from kvtierd.tiers.budget import WRITE_BUDGET_OPTION, WriteBudget, write_budget
from kvtierd.tiers.iopool import IoPool
from kvtierd.util.units import format_size


class TierOptionError(ValueError):
    """A bad tier option; ``key`` is the option's name inside its ``[[tiers]]`` table."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.message = message


class TierCheckError(Exception):
    """A configured tier cannot run (its root is missing, say); ``option`` names the
    option at fault inside its ``[[tiers]]`` table, the message names the resource."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


class TierStartError(Exception):
    """A tier cannot start for one pool (its directory describes another pool, say);
    the pool is refused with this message."""


class TierSettings(Protocol):
    """What the daemon needs from any tier type's settings dataclass."""

    def exclusive(self) -> Mapping[str, object]:
        """Option values no two configured tiers may share (``{"root": "/x"}``)."""
        ...

    def describe(self) -> str:
        """One line for the daemon's start log."""
        ...


@dataclass(frozen=True, slots=True)
class PoolBinding:
    """What a pool gives each tier created for it.

    ``region_buffer`` is the pool's whole region (rows of ``block_bytes``); the
    tier touches a row only while a job of it runs (see :mod:`kvtierd.tiers.base`),
    and in the daemon's process only through ``region_rows`` (system calls: a
    client that truncates the region fails a copy, never kills the daemon; None:
    the tier makes one of ``region_buffer`` and closes it at its shutdown).
    ``region_file`` (path, st_dev, st_ino) lets a tier map the region in another
    process; None when the region has no file.
    """

    pool_name: str
    block_bytes: int
    layout: Any  # JSON-serialisable: what the bytes of a row mean
    region_buffer: memoryview
    region_file: tuple[str, int, int] | None = None
    region_rows: RegionRows | None = None


class ConfiguredTier(abc.ABC):
    """One configured tier of the daemon: its settings and what its pools share.

    Constructed by the registry as ``cls(name, settings)`` from a parsed
    ``[[tiers]]`` table; lives as long as the daemon. Event-loop only.
    """

    type_name: ClassVar[str]  # the ``type`` of its ``[[tiers]]`` tables

    def __init__(self, name: str, settings: TierSettings) -> None:
        self.name = name  # the tier's label in statistics and logs
        self.settings = settings
        self._io: IoPool | None = None  # the pools' I/O threads, from the first io_pool()
        # the cascades' write budget, shared by every pool of the tier (None: no budget;
        # a tier type without the option has none)
        self.write_budget: WriteBudget | None = write_budget(
            getattr(settings, WRITE_BUDGET_OPTION, 0)
        )

    def describe(self) -> str:
        """One line for the daemon's start log (with the write budget, if any)."""
        if self.write_budget is None:
            return self.settings.describe()
        rate = format_size(self.write_budget.rate)
        return f"{self.settings.describe()}, cascade writes at most {rate}/s"

    @abc.abstractmethod
    def check(self) -> None:
        """At daemon start: raises TierCheckError unless the tier's resources are
        usable (a real probe where permission bits could lie). May block briefly."""

    def check_unlocked(self) -> None:
        """:meth:`check` without taking what only one daemon may hold at a time (an
        fs root's lock): a takeover takes that with :meth:`lock` once the daemon it
        replaces has exited (docs/operations/upgrades.md). Default: :meth:`check`."""
        self.check()

    def lock(self) -> None:
        """Takes what :meth:`check_unlocked` left out; TierCheckError when another
        daemon holds it. Default: nothing to take."""
        return None

    @abc.abstractmethod
    def create(
        self, pool: PoolBinding, on_done: JobCallback, loop: asyncio.AbstractEventLoop
    ) -> SecondaryTier:
        """A tier for ``pool``, not started (no I/O here). ``on_done`` receives each
        of its job results on ``loop``."""

    def io_pool(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        read_threads: int,
        write_threads: int,
        max_queue_jobs: int,
        max_queue_bytes: int,
    ) -> IoPool:
        """The I/O threads every pool of this tier runs its jobs on (``kvtierd-<name>-r<i>``
        and ``-w<i>``), started at the first call (the first :meth:`create`); later
        calls return the same pool whatever they ask."""
        if self._io is None:
            self._io = IoPool(
                loop,
                read_threads=read_threads,
                write_threads=write_threads,
                max_queue_jobs=max_queue_jobs,
                max_queue_bytes=max_queue_bytes,
                name=f"kvtierd-{self.name}",
            )
        return self._io

    async def drain(self) -> None:
        """Returns once every job submitted so far to this tier's pools reported: its
        I/O pool delivered every batch (a tier type whose pools run no jobs on one
        overrides this)."""
        if self._io is not None:
            await self._io.drain()

    def shutdown(self) -> None:
        """Stops what the pools share (threads, processes) once every pool's tier
        has shut down; queued jobs are reported failed. Idempotent. Here: fails the
        I/O pool's queued jobs and joins its threads (running ones finish); a
        subclass stops what else it holds around this call."""
        if self._io is not None:
            self._io.shutdown()

    @property
    def dropped_jobs(self) -> int:
        """Jobs :meth:`shutdown` failed because they had not started yet (what a stop
        dropped: cascades not written, promotions not served)."""
        return self._io.dropped_batches if self._io is not None else 0
