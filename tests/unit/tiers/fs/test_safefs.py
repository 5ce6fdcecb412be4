"""Opening paths below a pool directory (kvtierd.tiers.fs.safefs) on real files: with
the kernel's openat2 and with the component-by-component walk that older kernels
(or a seccomp filter without openat2) get."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtierd.tiers.fs import safefs
from kvtierd.tiers.fs.safefs import PoolDir, UnexpectedEntry


@pytest.fixture(params=["openat2", "walk"])
def resolve(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "walk":
        with safefs.walk_only():  # as without openat2
            assert not safefs.uses_openat2()
            yield request.param
        return
    if not safefs.uses_openat2():
        pytest.skip("this kernel has no openat2")
    yield request.param


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """pool/ab/cd/{file, fifo, sock, dir, link}, pool/ef -> outside, outside/file."""
    pool, outside = tmp_path / "pool", tmp_path / "outside"
    (pool / "ab" / "cd").mkdir(parents=True)
    outside.mkdir()
    (outside / "file").write_bytes(b"outside")
    leaf = pool / "ab" / "cd"
    (leaf / "file").write_bytes(b"inside")
    os.mkfifo(leaf / "fifo")
    os.mknod(leaf / "sock", stat.S_IFSOCK | 0o600)
    (leaf / "dir").mkdir()
    (leaf / "link").symlink_to(outside / "file")
    (pool / "ef").symlink_to(outside)
    return pool


def test_a_regular_file_opens_and_everything_else_is_named(tree: Path, resolve: str) -> None:
    with PoolDir(str(tree)) as pool:
        fd, st = pool.open_file("ab/cd/file")
        try:
            assert os.read(fd, 100) == b"inside" and stat.S_ISREG(st.st_mode)
        finally:
            os.close(fd)
        for name, kind in [("fifo", "FIFO"), ("sock", "socket"), ("dir", "directory"),
                           ("link", "symlink")]:  # fmt: skip
            with pytest.raises(UnexpectedEntry) as caught:
                pool.open_file(f"ab/cd/{name}")
            assert (caught.value.kind, caught.value.expected) == (kind, safefs.REGULAR)
            assert caught.value.path == str(tree / "ab" / "cd" / name)
            assert caught.value.removable == (kind != "directory")
        with pytest.raises(UnexpectedEntry, match=f"{tree / 'ef'} is a symlink, not a directory"):
            pool.open_file("ef/file")  # the file outside is never opened
        with pytest.raises(FileNotFoundError, match=str(tree / "ab" / "zz")):
            pool.open_file("ab/zz/file")


def test_parent_creates_missing_directories_but_never_enters_a_symlink(
    tree: Path, resolve: str
) -> None:
    with PoolDir(str(tree)) as pool:
        with pool.parent("12/34/x.kvb", create=True) as (dir_fd, name):
            assert name == "x.kvb" and stat.S_ISDIR(os.fstat(dir_fd).st_mode)
        assert (tree / "12" / "34").is_dir()
        refused = pytest.raises(UnexpectedEntry, match="is a symlink, not a directory")
        with refused, pool.parent("ef/34/x.kvb", create=True):
            pass
        assert not (tree.parent / "outside" / "34").exists()
        with pytest.raises(FileNotFoundError), pool.parent("56/78/x.kvb"):
            pass


def test_a_symlinked_pool_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "pool").symlink_to(tmp_path / "real")
    with pytest.raises(UnexpectedEntry, match="is a symlink, not a directory"):
        PoolDir(str(tmp_path / "pool"))


def test_unlink_if_same_removes_only_what_was_judged(tree: Path) -> None:
    with PoolDir(str(tree)) as pool:
        with pytest.raises(UnexpectedEntry) as caught:
            pool.open_file("ab/cd/fifo")
        identity = caught.value.identity
        assert identity is not None
        assert not pool.unlink_if_same("ab/cd/sock", identity)  # another inode
        assert pool.unlink_if_same("ab/cd/fifo", identity)
        assert not os.path.lexists(tree / "ab" / "cd" / "fifo")
        st = os.lstat(tree / "ab" / "cd" / "dir")
        assert not pool.unlink_if_same("ab/cd/dir", (st.st_dev, st.st_ino))  # never a dir
        assert (tree / "ab" / "cd" / "dir").is_dir()


def test_walk_yields_entries_without_entering_symlinks(tree: Path) -> None:
    errors: list[str] = []
    with PoolDir(str(tree)) as pool:
        seen = [(e.rel, e.kind) for e in pool.walk(lambda path, exc: errors.append(path))]
    assert seen == [
        ("ab/cd/dir", "directory"),
        ("ab/cd/fifo", "FIFO"),
        ("ab/cd/file", "regular file"),
        ("ab/cd/link", "symlink"),
        ("ab/cd/sock", "socket"),
        ("ef", "symlink"),
    ]
    assert errors == []
