"""Hostile or odd files in an fs tier root against the real daemon and the real
``kvtierctl fsck`` (issue #15, item 4): live, across a restart, at SIGTERM, and in
fsck with bounded memory. Real process, real socket, real files.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash
from daemon_harness import daemon_command, fs_tiers_config, start_daemon
from engine_harness import BLOCK, HIT, MISS, Engine, block_keys, file_of, payload
from spawn_harness import with_address_space

from kvtierd.tiers import blockformat
from kvtierd.tiers.fs import fsformat

GRACE_S = 1.0  # --shutdown-grace of these daemons
STOP_BOUND_S = GRACE_S + 6.0  # grace + a bounded drain: what SIGTERM may take at most
SETTLE_S = 10.0  # a promotion or index scan slower than this is hanging
KVTIERCTL = str(Path(daemon_command()[0]).parent / "kvtierctl")


def plant_fifo(path: Path, outside: Path) -> None:
    os.mkfifo(path)


def plant_socket(path: Path, outside: Path) -> None:
    os.mknod(path, stat.S_IFSOCK | 0o600)


def plant_directory(path: Path, outside: Path) -> None:
    path.mkdir()
    (path / "inside").write_bytes(b"must survive")


def plant_symlink(path: Path, outside: Path) -> None:
    """A symlink to the valid file moved outside: following it would serve it."""
    path.symlink_to(outside / path.name)


PLANTERS = {"FIFO": plant_fifo, "socket": plant_socket, "directory": plant_directory,
            "symlink": plant_symlink}  # fmt: skip


def replace_with(path: Path, plant: Callable[[Path, Path], None], outside: Path) -> None:
    """Moves the block file at ``path`` outside the root and plants something else."""
    outside.mkdir(exist_ok=True)
    shutil.move(path, outside / path.name)
    plant(path, outside)


def start(root: Path):  # noqa: ANN201 - a DaemonProcess
    return start_daemon("--shutdown-grace", f"{GRACE_S}s", config=fs_tiers_config(root))


def stop_within_bound(daemon) -> float:  # noqa: ANN001
    """SIGTERMs the daemon; asserts it exits cleanly within the bound; seconds taken."""
    begin = time.monotonic()
    assert daemon.stop(timeout=STOP_BOUND_S + 10) == 0, daemon.log()
    took = time.monotonic() - begin
    assert took < STOP_BOUND_S, f"SIGTERM took {took:.1f}s\n{daemon.log()}"
    return took


@pytest.mark.parametrize("kind", list(PLANTERS))
def test_a_planted_block_file_is_a_quick_counted_miss_and_sigterm_completes(
    fs_root, tmp_path, pool_name, kind
):
    """Scenario: blocks went to the fs tier and left the primary; one block file is
    replaced. Its promotion answers MISS at once (never HIT_PENDING forever, never
    served), counted; the other blocks load bit-exact; with another FIFO still in
    the root, SIGTERM completes within grace + a bounded drain."""
    daemon = start(fs_root)
    try:
        engine = Engine(daemon, pool_name)
        keys = block_keys("live", 3)
        engine.store(keys)
        engine.settle_cascades()
        assert engine.client.flush_pool(pool_name) == 3
        victim = file_of(fs_root, pool_name, keys[0])
        replace_with(victim, PLANTERS[kind], tmp_path / "outside")

        assert engine.wait_settled(keys, timeout=SETTLE_S) == [MISS, HIT, HIT]
        assert engine.load(keys[1:]) == [payload(k) for k in keys[1:]]
        stats = engine.tier_stats()
        assert (stats.checksum_failures, stats.promotion_failures) == (1, 1)
        assert f"bad block file {victim}: a {kind}, not a regular file" in daemon.log()
        assert victim.is_dir() if kind == "directory" else not os.path.lexists(victim)
        assert (tmp_path / "outside" / victim.name).read_bytes()[blockformat.HEADER_SIZE :] == (
            payload(keys[0])
        )  # the file outside the root is untouched

        engine.client.flush_pool(pool_name)
        os.unlink(file_of(fs_root, pool_name, keys[2]))
        os.mkfifo(file_of(fs_root, pool_name, keys[2]))  # still there at SIGTERM
        engine.close()
        stop_within_bound(daemon)
    finally:
        daemon.cleanup()


def test_planted_entries_across_a_restart_the_scan_completes(fs_root, tmp_path, pool_name):
    """Scenario: while the daemon is down, block files are replaced by a FIFO, a
    socket, a directory and a symlink, and one fan-out directory by a symlink to
    valid files outside the root. The restarted daemon's index scan completes
    (the pool answers HIT / MISS, not RETRY forever), nothing planted is served,
    and SIGTERM completes within its bound with the directory and a new FIFO
    still in the root."""
    keys = [f"{i}-restart".encode() for i in range(6)]  # six fan-out directories
    outside = tmp_path / "outside"
    first = start(fs_root)
    try:
        engine = Engine(first, pool_name)
        engine.store(keys)
        engine.close()
        stop_within_bound(first)
    finally:
        first.cleanup()
    for key, plant in zip(keys, PLANTERS.values(), strict=False):
        replace_with(file_of(fs_root, pool_name, key), plant, outside)
    fan_out = file_of(fs_root, pool_name, keys[4]).parent
    shutil.move(fan_out, outside / "fan-out")
    fan_out.symlink_to(outside / "fan-out")

    second = start(fs_root)
    try:
        engine = Engine(second, pool_name)
        assert engine.wait_settled(keys, timeout=SETTLE_S) == [MISS] * 5 + [HIT]
        assert engine.load(keys[5:]) == [payload(keys[5])]
        stats = engine.tier_stats()
        assert stats.ready and stats.checksum_failures == 4
        log = second.log()
        assert "4 bad entries (not regular files)" in log
        assert f"{fan_out} is a symlink: not followed" in log
        assert (outside / "fan-out" / file_of(fs_root, pool_name, keys[4]).name).is_file()
        fifo = file_of(fs_root, pool_name, b"5-never-stored")  # beside keys[5]: its dir exists
        os.mkfifo(fifo)  # still there at SIGTERM
        engine.close()
        stop_within_bound(second)
    finally:
        second.cleanup()
    assert file_of(fs_root, pool_name, keys[2]).is_dir()  # a directory is never removed


# -- kvtierctl fsck -----------------------------------------------------------------------


def write_pool(root: Path, name: str, block_bytes: int) -> tuple[Path, bytes]:
    """A pool directory with its pool.json, as the daemon writes it; (dir, fingerprint)."""
    identity = blockformat.PoolIdentity(name, block_bytes, "L")
    pool_dir = root / fsformat.pool_dir_name(identity)
    pool_dir.mkdir(parents=True)
    (pool_dir / fsformat.POOL_FILE).write_text(json.dumps(fsformat.pool_file(identity)))
    return pool_dir, identity.fingerprint


def write_block(
    pool_dir: Path,
    fingerprint: bytes,
    key: bytes,
    block_bytes: int,
    *,
    claim: int | None = None,
    sparse: bool = False,
) -> Path:
    """A block file of ``key``: payload(key) (or zeros, as a sparse file, when
    ``sparse``); its header claims ``claim`` payload bytes if given."""
    path = pool_dir / fsformat.block_rel_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    if sparse:
        checksum = xxhash.xxh3_64()
        zeros = bytes(1 << 20)
        for _ in range(block_bytes >> 20):
            checksum.update(zeros)
        digest = checksum.intdigest()
    else:
        body = payload(key)[:block_bytes]
        digest = blockformat.payload_checksum(body)
    header = blockformat.encode_header(
        key=key,
        fingerprint=fingerprint,
        payload_length=block_bytes if claim is None else claim,
        payload_checksum=digest,
    )
    with open(path, "wb") as f:
        f.write(header)
        if sparse:
            f.truncate(blockformat.HEADER_SIZE + block_bytes)
        else:
            f.write(body)
    return path


def fsck(*args: str, address_space: int | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """Runs ``kvtierctl fsck`` (optionally with RLIMIT_AS); (result, seconds). Never
    through a ``preexec_fn``: that forks this gRPC-using process (spawn_harness)."""
    command = [KVTIERCTL, "fsck", "--quiet", *args]
    if address_space is not None:
        command = with_address_space(command, address_space)
    begin = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    return result, time.monotonic() - begin


def test_fsck_reports_huge_and_lying_files_quickly_in_bounded_memory(tmp_path):
    """Scenario: a block file extended to a sparse 1 TiB, one whose header claims 1 TiB
    of payload, and (another pool) a valid 256 MiB block. Under a 128 MiB address
    space limit fsck lists the first two as bad at once and verifies the big one
    in chunks; it never reads a file whole."""
    root = tmp_path / "root"
    pool_dir, fingerprint = write_pool(root, "small", BLOCK)
    good = write_block(pool_dir, fingerprint, b"good", BLOCK)
    sparse = write_block(pool_dir, fingerprint, b"sparse", BLOCK)
    os.truncate(sparse, 1 << 40)
    lying = write_block(pool_dir, fingerprint, b"lying", BLOCK, claim=1 << 40)
    big_block = 256 << 20
    big_dir, big_fingerprint = write_pool(root, "big", big_block)
    write_block(big_dir, big_fingerprint, b"big", big_block, sparse=True)

    result, took = fsck(str(root), address_space=128 << 20)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "MemoryError" not in result.stderr
    expected = blockformat.HEADER_SIZE + BLOCK
    assert f"BAD {sparse}: file is {1 << 40} bytes, expected {expected}" in result.stdout
    assert f"BAD {lying}: header claims {1 << 40} payload bytes, the file holds {BLOCK}" in (
        result.stdout
    )
    assert str(good) not in result.stdout
    assert "4 block files in 2 pools checked: 2 bad" in result.stdout
    assert took < 20, f"fsck took {took:.1f}s"


def test_fsck_lists_planted_entries_without_hanging_or_following(tmp_path):
    """A FIFO, socket, directory or symlink where a block file belongs, a symlinked
    fan-out directory and a symlinked pool directory are listed as bad; nothing is
    opened in a blocking way or followed; --remove unlinks all but the directory."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    pool_dir, fingerprint = write_pool(root, "p", BLOCK)
    planted = {}
    for kind, plant in PLANTERS.items():
        path = write_block(pool_dir, fingerprint, kind.encode(), BLOCK)
        replace_with(path, plant, outside)
        planted[kind] = path
    linked = write_block(pool_dir, fingerprint, b"\x12\x34", BLOCK)
    shutil.move(linked.parent, outside / "fan-out")
    linked.parent.symlink_to(outside / "fan-out")
    other_dir, other_fingerprint = write_pool(outside, "elsewhere", BLOCK)
    write_block(other_dir, other_fingerprint, b"x", BLOCK)
    (root / other_dir.name).symlink_to(other_dir)
    fifo_pool = root / fsformat.pool_dir_name(blockformat.PoolIdentity("fifo", BLOCK, "L"))
    os.mkfifo(fifo_pool)  # where a pool directory belongs: the daemon refuses that pool
    good = write_block(pool_dir, fingerprint, b"good", BLOCK)

    result, took = fsck(str(root))
    assert result.returncode == 1, result.stdout + result.stderr
    for kind, path in planted.items():
        assert f"BAD {path}: a {kind}, not a regular file" in result.stdout
    assert f"BAD {linked.parent}: a symlink, not a directory: not followed" in result.stdout
    assert f"BAD {root / other_dir.name}: a symlink, not a directory: not followed" in (
        result.stdout
    )
    assert f"BAD {fifo_pool}: a FIFO, not a directory" in result.stdout
    assert str(good) not in result.stdout
    assert "5 block files in 1 pool checked: 7 bad" in result.stdout
    assert took < 20

    removed, _ = fsck("--remove", str(root))
    assert "6 removed" in removed.stdout, removed.stdout
    assert not os.path.lexists(fifo_pool)
    assert planted["directory"].is_dir() and (planted["directory"] / "inside").exists()
    assert not any(os.path.lexists(planted[k]) for k in ("FIFO", "socket", "symlink"))
    assert not os.path.lexists(linked.parent) and not os.path.lexists(root / other_dir.name)
    assert (outside / "fan-out" / linked.name).is_file() and other_dir.is_dir()
    again, _ = fsck(str(root))
    assert "2 block files in 1 pool checked: 1 bad" in again.stdout  # the directory
