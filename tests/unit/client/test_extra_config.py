"""The engines' extra config (kvtierd_client._extra_config): one reader for what vLLM's
``kv_connector_extra_config`` and SGLang's backend extra config share, each bad value
refused with the plug-in's error naming the key as that engine's docs spell it."""

from __future__ import annotations

import math
import re

import pytest

from kvtierd_client._extra_config import POLICY_HELP, ExtraConfig
from kvtierd_client.wire.address import default_address
from kvtierd_client.wire.results import DEFAULT_EVICTION_POLICY, EVICTION_POLICIES


class PluginError(ValueError):
    """Stands for a plug-in's own error (SGLang's SettingsError)."""


def config(**values: object) -> ExtraConfig:
    return ExtraConfig(values, lambda key: f"extra.{key}", PluginError)


def test_the_policies_are_the_wire_names_with_the_default_first() -> None:
    assert POLICY_HELP == "'lru' (default) or 'arc'"
    assert config().eviction_policy() == DEFAULT_EVICTION_POLICY
    assert [
        config(eviction_policy=name.upper()).eviction_policy() for name in EVICTION_POLICIES
    ] == (list(EVICTION_POLICIES))
    with pytest.raises(
        PluginError, match=r"^extra.eviction_policy: kvtierd supports 'lru' and 'arc', got 'fifo'$"
    ):
        config(eviction_policy="fifo").eviction_policy()


def test_the_address_defaults_and_a_bad_one_is_named() -> None:
    assert config().address() == default_address()
    assert config(kvtierd_address="host:7000").address() == "host:7000"
    with pytest.raises(PluginError, match=r"^extra.kvtierd_address: "):
        config(kvtierd_address="http://host").address()


@pytest.mark.parametrize("raw", [True, False, -1, "soon", math.inf, float("nan"), [1]])
def test_seconds_must_be_a_finite_number_at_least_the_minimum(raw: object) -> None:
    refused = rf"^extra.t: expected seconds >= 0.0, got {re.escape(repr(raw))}$"
    with pytest.raises(PluginError, match=refused):
        config(t=raw).seconds("t", 1.0, minimum=0.0)


def test_seconds_read_numbers_and_text() -> None:
    assert config().seconds("t", 1.5, minimum=0.0) == 1.5
    assert config(t="2.5").seconds("t", 1.0, minimum=0.0) == 2.5
    assert config(t=0).seconds("t", 1.0, minimum=0.0) == 0.0


@pytest.mark.parametrize("raw", [True, -1, 1.5, "x", [1]])
def test_a_byte_count_is_a_whole_number(raw: object) -> None:
    with pytest.raises(PluginError, match=r"^extra.n: expected a non-negative integer, got "):
        config(n=raw).byte_count("n")


def test_byte_counts_and_names() -> None:
    assert (config().byte_count("n"), config(n="4096").byte_count("n")) == (0, 4096)
    assert config(n=2.0).byte_count("n") == 2
    assert (config().name("p"), config(p="").name("p"), config(p=7).name("p")) == (None, None, "7")


def test_the_kv_event_keys_default_and_a_bad_value_is_named() -> None:
    assert (config().events_publisher(), config().engine_events()) == ("engine", "tcp://*:5557")
    assert config().description_bytes() == 16 << 20
    assert config(kvtierd_events="Daemon").events_publisher() == "daemon"
    assert config(kvtierd_engine_events="ipc:///run/e").engine_events() == "ipc:///run/e"
    with pytest.raises(PluginError, match=r'^extra.kvtierd_events: expected "engine" or "daemon"'):
        config(kvtierd_events="router").events_publisher()
    with pytest.raises(PluginError, match=r"^extra.kvtierd_engine_events: expected tcp://HOST"):
        config(kvtierd_engine_events="tcp://*").engine_events()
    with pytest.raises(PluginError, match=r"^extra.kvtierd_description_bytes: expected at least"):
        config(kvtierd_description_bytes=100).description_bytes()
