"""The fast lane's byte bounds (``kvtierd.api.lanebuffers``): per owner and in all,
refusals that name the bound and reserve nothing, and buffers of exactly the
announced size."""

from __future__ import annotations

import mmap

from kvtierd.api.lanebuffers import MAPPED_FROM_BYTES, LaneBuffers, frame_buffer


def test_an_owner_is_held_to_its_bound_and_others_are_not():
    buffers = LaneBuffers(total=1000, per_owner=400)
    assert buffers.reserve("team-a", 300) is None
    refusal = buffers.reserve("team-a", 101)
    assert refusal is not None and "team-a already holds 300 B" in refusal
    assert "at most 400 B per principal" in refusal
    assert buffers.held("team-a") == 300 and buffers.used == 300  # nothing taken by a refusal
    assert buffers.reserve("team-b", 400) is None
    assert buffers.reserve("team-a", 100) is None


def test_all_owners_together_are_held_to_the_total():
    buffers = LaneBuffers(total=1000, per_owner=400)
    for owner in ("a", "b"):
        assert buffers.reserve(owner, 400) is None
    refusal = buffers.reserve("c", 201)
    assert refusal is not None and "at most 1000 B in all" in refusal
    assert buffers.used == 800
    buffers.release("a", 400)
    assert buffers.held("a") == 0 and buffers.used == 400
    assert buffers.reserve("c", 201) is None


def test_frame_buffers_have_the_announced_size_and_large_ones_are_mapped():
    small = frame_buffer(100)
    assert isinstance(small, bytearray) and len(small) == 100
    large = frame_buffer(MAPPED_FROM_BYTES + 1)
    assert isinstance(large, mmap.mmap) and len(large) == MAPPED_FROM_BYTES + 1
    view = memoryview(large)
    view[-2:] = b"ok"
    assert bytes(view[-2:]) == b"ok"
