"""The trace replay's engines stand in for vLLM engines: they must queue completions
as long as the vLLM adapter does, or the replay's RPCs per step measure a different
client configuration than the one engines run."""

from __future__ import annotations

from benchmarks import replay
from kvtierd_client.vllm.settings import DEFAULT_FLUSH_AFTER, PluginSettings


def test_replay_engines_flush_queued_completions_after_the_adapters_default():
    assert PluginSettings.from_extra_config({}).flush_after == DEFAULT_FLUSH_AFTER
    assert replay.DEFAULT_FLUSH_AFTER == DEFAULT_FLUSH_AFTER
