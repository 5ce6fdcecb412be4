"""Keyed integrity of a tier's values (docs/security.md, "Keyed integrity of shared tiers").

A tier another host can write (a Redis server, a shared fs root) cannot trust a
header it reads: anyone who can write there can compute a valid checksum over
bytes of their choosing. With ``integrity_key_file`` set, every value the tier
writes carries a MAC (keyed BLAKE3, :data:`MAC_BYTES` bytes) over its header
and payload under a secret the daemons of a fleet share, and the id of the key
(:data:`KEY_ID_BYTES` bytes, derived from the key: it reveals nothing of it).
A value read back is served only if its MAC verifies under one of the tier's
keys: the sealing key, or the one ``integrity_verify_key_file`` adds while a
fleet rotates keys. The header format is :mod:`kvtierd.tiers.fs.fsformat`'s.

Why BLAKE3's keyed mode: a well-kept PRF built for exactly this (a 32-byte key,
no HMAC nesting), and the fastest keyed hash here: 4-5 GB/s on one core with
AVX2/AVX-512 against 1-1.3 GB/s for HMAC-SHA256 with the CPU's SHA extensions
and 0.5 GB/s for keyed BLAKE2b (``python -m benchmarks integrity``). It releases
the interpreter lock on large inputs, as xxh3 does.

Key files hold exactly :data:`KEY_BYTES` random bytes (``head -c 32 /dev/urandom``).
:func:`load_key` refuses, naming the option: a file others may read or write (or
owned by another user than the daemon's or root), one that is not a regular
file, one of another length, and an all-zero key. Links are followed (a
Kubernetes secret volume is made of them) and the file they reach is checked.

Threads: a :class:`KeyRing` is immutable; its methods may run on any thread or in
an I/O worker process (:meth:`KeyRing.wire` / :meth:`KeyRing.from_wire` carry it
there over the daemon's private socket pair).
"""

from __future__ import annotations

import errno
import functools
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import blake3

from kvtierd.tiers.configured import TierCheckError, TierOptionError

KEY_BYTES = 32
KEY_ID_BYTES = 8
MAC_BYTES = 32
SEAL_OPTION = "integrity_key_file"
VERIFY_OPTION = "integrity_verify_key_file"
_KEY_ID_CONTEXT = b"kvtierd integrity key id v1"
_MAKE_ONE = "make one with: head -c 32 /dev/urandom > FILE; chmod 600 FILE"


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


def integrity_words(keys: KeyRing | None, shared: bool) -> str:
    """The start log's words about a tier's keys: their ids (every daemon of a fleet
    should log the same), or, for a tier others can write (``shared``), that it has
    none."""
    if keys is None:
        return "; no integrity_key_file: values any writer makes are served" if shared else ""
    also = f", verifying {keys.verifying[1].key_id.hex()} too" if len(keys.verifying) > 1 else ""
    return f"; values sealed with integrity key {keys.sealing.key_id.hex()}{also}"


# -- options ------------------------------------------------------------------------------


def parse_key_options(options: Mapping[str, Any]) -> dict[str, str]:
    """The two key file options of a ``[[tiers]]`` table, checked as text (absolute
    paths; a verify key needs a sealing key). Raises TierOptionError naming one."""
    values: dict[str, str] = {}
    for name in (SEAL_OPTION, VERIFY_OPTION):
        if name not in options:
            continue
        path = options[name]
        if not isinstance(path, str) or (path and not os.path.isabs(path)):
            raise TierOptionError(name, f"expected an absolute path, got {path!r}")
        values[name] = path
    if values.get(VERIFY_OPTION) and not values.get(SEAL_OPTION):
        raise TierOptionError(
            VERIFY_OPTION, f"a key that only verifies needs {SEAL_OPTION} (the key that seals)"
        )
    return values


def load_keyring(seal_path: str, verify_path: str = "") -> KeyRing | None:
    """The tier's keys from its key files (None without ``integrity_key_file``).
    Raises TierCheckError naming the option of the file at fault."""
    if not seal_path:
        return None
    sealing = IntegrityKey.of(load_key(seal_path, SEAL_OPTION))
    verifying = [sealing]
    if verify_path:
        other = IntegrityKey.of(load_key(verify_path, VERIFY_OPTION))
        if other.key_id == sealing.key_id:
            raise TierCheckError(
                VERIFY_OPTION, f"{verify_path} holds the same key as {SEAL_OPTION} {seal_path}"
            )
        verifying.append(other)
    return KeyRing(sealing, tuple(verifying))


def load_key(path: str, option: str) -> bytes:
    """The :data:`KEY_BYTES`-byte secret in ``path``; TierCheckError(option) when the
    file cannot be trusted or holds something else (module doc)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise TierCheckError(
            option, f"cannot read key file {path}: {exc.strerror or exc}"
        ) from None
    try:
        st = os.fstat(fd)
        _check_file(path, option, st)
        data = os.read(fd, KEY_BYTES + 1)
    except OSError as exc:
        reason = "a directory" if exc.errno == errno.EISDIR else exc.strerror or str(exc)
        raise TierCheckError(option, f"cannot read key file {path}: {reason}") from None
    finally:
        os.close(fd)
    if len(data) != KEY_BYTES:
        size = f"{st.st_size}" if len(data) > KEY_BYTES else f"{len(data)}"
        raise TierCheckError(
            option,
            f"key file {path} holds {size} bytes, expected exactly {KEY_BYTES} random bytes "
            f"({_MAKE_ONE})",
        )
    if data == bytes(KEY_BYTES):
        raise TierCheckError(option, f"key file {path} holds only zero bytes: not a secret")
    return data


def _check_file(path: str, option: str, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise TierCheckError(option, f"key file {path} is not a regular file ({_MAKE_ONE})")
    if st.st_mode & 0o077:
        raise TierCheckError(
            option,
            f"key file {path} is open to others (mode {stat.S_IMODE(st.st_mode):04o}): "
            f"chmod 600 {path}",
        )
    if st.st_uid not in (0, os.geteuid()):
        raise TierCheckError(
            option,
            f"key file {path} is owned by uid {st.st_uid}, not by the daemon's user "
            f"(uid {os.geteuid()}) or root",
        )
