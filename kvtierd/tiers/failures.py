"""Why a block did not load: one classification for every tier (docs/design/tiers.md,
"Failed promotions").

A tier that fails to load a block meets an exception on its I/O thread; what that
means for the block is decided here, once, so that no tier deletes a good block
for a fault of its own machinery, and so that the tiering and ``Explain`` tell
the same story whichever tier it was:

========= ========================================= =====================================
kind      what happened                             what follows
========= ========================================= =====================================
MISSING   the tier holds no block under the key     dropped from what the tier knows;
          (a file removed, a value evicted)         a plain MISS, promoted again as soon
                                                    as the tier holds the key again
CORRUPT   the block's bytes failed verification    the tier removes that copy and counts
                                                    it (``checksum_failures``,
                                                    ``integrity_failures``); MISS
TRANSIENT the I/O could not be done now: an I/O     nothing removed, nothing counted
          worker stalled past io_worker_timeout     against the block; MISS now, and the
          and was killed, or died; the tier's I/O   key is promoted again after a short
          shut down; a server timed out or could    retry window (the tiering's
          not be reached                            ``TRANSIENT_RETRY_AFTER``)
FAULT     anything else (permission refused, EIO,   the block is kept; not promoted from
          a row the client cut short)               that tier again for a while
                                                    (``PROMOTION_RETRY_AFTER``)
========= ========================================= =====================================

A tier says which of its errors are which by raising (subclasses of) the marker
exceptions below, and, for a medium whose client library has exceptions of its own
(redis-py), with an ``outage`` function naming those that mean "not now".
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtierd.contract import BlockKey

CAUSE_MAX_CHARS = 160  # a transient cause kept for Explain is cut to this (bounded memory)


class LoadFailure(enum.Enum):
    """The four ways a block can fail to load (module docstring)."""

    MISSING = "missing"
    CORRUPT = "corrupt"
    TRANSIENT = "transient"
    FAULT = "fault"


class BlockAbsent(Exception):
    """Marker: the tier holds no block under the key (:attr:`LoadFailure.MISSING`)."""


class BlockRefused(Exception):
    """Marker: the block's bytes failed verification (:attr:`LoadFailure.CORRUPT`)."""


class IoUnavailable(Exception):
    """Marker: the I/O could not be done now; nothing is known against the block
    (:attr:`LoadFailure.TRANSIENT`). ``cause`` says why in a few words, the same for
    every instance of a subclass (Explain shows it)."""

    cause = "the tier's I/O could not be done now"


Outage = Callable[[BaseException], str | None]
"""A tier's own test for errors of its medium that mean "not now": the cause in a few
words, or None when ``error`` is not one."""


def classify(error: BaseException, outage: Outage | None = None) -> LoadFailure:
    """What ``error``, met loading one block, means for that block (module docstring).

    Builtin ``TimeoutError`` and ``ConnectionError`` are transient; so is whatever
    ``outage`` recognises. ``FileNotFoundError`` is a missing block."""
    if isinstance(error, BlockRefused):
        return LoadFailure.CORRUPT
    if isinstance(error, (BlockAbsent, FileNotFoundError)):
        return LoadFailure.MISSING
    if transient_cause(error, outage) is not None:
        return LoadFailure.TRANSIENT
    return LoadFailure.FAULT


def transient_cause(error: BaseException, outage: Outage | None = None) -> str | None:
    """Why ``error`` is transient, in a few words; None when it is not."""
    if isinstance(error, IoUnavailable):
        return error.cause
    if outage is not None and (cause := outage(error)) is not None:
        return cause
    if isinstance(error, TimeoutError):
        return "the medium did not answer in time"
    if isinstance(error, ConnectionError):
        return "the connection to the medium failed"
    return None


@dataclass(frozen=True, slots=True)
class FailedLoads:
    """The failed keys of one load job that are not plain failures: ``missing`` (the
    tier holds no block) and ``transient`` (the I/O could not be done now), in job
    order; ``cause``: why the first transient one failed, at most
    :data:`CAUSE_MAX_CHARS` characters ("" when none did)."""

    missing: tuple[BlockKey, ...] = ()
    transient: tuple[BlockKey, ...] = ()
    cause: str = ""


NONE_FAILED = FailedLoads()  # a job whose every key loaded (or a store job)


def sort_failed(
    keys: Sequence[BlockKey],
    errors: Sequence[BaseException | None],
    outage: Outage | None = None,
) -> FailedLoads:
    """Sorts a load job's failed keys (``errors`` co-indexed with ``keys``; None:
    loaded) into :class:`FailedLoads`; corrupt and faulty keys are in neither."""
    missing: list[BlockKey] = []
    transient: list[BlockKey] = []
    cause = ""
    for key, error in zip(keys, errors, strict=True):
        if error is None:
            continue
        kind = classify(error, outage)
        if kind is LoadFailure.MISSING:
            missing.append(key)
        elif kind is LoadFailure.TRANSIENT:
            transient.append(key)
            cause = cause or (transient_cause(error, outage) or "")[:CAUSE_MAX_CHARS]
    return FailedLoads(tuple(missing), tuple(transient), cause)
