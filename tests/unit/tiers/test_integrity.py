"""Keyed integrity (kvtierd.tiers.integrity, .keyfiles) and the sealed header version of
kvtierd.tiers.blockformat: real key files with real modes and owners, real headers.

What a forged value through a real daemon does is in the integration tests
(tests/integration/tiers/redis/test_redis_integrity.py and the fs twin).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtierd.tiers import blockformat
from kvtierd.tiers.blockformat import CorruptBlock, IntegrityRefused
from kvtierd.tiers.configured import TierCheckError, TierOptionError
from kvtierd.tiers.fs.settings import parse_fs_settings
from kvtierd.tiers.integrity import KEY_BYTES, IntegrityKey, KeyRing, key_id_of
from kvtierd.tiers.keyfiles import load_key, load_keyring
from kvtierd.tiers.redis.settings import parse_redis_settings

FINGERPRINT = b"\x05" * blockformat.FINGERPRINT_BYTES
PAYLOAD = os.urandom(64 << 10)


def _key_file(directory: Path, name: str = "key", data: bytes | None = None, mode: int = 0o600):
    path = directory / name
    path.write_bytes(os.urandom(KEY_BYTES) if data is None else data)
    path.chmod(mode)
    return path


def _ring(*secrets: bytes) -> KeyRing:
    keys = tuple(IntegrityKey.of(s) for s in secrets)
    return KeyRing(keys[0], keys)


# -- key files --------------------------------------------------------------------------


def test_a_key_file_of_32_bytes_mode_0600_loads_with_a_stable_id(tmp_path: Path) -> None:
    path = _key_file(tmp_path)
    secret = load_key(str(path), "integrity_key_file")
    assert secret == path.read_bytes()
    assert key_id_of(secret) == key_id_of(secret) != key_id_of(os.urandom(KEY_BYTES))
    ring = load_keyring(str(path))
    assert ring is not None and ring.sealing.key_id == key_id_of(secret)
    assert secret.hex() not in repr(ring) and secret.hex() not in repr(ring.sealing)
    assert load_keyring("") is None


@pytest.mark.parametrize(
    ("data", "mode", "words"),
    [
        (os.urandom(KEY_BYTES), 0o644, "open to others (mode 0644): chmod 600"),
        (os.urandom(KEY_BYTES), 0o620, "open to others (mode 0620)"),
        (os.urandom(KEY_BYTES), 0o604, "open to others"),
        (os.urandom(KEY_BYTES - 1), 0o600, "holds 31 bytes, expected exactly 32"),
        (os.urandom(KEY_BYTES).hex().encode() + b"\n", 0o600, "holds 65 bytes, expected exactly"),
        (b"", 0o600, "holds 0 bytes"),
        (bytes(KEY_BYTES), 0o400, "only zero bytes"),
    ],
    ids=["world-readable", "group-writable", "other-readable", "short", "hex-text", "empty",
         "zeros"],
)  # fmt: skip
def test_a_key_file_that_cannot_be_trusted_is_refused_naming_the_option(
    tmp_path: Path, data: bytes, mode: int, words: str
) -> None:
    path = _key_file(tmp_path, data=data, mode=mode)
    with pytest.raises(TierCheckError) as refused:
        load_keyring(str(path))
    assert refused.value.option == "integrity_key_file"
    assert words in str(refused.value) and str(path) in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_key_path_that_is_no_regular_file_or_missing_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    for path, words in (
        (fifo, "not a regular file"),  # opened without blocking, refused by its type
        (tmp_path, "not a regular file"),
        (tmp_path / "missing", "cannot read key file"),
    ):
        with pytest.raises(TierCheckError, match=words):
            load_key(str(path), "integrity_key_file")


def test_a_key_file_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another uid takes root")
    path = _key_file(tmp_path)
    os.chown(path, 4321, -1)
    with pytest.raises(TierCheckError, match="owned by uid 4321"):
        load_key(str(path), "integrity_key_file")


def test_the_verify_key_is_checked_as_its_own_option(tmp_path: Path) -> None:
    sealing = _key_file(tmp_path, "new")
    loose = _key_file(tmp_path, "old", mode=0o644)
    with pytest.raises(TierCheckError) as refused:
        load_keyring(str(sealing), str(loose))
    assert refused.value.option == "integrity_verify_key_file"
    with pytest.raises(TierCheckError, match="the same key"):
        load_keyring(str(sealing), str(sealing))
    old = _key_file(tmp_path, "old2")
    ring = load_keyring(str(sealing), str(old))
    assert ring is not None and [k.key_id for k in ring.verifying] == [
        key_id_of(sealing.read_bytes()), key_id_of(old.read_bytes())
    ]  # fmt: skip


@pytest.mark.parametrize("parse", [parse_fs_settings, parse_redis_settings], ids=["fs", "redis"])
def test_key_options_are_absolute_paths_and_a_verify_key_needs_a_sealing_key(parse) -> None:  # noqa: ANN001
    base = {"root": "/srv/kv"} if parse is parse_fs_settings else {}
    for options, option in (
        ({"integrity_key_file": "key"}, "integrity_key_file"),
        ({"integrity_key_file": 7}, "integrity_key_file"),
        ({"integrity_verify_key_file": "/etc/old.key"}, "integrity_verify_key_file"),
    ):
        with pytest.raises(TierOptionError) as refused:
            parse({**base, **options})
        assert refused.value.key == option
    settings = parse({**base, "integrity_key_file": "/etc/k", "integrity_verify_key_file": "/o"})
    assert (settings.integrity_key_file, settings.integrity_verify_key_file) == ("/etc/k", "/o")


# -- sealed headers ---------------------------------------------------------------------


def _sealed(keys: KeyRing, payload: bytes = PAYLOAD, key: bytes = b"block") -> bytes:
    return blockformat.block_header(key=key, fingerprint=FINGERPRINT, payload=payload, keys=keys)


def _check(head: bytes, payload: bytes, keys: KeyRing | None) -> None:
    blockformat.check_payload(head, blockformat.decode_header(head), payload, keys)


def test_a_sealed_header_verifies_under_its_key_and_a_rotation_that_holds_it() -> None:
    first, second = os.urandom(KEY_BYTES), os.urandom(KEY_BYTES)
    head = _sealed(_ring(first))
    header = blockformat.decode_header(head)
    assert header.version == blockformat.KEYED_VERSION and len(head) == blockformat.HEADER_SIZE
    assert header.key_id == key_id_of(first)
    assert header.payload_checksum == blockformat.payload_checksum(PAYLOAD)  # fsck reads it keyless
    _check(head, PAYLOAD, _ring(first))
    _check(head, PAYLOAD, _ring(second, first))  # the new key seals, the old one verifies
    assert blockformat.decode_header(_sealed(_ring(second, first))).key_id == key_id_of(second)


def test_what_is_not_sealed_under_the_tiers_keys_is_refused_as_integrity() -> None:
    first, second = os.urandom(KEY_BYTES), os.urandom(KEY_BYTES)
    unkeyed = blockformat.block_header(
        key=b"block", fingerprint=FINGERPRINT, payload=PAYLOAD, keys=None
    )
    _check(unkeyed, PAYLOAD, None)  # version 1 still reads without keys
    forged = bytearray(PAYLOAD)
    forged[-1] ^= 1
    cases = [
        (unkeyed, PAYLOAD, _ring(first), "no MAC: written without an integrity key"),
        (_sealed(_ring(first)), PAYLOAD, None, "this tier has no integrity_key_file"),
        (_sealed(_ring(first)), PAYLOAD, _ring(second), "not this tier's"),
        (_sealed(_ring(first)), bytes(forged), _ring(first), "MAC mismatch"),
        # a valid value's header moved to another block's bytes: the MAC covers the payload
        (_sealed(_ring(first)), os.urandom(len(PAYLOAD)), _ring(first), "MAC mismatch"),
    ]
    for head, payload, keys, words in cases:
        with pytest.raises(IntegrityRefused, match=words):
            _check(head, payload, keys)


def test_the_mac_covers_the_header_so_no_field_of_it_can_be_changed() -> None:
    """Key, fingerprint and key id are under the MAC; the header checksum covers the MAC.
    Rewriting a field and recomputing the (unkeyed) header checksum still fails."""
    first = os.urandom(KEY_BYTES)
    head = bytearray(_sealed(_ring(first)))
    header = blockformat.decode_header(bytes(head))
    key_at = head.index(b"block")
    head[key_at : key_at + 5] = b"blocc"  # another block key, as a forger would name it
    used = blockformat.KEYED_HEADER_USED - 8
    head[used : used + 8] = blockformat.payload_checksum(bytes(head[:used])).to_bytes(8, "little")
    changed = blockformat.decode_header(bytes(head))  # the header's own checksum is fixed up
    assert changed.key == b"blocc" and changed.mac == header.mac
    with pytest.raises(IntegrityRefused, match="MAC mismatch"):
        blockformat.check_payload(bytes(head), changed, PAYLOAD, _ring(first))


def test_a_damaged_sealed_header_fails_its_checksum_like_any_header() -> None:
    head = bytearray(_sealed(_ring(os.urandom(KEY_BYTES))))
    head[blockformat.KEYED_HEADER_USED - 9] ^= 1  # a bit of the MAC
    with pytest.raises(CorruptBlock, match="header checksum mismatch"):
        blockformat.decode_header(bytes(head))
    with pytest.raises(CorruptBlock, match="header truncated"):
        blockformat.decode_header(bytes(head[: blockformat.HEADER_USED]))
