"""The accounting of WatchEvents places (kvtierd.api.watch): open streams, and per
principal the ended streams whose end their clients have not read."""

from __future__ import annotations

import pytest

from kvtierd.api.watch import WatchStats, WatchStreams
from kvtierd.errors import ResourceExhausted


def test_an_ending_stream_gives_its_open_place_back_at_once():
    streams = WatchStreams(max_streams=1, write_timeout=1.0, max_unread=4)
    slot = streams.reserve("a")
    with pytest.raises(ResourceExhausted, match="limits.max_watch_streams"):
        streams.reserve("a")
    slot.ending()
    assert streams.statistics() == WatchStats(0, 1, 1, 0)
    again = streams.reserve("a")  # its place is free while the first one's end is unread
    slot.close()
    again.close()
    assert streams.statistics() == WatchStats(0, 0, 1, 0)


def test_a_principal_at_its_unread_limit_is_refused_and_others_are_not():
    streams = WatchStreams(max_streams=8, write_timeout=1.0, max_unread=2)
    left = [streams.reserve("a") for _ in range(2)]
    for slot in left:
        slot.ending()
    with pytest.raises(ResourceExhausted, match="'a'.*limits.max_unread_watch_streams"):
        streams.reserve("a")
    streams.reserve("b").close()
    left[0].close()  # one end read (or its client gone): room again
    streams.reserve("a").close()
    assert streams.statistics().unread_streams == 1


def test_each_move_happens_once():
    streams = WatchStreams(max_streams=2, write_timeout=1.0, max_unread=2)
    slot = streams.reserve("a")
    slot.ending()
    slot.ending()
    slot.close()
    slot.close()
    assert streams.statistics() == WatchStats(0, 0, 0, 0)
    with streams.held(streams.reserve("a")) as held:
        assert streams.statistics().open_streams == 1
    assert held.state == "closed" and streams.statistics().open_streams == 0


def test_open_places_are_shared_fairly_between_principals():
    """Scenario: 4 places, principals a and b (share 2 each). a takes its 2 and is
    refused a third (the 2 free ones are b's share) naming the limit and the
    shares; b still gets its 2. A principal nobody configured has a share too."""
    streams = WatchStreams(max_streams=4, write_timeout=1.0, principals=["a", "b"])
    mine = [streams.reserve("a") for _ in range(2)]
    with pytest.raises(ResourceExhausted, match=r"'a' has 2 .*other principals' shares"):
        streams.reserve("a")
    theirs = [streams.reserve("b") for _ in range(2)]
    assert streams.statistics().open_streams == 4
    mine[0].ending()  # an ending stream gives its share back at once
    streams.reserve("a")
    for slot in [*mine, *theirs]:
        slot.close()
    assert streams.statistics().refused == 1
