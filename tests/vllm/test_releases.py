"""The vLLM releases the plug-in supports (kvtierd_client.vllm.compat)."""

from __future__ import annotations

import logging

import pytest

from kvtierd_client.vllm import compat
from kvtierd_client.vllm.compat import VllmCalls, release_of, warn_if_unknown


def test_release_numbers_are_read_from_vllms_version_strings():
    assert release_of("0.33.0") == (0, 33)
    assert release_of("0.32.0+cpu") == (0, 32)
    assert release_of("0.34.0rc1") == (0, 34)
    assert release_of("0.34.1.dev7+g1234") == (0, 34)
    assert release_of("dev") is None


def test_an_unknown_release_gets_one_warning_per_process(monkeypatch, caplog):
    monkeypatch.setattr(compat, "_warned", False)
    caplog.set_level(logging.WARNING, logger="kvtierd_client.vllm")
    assert warn_if_unknown("0.33.0") and warn_if_unknown("0.32.0")
    assert caplog.records == []
    assert not warn_if_unknown("0.34.1")
    assert not warn_if_unknown("dev")
    (record,) = caplog.records
    assert record.getMessage().startswith(
        "kvtierd: vLLM 0.34.1 is not a release this plug-in supports (0.32, 0.33); it "
        "assumes 0.33's behaviour"
    )
    monkeypatch.setattr(compat, "_warned", False)
    assert not warn_if_unknown("0.31.2")
    assert "it assumes 0.32's behaviour" in caplog.records[-1].getMessage()


def test_the_installed_release_is_supported_and_says_nothing(monkeypatch, caplog):
    monkeypatch.setattr(compat, "_warned", False)
    caplog.set_level(logging.WARNING, logger="kvtierd_client.vllm")
    assert warn_if_unknown()
    assert caplog.records == []


@pytest.mark.parametrize(
    ("release", "last", "hook"),
    [((0, 32), False, False), ((0, 33), True, True), ((0, 35), True, True), (None, True, True)],
)
def test_each_release_is_expected_to_call_the_manager_its_way(release, last, hook):
    assert VllmCalls.of_release(release) == VllmCalls(schedule_end_last=last, reset_flushed=hook)
