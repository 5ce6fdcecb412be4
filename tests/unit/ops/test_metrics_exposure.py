"""What the metrics endpoint shows and how often it answers: ``server.metrics_pool_labels``
(parsed, resolved with and without principals, matched like principals' pool
patterns) and the endpoint's token buckets (an injected clock)."""

from __future__ import annotations

import pytest

from kvtierd.config import ConfigError, load_config
from kvtierd.ops.metrics import pool_labels_for
from kvtierd.ops.metrics_http import TokenBuckets


def labels_option(value: object) -> tuple[str, ...] | None:
    return load_config(overrides={"server.metrics_pool_labels": value}).server.metrics_pool_labels


def test_the_option_takes_auto_a_list_or_a_comma_separated_string():
    assert load_config(env={}).server.metrics_pool_labels is None  # default: "auto"
    assert labels_option("auto") is None
    assert labels_option(["team-a/*", "shared"]) == ("team-a/*", "shared")
    assert labels_option("team-a/*, shared") == ("team-a/*", "shared")
    assert labels_option("") == ()
    env = {"KVTIERD_SERVER_METRICS_POOL_LABELS": "x/*"}
    assert load_config(env=env).server.metrics_pool_labels == ("x/*",)


@pytest.mark.parametrize("bad", [7, [""], ["x" * 257], [1], ["p"] * 257])
def test_a_bad_value_names_the_option(bad):
    with pytest.raises(ConfigError) as info:
        labels_option(bad)
    assert str(info.value).startswith("server.metrics_pool_labels: expected")


def test_auto_shows_every_pool_without_principals_and_none_with_them():
    assert pool_labels_for(None, principals=False).shows("team-a/x")
    assert not pool_labels_for(None, principals=True).shows("team-a/x")
    chosen = pool_labels_for(("team-a/*",), principals=True)
    assert chosen.shows("team-a/x/y") and not chosen.shows("team-b/x")
    assert not pool_labels_for((), principals=False).shows("anything")


def test_a_peer_gets_its_burst_then_its_rate_and_the_oldest_peers_are_forgotten():
    now = [0.0]
    buckets = TokenBuckets(rate=1.0, burst=3, max_keys=2, clock=lambda: now[0])
    assert [buckets.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("a") == pytest.approx(1.0)
    now[0] = 0.5
    assert buckets.take("a") == pytest.approx(0.5)  # refused: nothing taken
    now[0] = 1.0
    assert buckets.take("a") == 0.0
    assert buckets.take("b") == 0.0  # another peer has its own burst
    buckets.take("c")  # a third key: "a", the least recently used, is forgotten
    assert buckets.take("a") == 0.0
