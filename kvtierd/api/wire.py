"""The daemon's enums as the wire's, typed (``kvtierd.contract``: same values).

``LookupResult`` and ``Medium`` are IntEnums whose values equal the wire enums
``LOOKUP_RESULT_*`` and ``MEDIUM_*``, so the service layer converts with ``int()``
and nothing else (an enum field of a message takes any int). protoc's ``.pyi``
types those fields as a class of its own (``pb2.LookupResult``, an ``int``
subclass there; at run time an ``EnumTypeWrapper``, nothing to convert with):
the casts below are the one place that says an int of ours is a wire value.
``tests/unit/api/test_wire.py`` checks that the names and values agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from kvtierd.contract import LookupResult, Medium
from kvtierd_client.wire.proto import pb2


def lookup_result(result: LookupResult) -> pb2.LookupResult:
    return cast("pb2.LookupResult", int(result))


def lookup_results(results: Sequence[LookupResult]) -> Sequence[pb2.LookupResult]:
    """``results`` itself (no copy: a Lookup's answer, one per key)."""
    return cast("Sequence[pb2.LookupResult]", results)


def medium(value: Medium) -> pb2.Medium:
    return cast("pb2.Medium", int(value))
