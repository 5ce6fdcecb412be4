"""Runs kvtierd client calls as another user, for the authorization tests.

Started as root by ``tests/integration/security/test_authorization.py``: imports the
client, then drops to the uid, gid and groups it is given (the interpreter and
the modules live where that user may not read), then makes the calls in
order over a real socket and prints one JSON result per call. The daemon sees
this process's real credentials (SO_PEERCRED at connect time).

Usage: python peer_client.py '{"uid": 1001, "gid": 1001, "groups": [], "address":
"unix:///...", "calls": [["open", "team-a/x"], ["flush", "team-b/y"], ...]}'
"""

from __future__ import annotations

import json
import os
import sys

import grpc
import numpy  # noqa: F401 - imported while root: the user may not read the venv

from kvtierd_client._shm.region_fd import RegionAccessDenied, request_region_fd
from kvtierd_client.client import Client
from kvtierd_client.errors import KvtierError
from kvtierd_client.region import attach_announced
from kvtierd_client.wire.proto import pb2, pb2_grpc


def main() -> int:
    spec = json.loads(sys.argv[1])
    os.setgroups(spec.get("groups", []))
    os.setgid(spec["gid"])
    os.setuid(spec["uid"])
    results = []
    client: Client | None = None
    sessions: dict[str, object] = {}
    for call in spec["calls"]:
        try:
            if client is None:
                # gRPC only: the sessions opened here outlive this process (other
                # users' processes use their ids next), and a session bound to a
                # fast lane closes when its lane's process exits
                client = Client(spec["address"], timeout=10, fast_lane=False)
            results.append({"ok": run(client, sessions, call)})
        except KvtierError as err:
            results.append({"error": err.code.name, "details": err.details})
        except grpc.RpcError as err:
            results.append({"error": err.code().name, "details": err.details()})
    print(json.dumps({"uid": os.getuid(), "results": results}))
    return 0


def run(client: Client, sessions: dict[str, object], call: list) -> object:
    what, *args = call
    if what == "open":
        session = client.open_session(
            args[0], block_bytes=4096, num_blocks=args[1] if len(args) > 1 else 4
        )
        sessions[args[0]] = session
        return session.session_id
    if what == "lookup":  # on a session this process opened
        return [int(r) for r in sessions[args[0]].lookup([b"k"])]  # type: ignore[attr-defined]
    if what == "flush":
        return client.flush_pool(args[0])
    if what == "stats":
        return [p.name for p in client.get_stats(args[0] if args else "").pools]
    if what == "explain":
        return client.explain(args[0], b"k").summary
    if what == "watch":
        with client.watch_events(args[0], after_seq=-1, timeout=1.0) as stream:
            try:
                next(stream)
            except KvtierError as err:
                if err.code is grpc.StatusCode.DEADLINE_EXCEEDED:
                    return "watching"
                raise
        return "event"
    if what == "map":  # the region of a session this process opened, by descriptor
        session = sessions[args[0]]
        region = session.region  # type: ignore[attr-defined]
        with attach_announced(region, session_id=session.session_id) as attached:  # type: ignore[attr-defined]
            attached.numpy()[0, :4] = 7  # writable: the mapping is real
        return {"fd_socket": region.fd_socket, "path": region.path}
    if what == "map_foreign":  # [map_foreign, fd socket, someone else's session id]
        try:
            os.close(request_region_fd(args[0], args[1]))
        except RegionAccessDenied as err:
            return f"denied: {err}"
        return "mapped"
    if what == "open_path":  # a region (or any) file by path, for reading
        try:
            os.close(os.open(args[0], os.O_RDONLY))
        except PermissionError:
            return "EACCES"
        return "opened"
    if what == "lane_lookup":  # [lane_lookup, pool]: a session of its own on its fast lane
        with Client(client.address, timeout=10) as own:
            lane_session = own.open_session(args[0], block_bytes=4096, num_blocks=4)
            results = [int(r) for r in lane_session.lookup([b"k"])]
            used_lane = lane_session.fast_lane
            lane_session.close()
        return {"lane": used_lane, "results": results}
    if what in ("keepalive", "hijack_lookup", "close_session"):  # on someone else's session id
        return foreign_session_call(client, what, args[0])
    raise ValueError(f"unknown call {what!r}")


def foreign_session_call(client: Client, what: str, session_id: str) -> object:
    stub = pb2_grpc.KVTierStub(grpc.insecure_channel(client.target))
    metadata = client._credentials.metadata
    if what == "keepalive":
        return stub.KeepAlive(
            pb2.KeepAliveRequest(session_id=session_id), metadata=metadata
        ).lease_ms
    if what == "close_session":
        stub.CloseSession(pb2.CloseSessionRequest(session_id=session_id), metadata=metadata)
        return "closed"
    request = pb2.LookupRequest(session_id=session_id, keys=[b"k"])
    return list(stub.Lookup(request, metadata=metadata).results)


if __name__ == "__main__":
    raise SystemExit(main())
