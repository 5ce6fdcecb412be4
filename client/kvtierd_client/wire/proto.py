"""The generated ``kvtier.v1`` stubs (``make gen`` writes them under ``_proto``)."""

from __future__ import annotations

try:
    from kvtierd_client._proto.kvtier.v1 import kvtier_pb2 as pb2
    from kvtierd_client._proto.kvtier.v1 import kvtier_pb2_grpc as pb2_grpc
except ImportError as exc:  # pragma: no cover - only without `make gen`
    raise ImportError(
        "kvtierd_client's gRPC stubs are missing; run `make gen` (or `make install`)"
    ) from exc

__all__ = ["pb2", "pb2_grpc"]
