"""Values that cross the wire, shared by the client and the daemon: ``LookupResult`` and
``StoreResult``. Defined in :mod:`kvtierd_client.wire.results`; this is their public
import path."""

from kvtierd_client.wire.results import LookupResult, StoreResult

__all__ = ["LookupResult", "StoreResult"]
