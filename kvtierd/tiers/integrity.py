"""Keyed integrity of a tier's values (docs/security.md, "Keyed integrity of shared tiers").

A tier another host can write (a Redis server, a shared fs root) cannot trust a
header it reads: anyone who can write there can compute a valid checksum over
bytes of their choosing. With ``integrity_key_file`` set, every value the tier
writes carries a MAC (keyed BLAKE3, :data:`MAC_BYTES` bytes) over its header
and payload under a secret the daemons of a fleet share, and the id of the key
(:data:`KEY_ID_BYTES` bytes, derived from the key: it reveals nothing of it).
A value read back is served only if its MAC verifies under one of the tier's
keys: the sealing key, or the one ``integrity_verify_key_file`` adds while a
fleet rotates keys. The header format is :mod:`kvtierd.tiers.blockformat`'s.

Why BLAKE3's keyed mode: a well-kept PRF built for exactly this (a 32-byte key,
no HMAC nesting), and the fastest keyed hash here: 4-5 GB/s on one core with
AVX2/AVX-512 against 1-1.3 GB/s for HMAC-SHA256 with the CPU's SHA extensions
and 0.5 GB/s for keyed BLAKE2b (``python -m benchmarks integrity``). It releases
the interpreter lock on large inputs, as xxh3 does.

The key files are read by :mod:`kvtierd.tiers.keyfiles` (at daemon start); this
module is what the I/O threads and worker processes need, and imports nothing
of the daemon (a worker process starts fast).

Threads: a :class:`KeyRing` is immutable; its methods may run on any thread or in
an I/O worker process (:meth:`KeyRing.wire` / :meth:`KeyRing.from_wire` carry it
there over the daemon's private socket pair).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import blake3

KEY_BYTES = 32
KEY_ID_BYTES = 8
MAC_BYTES = 32
_KEY_ID_CONTEXT = b"kvtierd integrity key id v1"


@dataclass(frozen=True, slots=True)
class IntegrityKey:
    """One secret and its public id."""

    secret: bytes = field(repr=False)
    key_id: bytes

    @classmethod
    def of(cls, secret: bytes) -> IntegrityKey:
        if len(secret) != KEY_BYTES:
            raise ValueError(f"an integrity key is {KEY_BYTES} bytes, got {len(secret)}")
        return cls(secret, key_id_of(secret))


@dataclass(frozen=True, slots=True)
class KeyRing:
    """The key a tier seals its writes with, and every key a value it reads may be
    sealed with (the sealing key first, then a rotation's other key)."""

    sealing: IntegrityKey
    verifying: tuple[IntegrityKey, ...]

    def find(self, key_id: bytes) -> IntegrityKey | None:
        """The key of ``key_id``, None when this ring has none of that id."""
        for key in self.verifying:
            if key.key_id == key_id:
                return key
        return None

    def ids(self) -> str:
        """The key ids in hex, for messages (``3f2a...`` and ``9c1b...``)."""
        return " and ".join(key.key_id.hex() for key in self.verifying)

    def wire(self) -> tuple[bytes, tuple[bytes, ...]]:
        """The ring as builtins (``marshal``: an I/O worker request)."""
        return self.sealing.secret, tuple(key.secret for key in self.verifying)

    @staticmethod
    def from_wire(wire: tuple[bytes, tuple[bytes, ...]] | None) -> KeyRing | None:
        """The ring :meth:`wire` gave (None for None); memoized: a worker process
        rebuilds each ring once, not per request."""
        return None if wire is None else _ring_of(wire[0], tuple(wire[1]))

    def __repr__(self) -> str:
        return f"KeyRing(seals with {self.sealing.key_id.hex()}, verifies {self.ids()})"


@functools.lru_cache(maxsize=8)
def _ring_of(sealing: bytes, verifying: tuple[bytes, ...]) -> KeyRing:
    return KeyRing(IntegrityKey.of(sealing), tuple(IntegrityKey.of(s) for s in verifying))


def key_id_of(secret: bytes) -> bytes:
    """The public id of ``secret``: a MAC of a constant under it (reveals nothing)."""
    return blake3.blake3(_KEY_ID_CONTEXT, key=secret).digest(length=KEY_ID_BYTES)


def mac(
    secret: bytes, header: bytes | memoryview, payload: bytes | bytearray | memoryview
) -> bytes:
    """Keyed BLAKE3 of ``header`` then ``payload`` under ``secret`` (one thread: the
    tier's I/O threads and worker processes are the parallelism)."""
    hasher = blake3.blake3(header, key=secret, max_threads=1)
    hasher.update(payload)
    return hasher.digest(length=MAC_BYTES)
