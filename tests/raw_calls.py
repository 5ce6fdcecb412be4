"""gRPC calls by hand, without the client library, for the tests of the daemon's bounds:
sessions, stores and long keys through a bare stub, and a daemon's resident memory."""

from __future__ import annotations

import grpc
from daemon_harness import DaemonProcess

from kvtierd_client.wire.proto import pb2, pb2_grpc


def open_session(stub: pb2_grpc.KVTierStub, pool: str, num_blocks: int) -> str:
    spec = pb2.PoolSpec(name=pool, block_bytes=4096, num_blocks=num_blocks)
    return stub.OpenSession(pb2.OpenSessionRequest(pool=spec)).session_id


def store(stub: pb2_grpc.KVTierStub, session: str, keys: list[bytes]) -> None:
    grant = stub.PrepareStore(pb2.PrepareStoreRequest(session_id=session, keys=keys))
    assert grant.accepted
    stub.CompleteStore(
        pb2.CompleteStoreRequest(session_id=session, keys=grant.keys_to_store, success=True)
    )


def long_keys(start: int, count: int, length: int = 256) -> list[bytes]:
    return [i.to_bytes(8, "big") * (length // 8) for i in range(start, start + count)]


def read_until_error(stream: grpc.Call) -> tuple[list[int], grpc.RpcError]:
    """The seqs a stream yields before it fails, and its error (it must fail)."""
    seqs: list[int] = []
    try:
        for event in stream:
            seqs.append(event.seq)
    except grpc.RpcError as error:
        return seqs, error
    raise AssertionError(f"the stream ended without an error after {seqs}")


def first_seq_or_code(stream: grpc.Call) -> int | grpc.StatusCode:
    try:
        return next(stream).seq
    except grpc.RpcError as error:
        return error.code()


def vm_rss(daemon: DaemonProcess) -> int:
    """The daemon's resident set in bytes (its region's shared pages included)."""
    return _status_bytes(daemon, "VmRSS:")


def anon_rss(daemon: DaemonProcess) -> int:
    """The daemon's resident anonymous memory in bytes: its heaps and stacks,
    without its regions' shared pages or its mapped files."""
    return _status_bytes(daemon, "RssAnon:")


def _status_bytes(daemon: DaemonProcess, field: str) -> int:
    with open(f"/proc/{daemon.proc.pid}/status") as status:
        line = next(line for line in status if line.startswith(field))
    return int(line.split()[1]) * 1024
