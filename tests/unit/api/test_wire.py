"""The daemon's enums are the wire's (``kvtierd.api.wire`` casts on that ground)."""

from __future__ import annotations

import pytest

from kvtierd.api import wire
from kvtierd.contract import LookupResult, Medium
from kvtierd_client.wire.proto import pb2


@pytest.mark.parametrize(
    ("enum", "wire_enum", "prefix"),
    [(LookupResult, pb2.LookupResult, "LOOKUP_RESULT_"), (Medium, pb2.Medium, "MEDIUM_")],
)
def test_names_and_values_agree(enum, wire_enum, prefix):
    ours = {prefix + member.name: member.value for member in enum}
    theirs = {name: value for name, value in wire_enum.items() if not name.endswith("UNSPECIFIED")}
    assert ours == theirs


def test_conversions_are_the_values():
    assert wire.lookup_result(LookupResult.HIT) == pb2.LOOKUP_RESULT_HIT
    results = [LookupResult.MISS, LookupResult.RETRY]
    assert wire.lookup_results(results) is results
    assert wire.medium(Medium.STORAGE) == pb2.MEDIUM_STORAGE
    assert pb2.Event(medium=wire.medium(Medium.CPU)).medium == pb2.MEDIUM_CPU
