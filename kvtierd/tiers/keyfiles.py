"""Integrity key files (docs/security.md, "Keyed integrity of shared tiers"): read at
daemon start into a :class:`~kvtierd.tiers.integrity.KeyRing`.

Key files hold exactly :data:`~kvtierd.tiers.integrity.KEY_BYTES` random bytes
(``head -c 32 /dev/urandom``). :func:`load_key` refuses, naming the option (exit
code 2 at start): a file others may read or write (or owned by another user than
the daemon's or root), one that is not a regular file (opened without blocking),
one of another length, and an all-zero key. Links are followed (a Kubernetes
secret volume is made of them) and the file they reach is checked.
"""

from __future__ import annotations

import errno
import os
import stat

from kvtierd.tiers.configured import TierCheckError
from kvtierd.tiers.integrity import KEY_BYTES, IntegrityKey, KeyRing
from kvtierd.tiers.options import SEAL_OPTION, VERIFY_OPTION

_MAKE_ONE = "make one with: head -c 32 /dev/urandom > FILE; chmod 600 FILE"


def integrity_words(keys: KeyRing | None, shared: bool) -> str:
    """The start log's words about a tier's keys: their ids (every daemon of a fleet
    should log the same), or, for a tier others can write (``shared``), that it has
    none."""
    if keys is None:
        return "; no integrity_key_file: values any writer makes are served" if shared else ""
    also = f", verifying {keys.verifying[1].key_id.hex()} too" if len(keys.verifying) > 1 else ""
    return f"; values sealed with integrity key {keys.sealing.key_id.hex()}{also}"


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
