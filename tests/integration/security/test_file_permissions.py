"""Who can read the daemon's files, and which directories it agrees to write in
(issue #18, item 3). Real daemon, real files, a real second local user.

Block files and pool directories carry no permission for others; the daemon
refuses to start (exit 2, the path, its owner and the fix named) on a
``memory.shm_dir`` or tier root owned or writable by another user, and on a
symlink planted where it creates its own entries.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import daemon_command, eventually, fs_tiers_config, start_daemon, write_config
from engine_harness import Engine, block_keys, file_of
from local_users import LocalUser
from shm_leftovers import shm_tempdir

from kvtierd.primary.region import region_file_name
from kvtierd.tiers import blockformat
from kvtierd.tiers.fs import fsformat

EXIT_CONFIG = 2
READ_FILE = "import sys; print(len(open(sys.argv[1], 'rb').read()))"
LIST_DIR = "import os, sys; print(os.listdir(sys.argv[1]))"


@pytest.fixture
def open_root() -> Iterator[Path]:
    """A tier root others may traverse (0755, root's): only the modes the daemon
    gives its own entries keep other users out of the block files."""
    parent = Path(tempfile.mkdtemp(prefix="kvt-perm-", dir="/tmp"))
    try:
        parent.chmod(0o755)
        root = parent / "fs"
        root.mkdir(mode=0o755)
        root.chmod(0o755)
        yield root
    finally:
        shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    path = Path(shm_tempdir())
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def modes(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def no_access_for_others(path: Path) -> bool:
    return modes(path) & 0o027 == 0


def refused_start(
    *args: str, shm: Path, config: str = "", workdir: Path
) -> subprocess.CompletedProcess[str]:
    """Runs the daemon to its exit (a start that should be refused)."""
    conf = write_config(workdir, config)
    return subprocess.run(
        daemon_command("--config", conf, "--listen", f"unix://{workdir}/k.sock",
                       "--shm-dir", str(shm), "--metrics-address", "", *args),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_another_user_cannot_read_block_files_or_list_pool_dirs(
    open_root, other_user: LocalUser, pool_name
):
    daemon = start_daemon("--memory-budget", "64MiB", config=fs_tiers_config(open_root))
    try:
        engine = Engine(daemon, pool_name, num_blocks=4)
        keys = block_keys("p", 4)
        engine.store(keys)
        engine.settle_cascades()
        files = [file_of(open_root, pool_name, key) for key in keys]
        assert all(path.is_file() for path in files)
        pool_dir = files[0].parents[2]
        assert pool_dir.parent == open_root
        for path in files:
            assert modes(path) == 0o640, oct(modes(path))
            assert modes(path.parent) == 0o750 and modes(path.parent.parent) == 0o750
        assert modes(pool_dir) == 0o750 and modes(pool_dir / fsformat.POOL_FILE) == 0o640

        for target, code in [(files[0], READ_FILE), (pool_dir / fsformat.POOL_FILE, READ_FILE),
                             (pool_dir, LIST_DIR)]:  # fmt: skip
            result = other_user.run_python(code, str(target))
            assert result.returncode != 0 and "PermissionError" in result.stderr, result
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.cleanup()


def test_looser_modes_left_by_an_older_daemon_are_tightened_at_start(open_root, pool_name):
    config = fs_tiers_config(open_root)
    daemon = start_daemon("--memory-budget", "64MiB", config=config)
    try:
        engine = Engine(daemon, pool_name, num_blocks=4)
        engine.store(block_keys("t", 1))
        engine.settle_cascades()
        engine.close()
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.cleanup()
    block = file_of(open_root, pool_name, block_keys("t", 1)[0])
    pool_dir = block.parents[2]
    pool_dir.chmod(0o755)
    block.chmod(0o644)  # what a daemon before #18 created

    daemon = start_daemon("--memory-budget", "64MiB", config=config)
    try:
        assert modes(pool_dir) == 0o750  # at start, before any pool opens
        engine = Engine(daemon, pool_name, num_blocks=4)  # the pool's scan meets the file
        eventually(lambda: modes(block) == 0o640, 20.0, "the scan tightened the block file")
        engine.close()
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.cleanup()


def test_start_refused_when_shm_dir_is_owned_by_another_user(
    shm_dir, other_user: LocalUser, tmp_path
):
    os.chown(shm_dir, other_user.uid, other_user.gid)
    result = refused_start(shm=shm_dir, workdir=tmp_path)
    assert result.returncode == EXIT_CONFIG, result
    for fragment in (
        "memory.shm_dir",
        str(shm_dir),
        other_user.name,
        "owned by another user",
        "chown",
    ):
        assert fragment in result.stderr, result.stderr


def test_start_refused_when_shm_dir_is_writable_by_others_without_sticky_bit(shm_dir, tmp_path):
    shm_dir.chmod(0o777)
    result = refused_start(shm=shm_dir, workdir=tmp_path)
    assert result.returncode == EXIT_CONFIG, result
    for fragment in ("memory.shm_dir", str(shm_dir), "writable by other users", "chmod go-w"):
        assert fragment in result.stderr, result.stderr


def test_sticky_world_writable_shm_dir_is_accepted(shm_dir):
    shm_dir.chmod(0o1777)  # as /dev/shm itself
    daemon = start_daemon(shm_dir=str(shm_dir))
    try:
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.cleanup()


def test_start_refused_on_a_symlink_planted_at_a_region_file_name(shm_dir, tmp_path, pool_name):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    planted = shm_dir / region_file_name(pool_name)
    planted.symlink_to(target)
    result = refused_start(shm=shm_dir, workdir=tmp_path)
    assert result.returncode == EXIT_CONFIG, result
    for fragment in ("memory.shm_dir", str(planted), "symlink", "remove it"):
        assert fragment in result.stderr, result.stderr


def test_start_refused_when_a_tier_root_is_owned_by_another_user(
    open_root, shm_dir, other_user: LocalUser, tmp_path
):
    os.chown(open_root, other_user.uid, other_user.gid)
    result = refused_start(shm=shm_dir, config=fs_tiers_config(open_root), workdir=tmp_path)
    assert result.returncode == EXIT_CONFIG, result
    for fragment in ("tiers", str(open_root), other_user.name, "owned by another user"):
        assert fragment in result.stderr, result.stderr


def test_start_refused_when_a_tier_root_is_writable_by_others(open_root, shm_dir, tmp_path):
    open_root.chmod(0o777)
    result = refused_start(shm=shm_dir, config=fs_tiers_config(open_root), workdir=tmp_path)
    assert result.returncode == EXIT_CONFIG, result
    assert str(open_root) in result.stderr and "sticky" in result.stderr, result.stderr


def test_start_refused_on_a_symlink_planted_as_a_pool_directory(
    open_root, shm_dir, tmp_path, pool_name
):
    """The attack of the issue: a pool directory replaced by a symlink into a
    root-only directory; the daemon must neither start nor write there."""
    private = tmp_path / "root-only"
    private.mkdir(mode=0o700)
    planted = open_root / fsformat.pool_dir_name(blockformat.PoolIdentity(pool_name, 65536, "L"))
    planted.symlink_to(private, target_is_directory=True)
    result = refused_start(shm=shm_dir, config=fs_tiers_config(open_root), workdir=tmp_path)
    assert result.returncode == EXIT_CONFIG, result
    for fragment in ("tiers", str(planted), "symlink", "remove it"):
        assert fragment in result.stderr, result.stderr
    assert list(private.iterdir()) == []


def test_start_refused_on_a_pool_directory_made_by_another_user(
    open_root, shm_dir, other_user: LocalUser, tmp_path, pool_name
):
    planted = open_root / fsformat.pool_dir_name(blockformat.PoolIdentity(pool_name, 65536, "L"))
    planted.mkdir()
    os.chown(planted, other_user.uid, other_user.gid)
    result = refused_start(shm=shm_dir, config=fs_tiers_config(open_root), workdir=tmp_path)
    assert result.returncode == EXIT_CONFIG, result
    assert str(planted) in result.stderr and other_user.name in result.stderr, result.stderr
