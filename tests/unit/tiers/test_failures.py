"""The one classification of failed block loads every tier uses (kvtierd.tiers.failures):
what each tier's errors mean for the block, so that no tier removes a good block for a
fault of its own machinery (issue #40, item 5)."""

from __future__ import annotations

import errno

import pytest
import redis
from redis.exceptions import ClusterDownError

from kvtierd.primary.rows import RegionCutShort
from kvtierd.tiers.blockformat import IntegrityRefused
from kvtierd.tiers.failures import CAUSE_MAX_CHARS, LoadFailure, classify, sort_failed
from kvtierd.tiers.fs.blockfile import CorruptFile
from kvtierd.tiers.fs.blockio import WorkerDied, WorkerStalled
from kvtierd.tiers.iopool import PoolShutDown
from kvtierd.tiers.redis.blockio import BlockCorrupt, BlockMissing
from kvtierd.tiers.redis.nodefaults import NodeFaults, NodeSkipped

MISSING, CORRUPT, TRANSIENT, FAULT = (
    LoadFailure.MISSING,
    LoadFailure.CORRUPT,
    LoadFailure.TRANSIENT,
    LoadFailure.FAULT,
)


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        # fs tier
        (CorruptFile("checksum mismatch", (1, 2)), CORRUPT),
        (IntegrityRefused("no MAC"), CORRUPT),
        (FileNotFoundError(errno.ENOENT, "gone"), MISSING),
        (WorkerStalled(errno.ETIMEDOUT, "did not answer within 2s"), TRANSIENT),
        (WorkerDied(errno.EIO, "died with exit status -9"), TRANSIENT),
        (PoolShutDown("I/O pool shut down"), TRANSIENT),
        (TimeoutError("no answer in time"), TRANSIENT),
        (OSError(errno.EIO, "Input/output error"), FAULT),
        (PermissionError(errno.EACCES, "Permission denied"), FAULT),
        (RegionCutShort("row 3 is past the end"), FAULT),
        (RuntimeError("block I/O: ValueError: bad"), FAULT),
        # redis tier (its outages through NodeFaults.outage)
        (BlockCorrupt("value of 12 bytes"), CORRUPT),
        (BlockMissing("6b6579"), MISSING),
        (redis.TimeoutError("Timeout reading from socket"), TRANSIENT),
        (redis.ConnectionError("Connection refused"), TRANSIENT),
        (NodeSkipped("node skipped"), TRANSIENT),
        (ClusterDownError("CLUSTERDOWN"), TRANSIENT),
        (redis.AuthenticationError("WRONGPASS"), FAULT),
        (redis.ResponseError("NOPERM"), FAULT),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else None,
)
def test_each_tier_error_is_classified_once_for_all_tiers(
    error: BaseException, kind: LoadFailure
) -> None:
    assert classify(error, NodeFaults.outage) is kind


def test_without_its_tier_s_outage_test_a_library_error_is_a_fault() -> None:
    assert classify(redis.TimeoutError("Timeout reading from socket")) is FAULT


def test_sort_failed_names_missing_and_transient_keys_and_the_first_cause() -> None:
    keys = [b"ok", b"gone", b"stalled", b"bad", b"died", b"eio"]
    errors = [
        None,
        FileNotFoundError(errno.ENOENT, "gone"),
        WorkerStalled(errno.ETIMEDOUT, "pid 7 did not answer"),
        CorruptFile("checksum mismatch", (1, 2)),
        WorkerDied(errno.EIO, "pid 8 died"),
        OSError(errno.EIO, "Input/output error"),
    ]
    failed = sort_failed(keys, errors)
    assert failed.missing == (b"gone",)
    assert failed.transient == (b"stalled", b"died")
    assert failed.cause == WorkerStalled.cause  # a shared constant, not the message
    assert "io_worker_timeout" in failed.cause


def test_a_cause_is_cut_to_its_bound() -> None:
    failed = sort_failed([b"k"], [TimeoutError()], lambda error: "x" * 1000)
    assert failed.cause == "x" * CAUSE_MAX_CHARS
