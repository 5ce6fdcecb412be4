"""kvtierd.primary.safecopy: copies out of a shared mapping whose file a client may truncate."""

from __future__ import annotations

import mmap
import os
import tempfile

from kvtierd.primary.safecopy import IOV_MAX, address_of, gather


def test_gather_copies_ranges_back_to_back_and_comes_back_short_past_a_truncation():
    fd, path = tempfile.mkstemp(dir="/dev/shm")
    try:
        os.ftruncate(fd, 1 << 20)
        mapping = mmap.mmap(fd, 1 << 20)
        view = memoryview(mapping)
        view[:] = bytes(range(256)) * 4096
        base = address_of(view)
        into = bytearray(3 * 4096)
        ranges = [(0, 4096), (8192, 12288), (65536, 69632)]
        assert gather(base, ranges, into) == 3 * 4096
        assert into == b"".join(view[start:end] for start, end in ranges)
        many = [(i * 64, i * 64 + 64) for i in range(IOV_MAX + 5)]  # past one call's iovecs
        assert gather(base, many, bytearray(64 * len(many))) == 64 * len(many)
        os.ftruncate(fd, 8192)  # a client cuts the file: touching page 2 would be SIGBUS
        assert gather(base, ranges, into) == 4096  # the first range whole, none after
        view.release()
        mapping.close()
    finally:
        os.close(fd)
        os.unlink(path)
