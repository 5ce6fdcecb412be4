"""Keyed integrity of redis values (docs/security.md, "Keyed integrity of shared tiers"),
through real daemons and a real redis-server.

Anyone who can write to the server can compute a valid unkeyed header for any key
over bytes of their choosing; a daemon with ``integrity_key_file`` serves a value
only if it is sealed under one of its keys. Everything else is a MISS, counted in
``integrity_failures`` and deleted; a genuine value of the fleet is still served
bit-exact by every daemon holding the key, and during a rotation by those holding
either key.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from daemon_harness import DaemonProcess, eventually
from engine_harness import HIT, MISS, Engine, block_keys, payload
from integrity_harness import forged, header_of, key_id, write_key
from redis_harness import RedisServer, promoted, redis_config, redis_key

from kvtierd.tiers import blockformat


@pytest.fixture
def fleet_key(tmp_path: Path) -> Path:
    return write_key(tmp_path / "fleet.key")


def _refused(engine: Engine, key: bytes, failures: int, counter: str = "integrity") -> None:
    """Looks ``key`` up (each lookup moves its probe and promotion along) until the
    tier counted ``failures`` ``<counter>_failures``; the key then answers MISS."""

    def counted() -> bool:
        engine.session.lookup([key])
        return getattr(engine.tier_stats(), f"{counter}_failures") >= failures

    eventually(counted, 20.0, lambda: f"{failures} {counter} failures; {engine.tier_stats()}",
               interval=0.01)  # fmt: skip
    assert engine.wait_settled([key]) == [MISS]


def test_a_forged_value_with_a_valid_header_is_never_served(
    redis_server: RedisServer,
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
    fleet_key: Path,
    tmp_path: Path,
):
    """Three forgeries of a writer of the server who lacks the fleet's key: a valid
    unkeyed header (what the earlier wave's strict xfail showed served), a header sealed
    under the forger's own key, and a genuine value of another key under this key's
    name (its header names the other key, under the MAC: a mix-up, counted in
    ``checksum_failures``). None is served; each is counted and deleted, so the
    genuine value written afterwards (SET NX: the forgery no longer squats the key)
    goes in; a genuine value is served bit-exact by the other daemon of the fleet."""
    config = redis_config(redis_server.url, key_prefix, integrity_key_file=fleet_key)
    writer, reader = Engine(daemons(config), pool_name), Engine(daemons(config), pool_name)
    server = redis.Redis.from_url(redis_server.url)
    chosen = payload(b"attacker's bytes")
    writer.store([b"genuine"])
    writer.settle_cascades()
    genuine = server.get(redis_key(key_prefix, pool_name, b"genuine"))
    assert isinstance(genuine, bytes) and header_of(genuine).key_id == key_id(fleet_key)
    victims = block_keys("victim", 3)  # one each: a failed promotion holds its key off a while
    forgeries = [  # (value, what counts it, how many of those by then)
        (forged(victims[0], pool_name, chosen), "integrity", 1),
        (forged(victims[1], pool_name, chosen, sealed_with=os.urandom(32)), "integrity", 2),
        # sealed by the fleet, for another key (the MAC covers the key): a mix-up
        (genuine, "checksum", 1),
    ]
    for victim, (value, counter, count) in zip(victims, forgeries, strict=True):
        name = redis_key(key_prefix, pool_name, victim)
        server.set(name, value)
        _refused(reader, victim, count, counter)
        assert server.exists(name) == 0, "the refused value was left in the server"
    stats = reader.tier_stats()
    assert (stats.integrity_failures, stats.checksum_failures, stats.promoted_blocks) == (2, 1, 0)
    writer.store(victims[:1])
    writer.settle_cascades()
    rewritten = server.get(redis_key(key_prefix, pool_name, victims[0]))
    assert isinstance(rewritten, bytes)
    assert header_of(rewritten).key_id == key_id(fleet_key)
    assert rewritten[blockformat.HEADER_SIZE :] == payload(victims[0])
    promoted(reader, [b"genuine"])
    assert reader.load([b"genuine"]) == [payload(b"genuine")]
    log = reader.daemon.log()
    assert "refused and deleted: no MAC: written without an integrity key" in log
    server.close()
    writer.close()
    reader.close()


def test_a_forged_payload_under_the_fleets_header_is_never_served(
    redis_server: RedisServer,
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
    fleet_key: Path,
):
    """The fleet's own header (its key id, its MAC) kept, other bytes put after it:
    the MAC covers the payload, not only the header's xxh3 (which a forger recomputes:
    it is no secret), so the value fails at its load."""
    config = redis_config(redis_server.url, key_prefix, integrity_key_file=fleet_key)
    writer, reader = Engine(daemons(config), pool_name), Engine(daemons(config), pool_name)
    key = b"tampered"
    writer.store([key])
    writer.settle_cascades()
    server = redis.Redis.from_url(redis_server.url)
    name = redis_key(key_prefix, pool_name, key)
    value = server.get(name)
    assert isinstance(value, bytes)
    server.set(name, value[: blockformat.HEADER_SIZE] + payload(b"something else"))
    _refused(reader, key, 1)
    assert "MAC mismatch under integrity key" in reader.daemon.log()
    server.close()
    writer.close()
    reader.close()


def test_values_written_without_a_key_are_read_without_one_and_refused_with_one(
    redis_server: RedisServer,
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
    fleet_key: Path,
):
    """The unkeyed format stays what a daemon without a key writes and reads (a local,
    unshared server); a daemon with a key refuses it: a MISS, counted, deleted."""
    plain = redis_config(redis_server.url, key_prefix)
    keyed = redis_config(redis_server.url, key_prefix, integrity_key_file=fleet_key)
    writer, plain_reader = Engine(daemons(plain), pool_name), Engine(daemons(plain), pool_name)
    keyed_reader = Engine(daemons(keyed), pool_name)
    keys = block_keys("unkeyed", 2)
    writer.store(keys)
    writer.settle_cascades()
    server = redis.Redis.from_url(redis_server.url)
    value = server.get(redis_key(key_prefix, pool_name, keys[0]))
    assert isinstance(value, bytes) and header_of(value).version == blockformat.FORMAT_VERSION
    promoted(plain_reader, keys)
    assert plain_reader.load(keys) == [payload(k) for k in keys]
    for count, key in enumerate(keys, start=1):
        _refused(keyed_reader, key, count)
    assert server.exists(*(redis_key(key_prefix, pool_name, k) for k in keys)) == 0
    server.close()
    for engine in (writer, plain_reader, keyed_reader):
        engine.close()


def test_a_rotation_verifies_the_old_key_and_seals_with_the_new(
    redis_server: RedisServer,
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
    tmp_path: Path,
):
    """Mid-rotation a daemon seals with the new key and verifies the old one too: it
    serves what the not yet rotated daemons wrote; a daemon holding only the new key
    refuses the old values (why every daemon first gets the new key to verify)."""
    old, new = write_key(tmp_path / "old.key"), write_key(tmp_path / "new.key")
    before = Engine(daemons(redis_config(redis_server.url, key_prefix, integrity_key_file=old)),
                    pool_name)  # fmt: skip
    rotating = Engine(daemons(redis_config(
        redis_server.url, key_prefix, integrity_key_file=new, integrity_verify_key_file=old
    )), pool_name)  # fmt: skip
    after = Engine(daemons(redis_config(redis_server.url, key_prefix, integrity_key_file=new)),
                   pool_name)  # fmt: skip
    old_keys, new_keys = block_keys("by-old", 2), block_keys("by-new", 2)
    before.store(old_keys)
    before.settle_cascades()
    rotating.store(new_keys)
    rotating.settle_cascades()
    server = redis.Redis.from_url(redis_server.url)
    sealed = server.get(redis_key(key_prefix, pool_name, new_keys[0]))
    assert isinstance(sealed, bytes) and header_of(sealed).key_id == key_id(new)
    promoted(rotating, old_keys)  # the old key verifies
    assert rotating.load(old_keys) == [payload(k) for k in old_keys]
    promoted(after, new_keys)
    assert after.load(new_keys) == [payload(k) for k in new_keys]
    _refused(after, old_keys[0], 1)  # the old key is not after's
    assert after.session.lookup(new_keys) == [HIT, HIT]
    server.close()
    for engine in (before, rotating, after):
        engine.close()
