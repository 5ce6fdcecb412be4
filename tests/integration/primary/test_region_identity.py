"""The region a client maps is the one the daemon created (issue #18, item 2).

OpenSession announces the region file's device and inode; the client checks
them on the very descriptor it maps. The attack of the issue: someone who may
write ``memory.shm_dir`` swaps the region file for their own; a new client must
refuse it instead of mapping the attacker's bytes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtierd_client.client import Client
from kvtierd_client.region import RegionIdentityError, attach_announced

BLOCK = 4096
BLOCKS = 4


def test_region_announces_the_identity_of_the_file_the_daemon_created(daemon, pool_name):
    with Client(daemon.address) as client:
        session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=BLOCKS)
        st = os.stat(session.region.path)
        assert (session.region.st_dev, session.region.st_ino) == (st.st_dev, st.st_ino)
        with attach_announced(session.region) as attached:
            attached.numpy()[0][:4] = memoryview(b"ours")
        session.close()


def test_client_refuses_a_region_file_swapped_under_it(daemon, pool_name):
    with Client(daemon.address) as client:
        session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=BLOCKS)
        path = Path(session.region.path)
        aside = path.with_name(path.name + ".aside")
        os.rename(path, aside)  # the attacker's swap: same name, same size, other bytes
        try:
            path.write_bytes(b"\xee" * (BLOCK * BLOCKS))
            with pytest.raises(RegionIdentityError, match="not the region the daemon created"):
                attach_announced(session.region)
        finally:
            os.replace(aside, path)  # the daemon's file back, for its shutdown
        with attach_announced(session.region) as attached:  # the real one maps
            assert attached.size == BLOCK * BLOCKS
        session.close()
