"""The manager calls on a session's keys, one function each, shared by the single RPCs
and by Batch (:mod:`kvtierd.api.handlers`): each turns a validated call into the pool's
call and the pool's answer into its response message.

The caller has resolved the session (it is live and the caller's) and validated the
keys; these functions validate nothing else and hold no state. Event-loop only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvtierd.api import wire
from kvtierd.api.validation import check_descriptions, check_keys
from kvtierd.core.sessions import Session
from kvtierd.errors import InvalidArgument
from kvtierd.tiering.remote import RemoteWait
from kvtierd_client.wire.proto import pb2


def lookup(session: Session, keys: list[bytes], request: Any) -> pb2.LookupResponse:
    if request.pin:
        results, block_ids = session.pool.lookup_and_pin(session.id, keys, prefix=request.prefix)
        return pb2.LookupResponse(results=wire.lookup_results(results), block_ids=block_ids)
    results = session.pool.lookup(keys, prefix=request.prefix)
    return pb2.LookupResponse(results=wire.lookup_results(results))


def touch(session: Session, keys: list[bytes], request: Any) -> pb2.TouchResponse:
    session.pool.touch(keys)
    return pb2.TouchResponse()


def prepare_load(session: Session, keys: list[bytes], request: Any) -> pb2.PrepareLoadResponse:
    return pb2.PrepareLoadResponse(block_ids=session.pool.prepare_load(session.id, keys))


def complete_load(session: Session, keys: list[bytes], request: Any) -> pb2.CompleteLoadResponse:
    session.pool.complete_load(session.id, keys, unused=request.unused)
    return pb2.CompleteLoadResponse()


def prepare_store(session: Session, keys: list[bytes], request: Any) -> pb2.PrepareStoreResponse:
    grant = session.pool.prepare_store(session.id, keys)
    if grant is None:
        return pb2.PrepareStoreResponse(accepted=False)
    return pb2.PrepareStoreResponse(
        accepted=True,
        keys_to_store=grant.keys_to_store,
        block_ids=grant.block_ids,
        evicted_keys=grant.evicted_keys,
    )


def complete_store(session: Session, keys: list[bytes], request: Any) -> pb2.CompleteStoreResponse:
    descriptions = request.descriptions
    if descriptions and request.success:
        check_descriptions(keys, descriptions)
        session.pool.describe(request)
    session.pool.complete_store(session.id, keys, request.success)
    return pb2.CompleteStoreResponse()


def batch_remote_wait(session: Session, ops: Any, max_keys: int) -> RemoteWait | None:
    """What the lookups of a Batch wait for (one wait for all; an op that will be
    refused is left out: its error is its result)."""
    merged: RemoteWait | None = None
    for op in ops:
        if op.WhichOneof("op") != "lookup":
            continue
        call = op.lookup
        keys = list(call.keys)
        if (call.session_id and call.session_id != session.id) or not valid_keys(keys, max_keys):
            continue
        wait = session.pool.remote_wait(keys, prefix=call.prefix)
        if wait is None:
            continue
        if merged is None:
            merged = wait
        else:
            merged.futures += wait.futures
            merged.tiers += wait.tiers
    return merged


def valid_keys(keys: list[bytes], max_keys: int) -> bool:
    try:
        check_keys(keys, max_keys)
    except InvalidArgument:
        return False
    return True


# A Batch's operations by their oneof name.
BATCH_OPS: dict[str, Callable[[Session, list[bytes], Any], Any]] = {
    "lookup": lookup,
    "touch": touch,
    "prepare_load": prepare_load,
    "complete_load": complete_load,
    "prepare_store": prepare_store,
    "complete_store": complete_store,
}
