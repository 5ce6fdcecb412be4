"""Keyed integrity of block files in a shared fs root (docs/security.md, "Keyed
integrity of shared tiers"), through real daemons on a real root.

Any host that can write a shared root can write a block file with a valid unkeyed
header. Daemons with ``integrity_key_file`` adopt a file only if it is sealed under
one of their key ids and serve it only if its MAC verifies (checked in the I/O worker
process at every load); anything else is a MISS, counted in ``integrity_failures``
and removed. A root of one daemon without a key keeps the unkeyed format; once a
key is configured, its old files are refused at the start-up scan.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import DaemonProcess, daemon_command, eventually, fs_tiers_config, start_daemon
from engine_harness import HIT, MISS, Engine, block_files, block_keys, file_of, payload
from integrity_harness import forged, header_of, key_id, write_key

from kvtierd.tiers import blockformat


@pytest.fixture
def started() -> Iterator[list[DaemonProcess]]:
    daemons: list[DaemonProcess] = []
    yield daemons
    for daemon in daemons:
        try:
            if daemon.alive():
                assert daemon.stop() == 0, daemon.log()
        finally:
            daemon.cleanup()


def _start(started: list[DaemonProcess], config: str) -> DaemonProcess:
    started.append(start_daemon("--memory-budget", "64MiB", config=config))
    return started[-1]


def _ready(engine: Engine) -> Engine:
    eventually(lambda: engine.tier_stats().ready, 30, "the fs tier's index ready")
    return engine


def _plant(root: Path, pool: str, key: bytes, value: bytes) -> Path:
    """Writes ``value`` as ``key``'s block file, as another host on the root could."""
    path = file_of(root, pool, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(value)
    return path


def _refused(engine: Engine, key: bytes, failures: int) -> None:
    """Looks ``key`` up until the tier counted ``failures`` integrity failures."""

    def counted() -> bool:
        engine.session.lookup([key])
        return engine.tier_stats().integrity_failures >= failures

    eventually(counted, 20.0, lambda: f"{failures} integrity failures; {engine.tier_stats()}",
               interval=0.02)  # fmt: skip
    assert engine.wait_settled([key]) == [MISS]


def test_a_forged_file_with_a_valid_header_in_a_shared_root_is_never_served(
    fs_root: Path, started: list[DaemonProcess], pool_name, tmp_path: Path
):
    """Three forgeries by a writer of the root without the fleet's key: an unkeyed
    header and one sealed under its own key (refused at the header check, never
    adopted), and the fleet's own header over other bytes (adopted by its key id,
    refused at its load by the MAC, in the I/O worker process). Each is counted,
    removed and never served; the fleet's genuine files are served bit-exact."""
    key = write_key(tmp_path / "fleet.key")
    config = fs_tiers_config(fs_root, shared=True, shared_negative_ttl="0.1s",
                             shared_rescan_interval="60s", integrity_key_file=key)  # fmt: skip
    writer = _ready(Engine(_start(started, config), pool_name))
    reader = _ready(Engine(_start(started, config), pool_name))
    writer.store([b"genuine", b"tampered"])
    writer.settle_cascades()
    assert header_of(file_of(fs_root, pool_name, b"genuine").read_bytes()).key_id == key_id(key)
    chosen = payload(b"attacker's bytes")
    unkeyed = _plant(fs_root, pool_name, b"victim-0", forged(b"victim-0", pool_name, chosen))
    _refused(reader, b"victim-0", 1)
    own_key = forged(b"victim-1", pool_name, chosen, sealed_with=os.urandom(32))
    other_key = _plant(fs_root, pool_name, b"victim-1", own_key)
    _refused(reader, b"victim-1", 2)
    assert not unkeyed.exists() and not other_key.exists()
    tampered = file_of(fs_root, pool_name, b"tampered")
    tampered.write_bytes(tampered.read_bytes()[: blockformat.HEADER_SIZE] + chosen)
    _refused(reader, b"tampered", 3)
    assert not tampered.exists()
    stats = reader.tier_stats()
    assert (stats.integrity_failures, stats.checksum_failures) == (3, 0)
    assert stats.promotion_failures == 1  # the tampered file only: the others never adopted
    eventually(lambda: reader.session.lookup([b"genuine"]) == [HIT], 20, "the genuine file")
    assert reader.wait_settled([b"genuine"]) == [HIT]
    assert reader.load([b"genuine"]) == [payload(b"genuine")]
    log = reader.daemon.log()
    assert "no MAC: written without an integrity key; removing it" in log
    assert "MAC mismatch under integrity key" in log
    writer.close()
    reader.close()


def test_unkeyed_files_are_read_without_a_key_and_refused_once_a_key_is_set(
    fs_root: Path, started: list[DaemonProcess], pool_name, tmp_path: Path
):
    """One daemon's own root (not shared): its files stay unkeyed and read while it
    has no key; restarted with ``integrity_key_file`` its start-up scan removes them
    (counted) and it seals what it writes from then on."""
    plain = fs_tiers_config(fs_root)
    keys = block_keys("before", 3)
    engine = _ready(Engine(_start(started, plain), pool_name))
    engine.store(keys)
    engine.settle_cascades()
    engine.close()
    assert started[-1].stop() == 0
    engine = _ready(Engine(_start(started, plain), pool_name))
    assert engine.wait_settled(keys) == [HIT] * 3  # the old format is read without a key
    assert engine.load(keys) == [payload(k) for k in keys]
    engine.close()
    assert started[-1].stop() == 0
    assert all(header_of(f.read_bytes()).version == 1 for f in block_files(fs_root))

    key = write_key(tmp_path / "new.key")
    engine = _ready(Engine(_start(started, fs_tiers_config(fs_root, integrity_key_file=key)),
                           pool_name))  # fmt: skip
    stats = engine.tier_stats()
    assert stats.integrity_failures == 3 and stats.used_blocks == 0
    assert engine.session.lookup(keys) == [MISS] * 3
    assert block_files(fs_root) == []
    engine.store(block_keys("after", 1))
    engine.settle_cascades()
    (sealed,) = block_files(fs_root)
    assert header_of(sealed.read_bytes()).key_id == key_id(key)
    engine.close()


def test_fsck_checks_sealed_files_without_the_key(
    fs_root: Path, started: list[DaemonProcess], pool_name, tmp_path: Path
):
    """Sealed files keep the payload's xxh3: ``kvtierctl fsck`` (which holds no key)
    still finds a damaged one and passes the others."""
    key = write_key(tmp_path / "fleet.key")
    engine = _ready(Engine(_start(started, fs_tiers_config(fs_root, integrity_key_file=key)),
                           pool_name))  # fmt: skip
    keys = block_keys("fsck", 3)
    engine.store(keys)
    engine.settle_cascades()
    engine.close()
    damaged = file_of(fs_root, pool_name, keys[1])
    data = bytearray(damaged.read_bytes())
    data[blockformat.HEADER_SIZE + 7] ^= 1
    damaged.write_bytes(bytes(data))
    kvtierctl = str(Path(daemon_command()[0]).parent / "kvtierctl")
    report = subprocess.run([kvtierctl, "fsck", str(fs_root)], capture_output=True, text=True,
                            timeout=60)  # fmt: skip
    assert report.returncode == 1, report.stderr
    assert f"BAD {damaged}: payload checksum mismatch" in report.stdout
    assert "3 block files in 1 pool checked: 1 bad" in report.stdout
