"""The daemon's region files (kvtierd.primary.region) and the workers' attach
(kvtierd_client.region).

Real files, real mmap, real flock, in a private directory on /dev/shm (a tmpfs,
as in production) when there is one. Faults the kernel will not produce on
demand (ENOSPC from posix_fallocate, EINVAL from madvise) are injected.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtierd.primary import region as region_mod
from kvtierd.primary.region import (
    InsufficientSpaceError,
    Region,
    RegionError,
    RegionInUseError,
    region_file_name,
)
from kvtierd_client import region as client_region
from kvtierd_client.region import AttachedRegion

PAGE = mmap.PAGESIZE
BLOCK = 16384
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def region_dir() -> Iterator[str]:
    """A private directory on /dev/shm if possible (regions live on a tmpfs)."""
    parent = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    directory = tempfile.mkdtemp(prefix="kvtierd-unit-", dir=parent)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def region(region_dir: str) -> Iterator[Region]:
    created = Region.create(region_dir, "pool", 8, BLOCK)
    try:
        yield created
    finally:
        created.close()


def rss_bytes(path: str) -> int:
    """Resident bytes of this process's mappings of ``path`` (from /proc/self/smaps)."""
    total, current = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            key = line.split(maxsplit=1)[0]
            if not key.endswith(":"):  # a mapping's header line
                current = line.rstrip("\n").endswith(path)
            elif current and key == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def child_python(code: str, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "client")]))
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


# -- file names ------------------------------------------------------------------


def test_file_name_is_safe_and_unique_per_pool_name():
    name = region_file_name("llama/8b tp2:v1")
    assert name.startswith("kvtierd-llama_8b_tp2_v1-") and name.endswith(".region")
    assert len(name.split("-")[-1]) == len("0123456789ab.region")
    assert region_file_name("a/b") != region_file_name("a:b")  # same sanitized text
    # the same name in another process (another hash seed) names the same file: a
    # restarted daemon must find the region and journal its predecessor left
    other = subprocess.run(
        [sys.executable, "-c", "from kvtierd.primary.region import region_file_name as f; "
         "print(f('a/b'))"],
        env={**os.environ, "PYTHONHASHSEED": "12345"}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert other.stdout.strip() == region_file_name("a/b")
    long = region_file_name("x" * 500)
    assert len(long) == len("kvtierd-") + 80 + len("-0123456789ab.region")
    assert "/" not in region_file_name("../../etc/passwd")


# -- creation ----------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o077, 0o000])
def test_create_makes_an_allocated_zero_file_of_exact_mode(region_dir, umask):
    previous = os.umask(umask)
    try:
        created = Region.create(region_dir, "pool", 4, BLOCK)
    finally:
        os.umask(previous)
    try:
        st = os.stat(created.path)
        assert os.path.dirname(created.path) == region_dir
        assert os.path.basename(created.path) == region_file_name("pool")
        assert stat.S_ISREG(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o660
        assert st.st_size == created.size == 4 * BLOCK
        assert st.st_blocks * 512 >= created.size  # allocated, not sparse
        assert bytes(created.buffer()) == b"\0" * created.size
        assert (created.num_blocks, created.block_bytes) == (4, BLOCK)
        assert created.prefault_seconds > 0
    finally:
        created.close()


def test_create_applies_mode_and_group(region_dir):
    with Region.create(region_dir, "pool", 1, BLOCK, mode=0o600, gid=os.getgid()) as created:
        st = os.stat(created.path)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_gid == os.getgid()


@pytest.mark.parametrize(("num_blocks", "block_bytes"), [(0, BLOCK), (1, 1000), (1, 0), (-1, 4096)])
def test_create_refuses_bad_geometry_and_creates_nothing(region_dir, num_blocks, block_bytes):
    with pytest.raises(ValueError, match="num_blocks|block_bytes"):
        Region.create(region_dir, "pool", num_blocks, block_bytes)
    assert os.listdir(region_dir) == []


def test_create_without_prefault(region_dir):
    with Region.create(region_dir, "pool", 2, BLOCK, prefault=False) as created:
        assert created.prefault_seconds == 0.0
        assert rss_bytes(created.path) == 0  # nothing mapped yet: pages fault on use
        created.row(1)[:3] = b"abc"
        with open(created.path, "rb") as f:
            f.seek(BLOCK)
            assert f.read(3) == b"abc"


def test_second_create_while_open_is_refused(region):
    """flock is per open file: a second create in this process sees a live holder."""
    inode = os.stat(region.path).st_ino
    with pytest.raises(RegionInUseError, match=region.path):
        Region.create(os.path.dirname(region.path), "pool", 8, BLOCK)
    assert os.stat(region.path).st_ino == inode
    region.row(0)[:1] = b"x"  # still ours and usable


def test_stale_file_of_a_dead_daemon_is_replaced_not_reused(region_dir, caplog):
    crashed = child_python(
        """
        import os, sys
        from kvtierd.primary.region import Region
        region = Region.create(sys.argv[1], "pool", 8, 16384)
        region.buffer()[:] = b"\\xab" * region.size
        print(region.path, flush=True)
        os._exit(0)  # dies without close(): the file stays, its flock goes
        """,
        region_dir,
    )
    path = crashed.stdout.readline().strip()
    assert crashed.wait(60) == 0
    old = os.open(path, os.O_RDONLY)  # keeps the old inode (and its number) alive
    try:
        old_inode = os.fstat(old).st_ino
        with caplog.at_level(logging.WARNING, logger="kvtierd.primary.region"):
            replaced = Region.create(region_dir, "pool", 8, BLOCK)
        with replaced:
            assert replaced.path == path
            assert os.stat(path).st_ino != old_inode
            assert bytes(replaced.buffer()) == b"\0" * replaced.size
            assert os.pread(old, 4, 0) == b"\xab" * 4  # the old bytes went with the old inode
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert any("stale" in r.getMessage() and path in r.getMessage() for r in warnings)
        assert any(str(8 * BLOCK) in r.getMessage() for r in warnings)
    finally:
        os.close(old)


def test_file_locked_by_a_live_process_is_refused_naming_it_and_left_alone(region_dir):
    """The refusal names the pid holding the flock (after a chain of takeovers it
    used to say only "give this one another memory.shm_dir")."""
    path = os.path.join(region_dir, region_file_name("pool"))
    with open(path, "wb") as f:
        f.write(b"\xcd" * 4096)
    holder = child_python(
        """
        import fcntl, os, sys
        fd = os.open(sys.argv[1], os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("locked", flush=True)
        sys.stdin.read()  # until the parent closes our stdin
        """,
        path,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        inode = os.stat(path).st_ino
        named = f"held by another live kvtierd, pid {holder.pid} "
        with pytest.raises(RegionInUseError, match=named):
            Region.create(region_dir, "pool", 8, BLOCK)
        assert os.stat(path).st_ino == inode
        with open(path, "rb") as f:
            assert f.read() == b"\xcd" * 4096
    finally:
        holder.stdin.close()
        assert holder.wait(60) == 0


def test_a_socket_at_the_region_path_is_not_a_region(region_dir):
    """Opening a socket fails with ENXIO (not ELOOP): still refused as not a region
    (FAILED_PRECONDITION upstream), never an internal error; left alone."""
    import socket

    path = os.path.join(region_dir, region_file_name("pool"))
    with socket.socket(socket.AF_UNIX) as planted:
        planted.bind(path)
        with pytest.raises(RegionError, match=r"is a socket.*not a region file"):
            Region.create(region_dir, "pool", 8, BLOCK)
        assert stat.S_ISSOCK(os.lstat(path).st_mode)


def test_a_file_the_daemon_may_not_open_is_not_a_region(region_dir, monkeypatch):
    """Another user's 0600 file in a world-writable shm_dir: open() fails with EACCES
    for a daemon that is not root. Refused naming its owner, never an internal error."""
    path = os.path.join(region_dir, region_file_name("pool"))
    Path(path).write_bytes(b"someone else's")
    real_open = os.open

    def refusing_open(name, flags, *args):
        if name == path and not flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), name)
        return real_open(name, flags, *args)

    monkeypatch.setattr(region_mod.os, "open", refusing_open)
    with pytest.raises(RegionError, match=r"owned by uid \d+, not a region file"):
        Region.create(region_dir, "pool", 8, BLOCK)
    assert Path(path).read_bytes() == b"someone else's"


def test_insufficient_space_fails_before_allocating_and_leaves_no_file(region_dir):
    st = os.statvfs(region_dir)
    free = st.f_bavail * st.f_frsize
    block = 1 << 20
    num_blocks = free // block + 64  # 64 MiB more than the directory has free
    with pytest.raises(InsufficientSpaceError) as caught:
        Region.create(region_dir, "huge", num_blocks, block)
    error = caught.value
    assert error.needed_bytes == num_blocks * block
    assert error.available_bytes <= free + (64 << 20)  # free space moves a little
    assert error.directory == region_dir
    message = str(error)
    assert str(num_blocks * block) in message and region_dir in message and "GiB" in message
    assert os.listdir(region_dir) == []


def test_enospc_from_fallocate_is_insufficient_space_and_leaves_no_file(region_dir, monkeypatch):
    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(InsufficientSpaceError, match=str(4 * BLOCK)):
        Region.create(region_dir, "pool", 4, BLOCK)
    assert os.listdir(region_dir) == []


def test_fallocate_unsupported_is_not_an_error(region_dir, monkeypatch):
    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    with Region.create(region_dir, "pool", 4, BLOCK) as created:
        assert os.stat(created.path).st_size == 4 * BLOCK


def test_any_failure_during_create_leaves_no_file(region_dir, monkeypatch):
    def broken(mapping):
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(region_mod, "madvise_populate_write", broken)
    with pytest.raises(OSError, match="injected"):
        Region.create(region_dir, "pool", 4, BLOCK)
    assert os.listdir(region_dir) == []
    with Region.create(region_dir, "pool", 4, BLOCK, prefault=False):  # nothing held
        pass


def test_madvise_einval_falls_back_to_touching_every_page(region_dir, monkeypatch):
    def einval(mapping):
        raise OSError(errno.EINVAL, "MADV_POPULATE_WRITE unknown")

    monkeypatch.setattr(region_mod, "madvise_populate_write", einval)
    with Region.create(region_dir, "pool", 8, BLOCK) as created:
        assert created.prefault_seconds > 0
        assert rss_bytes(created.path) == created.size


def test_page_touching_fallback_preserves_data(region_dir):
    path = os.path.join(region_dir, "data")
    data = np.random.default_rng(7).integers(0, 256, 16 * PAGE, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        f.write(data)
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), len(data)) as mapping:
        assert rss_bytes(path) == 0
        region_mod.touch_pages(mapping)
        assert rss_bytes(path) == len(data)
        assert mapping[:] == data


def test_page_touching_fallback_survives_a_file_cut_short_under_it(region_dir):
    """A member of the socket group can open a new region by path and truncate it
    while the daemon pre-faults it on a kernel without MADV_POPULATE_WRITE. Touching
    the pages from user space died of SIGBUS (the whole daemon); the fallback reads
    them with process_vm_readv now and stops short. Run in a child process, so the
    old behaviour fails this test instead of killing pytest."""
    path = os.path.join(region_dir, "cut")
    script = (
        "import mmap, os, sys\n"
        "from kvtierd.primary import region\n"
        "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)\n"
        "os.ftruncate(fd, 64 * mmap.PAGESIZE)\n"
        "mapping = mmap.mmap(fd, 64 * mmap.PAGESIZE)\n"
        "os.ftruncate(fd, 5 * mmap.PAGESIZE)\n"
        "region.touch_pages(mapping)\n"
        "print('survived')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, path], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "survived" in done.stdout, (done.returncode, done.stderr)


# -- rows and close ------------------------------------------------------------------


def test_rows_are_bounds_checked_views_of_the_file(region):
    region.row(3)[:5] = b"hello"
    region.buffer()[region.size - 2 :] = b"zz"
    fd = os.open(region.path, os.O_RDONLY)
    try:
        assert os.pread(fd, 5, 3 * BLOCK) == b"hello"
        assert os.pread(fd, 2, region.size - 2) == b"zz"
    finally:
        os.close(fd)
    assert len(region.row(7)) == BLOCK
    for bad in (-1, 8):
        with pytest.raises(IndexError, match=str(bad)):
            region.row(bad)


def test_close_unlinks_and_is_idempotent(region_dir):
    created = Region.create(region_dir, "pool", 2, BLOCK)
    view = created.row(1)
    created.close()
    assert not os.path.exists(created.path)
    assert created.closed
    with pytest.raises(ValueError, match="released"):
        view[0]  # released by close(), not dangling
    created.close()
    with pytest.raises(ValueError, match="closed"):
        created.row(0)
    with Region.create(region_dir, "pool", 2, BLOCK):  # the flock went with it
        pass


def test_close_with_a_buffer_still_exported_unlinks_and_logs(region_dir, caplog):
    created = Region.create(region_dir, "pool", 2, BLOCK)
    array = np.frombuffer(created.row(0), dtype=np.uint8)  # pins the mapping
    with caplog.at_level(logging.WARNING, logger="kvtierd.primary.region"):
        created.close()
    assert not os.path.exists(created.path)
    assert "garbage collector" in caplog.text
    array[0] = 1  # still mapped: no crash
    assert array[0] == 1


# -- attach (worker side) --------------------------------------------------------------


def test_attach_shares_bytes_both_ways(region):
    region.row(2)[:4] = b"\x01\x02\x03\x04"
    with AttachedRegion.attach(region.path, 8, BLOCK) as attached:
        assert attached.tensor.shape == (8, BLOCK) and attached.tensor.dtype == torch.uint8
        assert attached.tensor[2, :4].tolist() == [1, 2, 3, 4]
        attached.tensor[5, 100] = 77
        attached.numpy()[6, 7] = 88
        assert attached.numpy()[5, 100] == 77
    assert region.row(5)[100] == 77
    assert region.row(6)[7] == 88
    assert os.path.exists(region.path)  # attach never unlinks


def test_attach_is_zero_copy(region):
    with AttachedRegion.attach(region.path, 8, BLOCK) as attached:
        assert attached.numpy().ctypes.data == attached.tensor.data_ptr()
        assert np.shares_memory(attached.numpy(), attached.tensor.numpy())


def test_attach_refuses_a_file_too_small(region):
    with pytest.raises(ValueError, match=rf"{region.path}.*{8 * BLOCK} bytes.*{9 * BLOCK}"):
        AttachedRegion.attach(region.path, 9, BLOCK)
    with pytest.raises(FileNotFoundError):
        AttachedRegion.attach(region.path + ".missing", 1, BLOCK)


def test_attach_may_map_a_prefix(region):
    with AttachedRegion.attach(region.path, 4, BLOCK, populate=False) as attached:
        assert attached.tensor.shape == (4, BLOCK)


def test_rank_view_is_each_rows_rank_page(region):
    page = 4096
    with AttachedRegion.attach(region.path, 8, BLOCK) as attached:
        for rank in range(BLOCK // page):
            view = attached.rank_view(rank, page)
            assert view.shape == (8, page)
            assert view.stride() == (BLOCK, 1)
            assert view.data_ptr() == attached.tensor.data_ptr() + rank * page
            view[3].fill_(rank + 1)
        raw = attached.numpy()
        for rank in range(BLOCK // page):
            assert (raw[3, rank * page : (rank + 1) * page] == rank + 1).all()
        assert (raw[2] == 0).all() and (raw[4] == 0).all()
        with pytest.raises(ValueError, match="have 16384 bytes"):
            attached.rank_view(4, page)
        with pytest.raises(ValueError, match="have 16384 bytes"):
            attached.rank_view(0, BLOCK + 1)


def test_attached_close_is_idempotent_and_keeps_live_views_valid(region, caplog):
    attached = AttachedRegion.attach(region.path, 8, BLOCK)
    view = attached.rank_view(1, 4096)
    with caplog.at_level(logging.WARNING, logger="kvtierd_client.region"):
        attached.close()
        attached.close()
    assert attached.closed
    assert "garbage collector" in caplog.text
    view[0, 0] = 9  # the mapping outlives close() while a view exists: no crash
    assert region.row(0)[4096] == 9
    del view
    with pytest.raises(ValueError, match="closed"):
        attached.numpy()


def test_attach_populate_fallback_reads_pages_and_preserves_data(region, monkeypatch):
    def einval(mapping):
        raise OSError(errno.EINVAL, "MADV_POPULATE_WRITE unknown")

    region.buffer()[:] = bytes(range(256)) * (region.size // 256)
    monkeypatch.setattr(client_region, "_madvise_populate_write", einval)
    before = rss_bytes(region.path)
    with AttachedRegion.attach(region.path, 8, BLOCK) as attached:
        assert rss_bytes(region.path) == before + region.size
        assert bytes(attached.numpy()) == bytes(range(256)) * (region.size // 256)


def test_attach_populate_other_errors_propagate(region, monkeypatch):
    def broken(mapping):
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(client_region, "_madvise_populate_write", broken)
    with pytest.raises(OSError, match="injected"):
        AttachedRegion.attach(region.path, 8, BLOCK)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_register_cuda_is_a_no_op_without_cuda(region, monkeypatch):
    runtime_calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime_calls.append("cudart"))
    with AttachedRegion.attach(region.path, 8, BLOCK) as attached:
        attached.register_cuda()
        attached.numpy()[3][:4] = 7  # the mapping is still the worker's to use
        attached.unregister_cuda()
        assert bytes(attached.numpy()[3][:4]) == b"\x07" * 4
    assert runtime_calls == []  # no CUDA runtime call without CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_register_cuda_pins_the_mapping_once(region):
    with AttachedRegion.attach(region.path, 8, BLOCK) as attached:
        attached.register_cuda()
        attached.register_cuda()  # once: a second call does nothing
        gpu = torch.arange(BLOCK, device="cuda").to(torch.uint8)
        attached.tensor[1].copy_(gpu, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(attached.tensor[1], gpu.cpu())
        attached.unregister_cuda()


def test_importing_the_client_region_does_not_import_torch():
    env = dict(os.environ, PYTHONPATH=str(REPO / "client"))
    code = "import sys, kvtierd_client.region; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode == 0


def test_the_runtime_library_is_found_among_the_mapped_files():
    from kvtierd_client._shm.cuda_runtime import clear_last_error, loaded_libraries

    maps = (
        "7f00-7f10 r-xp 00000000 08:01 42 /opt/venv/lib/nvidia/cu13/lib/libcudart.so.13\n"
        "7f10-7f20 r--p 00010000 08:01 42 /opt/venv/lib/nvidia/cu13/lib/libcudart.so.13\n"
        "7f20-7f30 rw-p 00000000 00:00 0 \n"
        "7f30-7f40 r-xp 00000000 08:01 43 /usr/lib/libcudart_static_helper.so\n"
        "7f40-7f50 r-xp 00000000 08:01 44 /usr/lib/libcuda.so.1\n"
    )
    assert loaded_libraries("libcudart.so", maps) == [
        "/opt/venv/lib/nvidia/cu13/lib/libcudart.so.13"
    ]
    # this process: a CUDA build of torch has mapped it, a CPU build has not
    assert clear_last_error() == bool(loaded_libraries("libcudart.so"))
