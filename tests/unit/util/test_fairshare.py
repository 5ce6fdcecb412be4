"""Fair shares of a bounded pool of places (kvtierd.util.fairshare): the rule
peer tickets and WatchEvents streams share."""

from __future__ import annotations

import pytest

from kvtierd.util.fairshare import FairShares


def take_while_allowed(shares: FairShares, name: str) -> int:
    taken = 0
    while not shares.full and shares.within_share(name):
        shares.take(name)
        taken += 1
    return taken


def test_each_name_may_always_take_its_share_however_fast_another_is():
    shares = FairShares(8, ["a", "b", "c"])  # share 2 each
    assert take_while_allowed(shares, "a") == 4  # 8 - the others' unused shares
    assert take_while_allowed(shares, "b") == 2
    assert take_while_allowed(shares, "c") == 2
    assert shares.full and len(shares) == 8


def test_places_nobody_claims_are_free_for_anyone_and_come_back():
    shares = FairShares(4, ["a", "b"])
    assert take_while_allowed(shares, "a") == 2
    shares.take("b")
    assert not shares.within_share("a")  # one free place: b's unused share
    shares.take("b")
    shares.give_back("b")
    shares.give_back("b")
    assert take_while_allowed(shares, "a") == 0  # b's share is kept free for b
    for _ in range(2):
        shares.give_back("a")
    assert len(shares) == 0 and shares.held("a") == 0


def test_without_names_one_holder_may_take_every_place():
    shares = FairShares(3)
    assert shares.share == 3
    assert take_while_allowed(shares, "anyone") == 3


def test_more_names_than_places_still_gives_each_one_place():
    shares = FairShares(2, ["a", "b", "c"])
    assert shares.share == 1
    assert take_while_allowed(shares, "a") == 1
    assert take_while_allowed(shares, "b") == 1
    assert take_while_allowed(shares, "c") == 0  # full: the limit holds over the shares


def test_a_limit_below_one_is_refused():
    with pytest.raises(ValueError, match="limit must be >= 1"):
        FairShares(0)
