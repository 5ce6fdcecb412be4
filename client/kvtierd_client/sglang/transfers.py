"""The data path of one generation: look pages up, load them, store them.

Each function makes the daemon calls of one SGLang batch through the
generation's session and copies in the calling thread. Round trips per batch
(128 pages in SGLang): :func:`count_leading` one ``Lookup``; :func:`load_pages`
one ``Lookup`` that pins (plus one more per wait for pages a secondary tier is
still promoting); :func:`store_pages` one ``PrepareStore``. The completions
(``CompleteLoad``, ``CompleteStore``) are queued by the session and ride on its
next call, or go alone within 5 ms.

What is reported loaded: only a page whose key the daemon answered ``HIT`` and
pinned for this session (a block a writer completed, or one a secondary tier
promoted after verifying its checksum), copied while the session's lease was
proven (the copy engine's fence: a copy that could not start, or that ended past
the lease deadline, counts as not loaded). What is reported stored: a page whose
key was present already, or whose row this session reserved, filled within the
lease and completed.

Errors: ``KvtierError`` from a daemon call propagates (the caller turns it into
misses); ``ValueError`` for host indices that are not whole pages of the pool.
Whatever this module pinned or reserved before an error is released or failed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from kvtierd_client.client import Session
from kvtierd_client.copy_engine import LeaseLostError
from kvtierd_client.sglang.link import Generation
from kvtierd_client.types import BlockDescription, LookupResult

__all__ = [
    "count_leading",
    "flat_bytes",
    "load_flat",
    "load_pages",
    "pin_leading",
    "pages_of",
    "store_flat",
    "store_pages",
]

_SERVABLE = (LookupResult.HIT, LookupResult.HIT_PENDING)
Describe = Callable[[Sequence[bytes]], "list[BlockDescription | None] | None"]
"""Keys -> one description (or None) each, or None when none is described."""
MAX_POLL_DELAY = 0.05  # seconds between two looks at pages being promoted


def pages_of(host_indices: torch.Tensor, count: int, page_size: int) -> list[int]:
    """The host pages of ``count`` pages' token slots (``count * page_size`` of them,
    each page's slots consecutive from a page boundary, as SGLang allocates them).

    Raises ValueError naming what is wrong otherwise.
    """
    flat = host_indices.reshape(-1).to("cpu", torch.int64)
    if flat.numel() != count * page_size:
        raise ValueError(
            f"host_indices has {flat.numel()} token slots for {count} keys of {page_size} tokens"
        )
    if count == 0:
        return []
    by_page = flat.view(count, page_size)
    starts = by_page[:, 0]
    expected = starts.unsqueeze(1) + torch.arange(page_size, dtype=torch.int64)
    if bool((starts % page_size != 0).any()) or not torch.equal(by_page, expected):
        raise ValueError("host_indices are not whole pages (page-aligned consecutive slots)")
    return (starts // page_size).tolist()


def count_leading(gen: Generation, keys: Sequence[bytes]) -> int:
    """How many leading keys the pool holds or is bringing in (HIT or HIT_PENDING:
    a secondary tier's promotion starts now). One ``Lookup`` round trip."""
    results = gen.session.lookup(_unique_prefix(keys), prefix=True)
    return next((i for i, r in enumerate(results) if r not in _SERVABLE), len(results))


def pin_leading(
    gen: Generation,
    keys: Sequence[bytes],
    *,
    wait: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], object] = time.sleep,
) -> list[int]:
    """Pins the leading keys the pool holds for this session; returns their rows.

    A key the pool is still bringing in (HIT_PENDING: a secondary tier's promotion,
    or another session's store whose completion is on its way) is looked at again,
    with growing pauses, for at most ``wait`` seconds. One pinning ``Lookup`` when
    nothing is pending.
    """
    rows: list[int] = []
    deadline = clock() + wait
    delay = 0.002
    while len(rows) < len(keys):
        results, ids = gen.session.lookup_and_pin(keys[len(rows) :], prefix=True)
        got = next((i for i, row in enumerate(ids) if row < 0), len(ids))
        rows += ids[:got]
        if len(rows) == len(keys) or results[got] is not LookupResult.HIT_PENDING:
            break
        left = deadline - clock()
        if left <= 0:
            break
        sleep(min(delay, left))
        delay = min(delay * 2, MAX_POLL_DELAY)
    return rows


def load_pages(gen: Generation, keys: Sequence[bytes], pages: Sequence[int], *, wait: float) -> int:
    """Copies the leading pages the pool holds into host ``pages``; returns how many
    (see :func:`pin_leading` for ``wait``)."""
    keys = _unique_prefix(keys)
    session = gen.session
    rows = pin_leading(gen, keys, wait=wait)
    if not rows:
        return 0
    loaded = False
    try:
        with gen.engine() as engine:
            engine.submit_load(
                list(zip(rows, pages[: len(rows)], strict=True)),
                lease_deadline=session.lease_deadline,
            )
            loaded = not engine.late_jobs()
    except LeaseLostError:
        loaded = False
    finally:
        session.complete_load(list(keys[: len(rows)]), unused=not loaded)
    return len(rows) if loaded else 0


def store_pages(
    gen: Generation, keys: Sequence[bytes], pages: Sequence[int], describe: Describe | None = None
) -> list[bool]:
    """Stores host ``pages`` under ``keys``: one per key, True where the pool holds
    it afterwards (present already, or written and completed now). ``describe``:
    the descriptions the written keys are completed with (``kvtierd_events``)."""
    session = gen.session
    unique = dict(zip(keys, pages, strict=True))  # a repeated key: its first page
    grant = session.prepare_store(list(unique))
    if grant is None:  # no room: nothing was reserved
        return [False] * len(keys)
    rows = dict(zip(grant.keys_to_store, grant.block_ids, strict=True))
    pairs = [(unique[key], row) for key, row in rows.items()]
    stored = False
    try:
        if pairs:
            with gen.engine() as engine:
                engine.submit_store(pairs, lease_deadline=session.lease_deadline)
                stored = not engine.late_jobs()
        else:
            stored = True
    except LeaseLostError:
        stored = False
    finally:
        if grant.keys_to_store:
            _complete_store(session, grant.keys_to_store, stored, describe)
    return [stored or key not in rows for key in keys]


# -- SGLang's generic path: one flat page per key, outside the host pool ---------------


def load_flat(
    gen: Generation,
    keys: Sequence[bytes],
    targets: Sequence[torch.Tensor],
    page_bytes: int,
    *,
    wait: float,
) -> int:
    """Copies the leading rows the pool holds into the flat pages ``targets``
    (each ``page_bytes`` long); returns how many (see :func:`pin_leading`)."""
    keys = _unique_prefix(keys)
    session = gen.session
    rows = pin_leading(gen, keys, wait=wait)
    got = len(rows)
    if got == 0:
        return 0
    loaded = False
    try:
        if session.lease_deadline > time.monotonic():
            region = gen.region.tensor
            for row, target in zip(rows, targets, strict=False):
                flat_bytes(target, page_bytes).copy_(region[row, :page_bytes])
            loaded = time.monotonic() < session.lease_deadline
    finally:
        session.complete_load(list(keys[:got]), unused=not loaded)
    return got if loaded else 0


def store_flat(
    gen: Generation,
    keys: Sequence[bytes],
    values: Sequence[torch.Tensor],
    page_bytes: int,
    describe: Describe | None = None,
) -> bool:
    """Stores the flat pages ``values`` under ``keys``; True when the pool holds all."""
    session = gen.session
    unique = dict(zip(keys, values, strict=True))
    grant = session.prepare_store(list(unique))
    if grant is None:
        return False
    stored = False
    try:
        if session.lease_deadline > time.monotonic():
            region = gen.region.tensor
            for key, row in zip(grant.keys_to_store, grant.block_ids, strict=True):
                region[row, :page_bytes].copy_(flat_bytes(unique[key], page_bytes))
            stored = time.monotonic() < session.lease_deadline
    finally:
        if grant.keys_to_store:
            _complete_store(session, grant.keys_to_store, stored, describe)
    return stored


def describe_loaded(
    gen: Generation, keys: list[bytes], descriptions: Sequence[BlockDescription]
) -> None:
    """``complete_store`` of loaded (ready) ``keys`` with their descriptions: the
    daemon ignores the completion and announces them (queued: no round trip of its
    own). Never call it while this session holds a reservation of one of them."""
    gen.session.complete_store(keys, success=True, descriptions=descriptions)


def _complete_store(
    session: Session, keys: list[bytes], stored: bool, describe: Describe | None
) -> None:
    """``complete_store``, the written keys with their descriptions when there are any."""
    described = describe(keys) if stored and describe is not None else None
    if described is None:
        session.complete_store(keys, success=stored)
    else:
        session.complete_store(keys, success=stored, descriptions=described)


def flat_bytes(tensor: torch.Tensor, page_bytes: int) -> torch.Tensor:
    """``tensor`` (a contiguous CPU flat page) as ``page_bytes`` uint8, without a copy."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"a flat page must be a contiguous CPU tensor, got {tensor.device}")
    flat = tensor.view(-1).view(torch.uint8)
    if flat.numel() != page_bytes:
        raise ValueError(
            f"a flat page of {flat.numel()} bytes; this pool's pages have {page_bytes}"
        )
    return flat


def _unique_prefix(keys: Sequence[bytes]) -> list[bytes]:
    """``keys`` up to the first repeated one (a prefix chain never repeats a key; the
    daemon refuses a call that names one twice)."""
    seen: set[bytes] = set()
    for i, key in enumerate(keys):
        if key in seen:
            return list(keys[:i])
        seen.add(key)
    return list(keys)
