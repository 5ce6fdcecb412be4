"""The default authorization of region descriptors (``may_map``): what the
socket permissions allow, nothing more."""

from __future__ import annotations

import os

from kvtierd.security.region_access import may_map

NOBODY_UID = 65534  # not the daemon's uid (tests run as root or a normal user)
UNUSED_GID = 64999  # a group nobody here is in


def test_the_daemons_own_uid_and_root_may_map():
    assert may_map(os.geteuid(), UNUSED_GID, "pool")
    assert may_map(0, UNUSED_GID, "pool")


def test_a_member_of_the_socket_group_may_map():
    assert may_map(NOBODY_UID, 4242, "pool", socket_gid=4242)


def test_another_uid_outside_the_socket_group_may_not():
    if os.geteuid() == NOBODY_UID:  # pragma: no cover - not how tests run
        return
    assert not may_map(NOBODY_UID, UNUSED_GID, "pool", socket_gid=4242)
