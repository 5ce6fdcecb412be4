"""Values that cross the wire, shared by the client and the daemon: ``LookupResult``,
``StoreResult`` and ``BlockDescription``. Defined in :mod:`kvtierd_client.wire`; this
is their public import path."""

from kvtierd_client.wire.descriptions import BlockDescription, hash64
from kvtierd_client.wire.results import LookupResult, StoreResult

__all__ = ["BlockDescription", "LookupResult", "StoreResult", "hash64"]
