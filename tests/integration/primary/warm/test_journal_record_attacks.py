"""Issue #29, findings 5 and 7: a warm-restart journal edited while the daemon is
down, against real daemons and their real journal files.

5. Whoever can write the journal (the daemon's uid, or root) swapped the keys of
   two ``ready`` records and recomputed the records' CRC-32s: the row checksums
   still matched the rows, and the restarted daemon served each key with the
   other's bytes. A record's checksum now covers its key, its row and the pool
   (journal format 2): such records fail verification and are dropped.
7. A journal damaged in the middle (a complete record that fails its CRC, with
   more after it) was reported at INFO, like the last write a crash cuts short;
   it is a WARNING now.
"""

from __future__ import annotations

import json
import re
import signal
import struct
import zlib
from pathlib import Path

from daemon_harness import DaemonProcess
from warm_harness import BLOCK, BLOCKS, MISS, content, journal_of, read_row, store

from kvtierd_client.client import Client

_HEAD = struct.Struct("<BIHQ")  # kind, row, key length, checksum
_CRC = struct.Struct("<I")
READY = 1


def records(data: bytes) -> tuple[int, list[tuple[int, int, int, bytes, int]]]:
    """(end of the header, [(offset, kind, row, key, checksum)]) of a journal, read
    as an attacker would from its documented format."""
    (length,) = struct.unpack_from("<I", data, 12)
    json.loads(data[16 : 16 + length])  # the header: JSON, then its CRC
    offset = start = 16 + length + _CRC.size
    found = []
    while offset + _HEAD.size + _CRC.size <= len(data):
        kind, row, key_len, checksum = _HEAD.unpack_from(data, offset)
        key = data[offset + _HEAD.size : offset + _HEAD.size + key_len]
        found.append((offset, kind, row, key, checksum))
        offset += _HEAD.size + key_len + _CRC.size
    return start, found


def record(kind: int, row: int, key: bytes, checksum: int) -> bytes:
    body = _HEAD.pack(kind, row, len(key), checksum) + key
    return body + _CRC.pack(zlib.crc32(body))


def open_pool(daemon: DaemonProcess, client: Client):
    return client.open_session("edited", block_bytes=BLOCK, num_blocks=BLOCKS, layout="l1")


def test_swapping_the_keys_of_two_ready_records_never_serves_one_key_the_others_bytes(
    warm_daemon,
):
    daemon = warm_daemon[0]
    with Client(daemon.address) as client:
        session = open_pool(daemon, client)
        rows = store(session, [b"key-A", b"key-B"])
        region = session.region.path
    daemon.stop(signal.SIGTERM)
    journal = journal_of(region)
    data = bytearray(journal.read_bytes())
    _, found = records(bytes(data))
    ready = {key: (offset, row, checksum) for offset, kind, row, key, checksum in found
             if kind == READY}  # fmt: skip
    (a_at, a_row, a_sum), (b_at, b_row, b_sum) = ready[b"key-A"], ready[b"key-B"]
    assert (a_row, b_row) == (rows[b"key-A"], rows[b"key-B"])
    size = len(record(READY, 0, b"key-A", 0))
    # each record now names the other key: same rows, same checksums, valid CRCs
    data[a_at : a_at + size] = record(READY, a_row, b"key-B", a_sum)
    data[b_at : b_at + size] = record(READY, b_row, b"key-A", b_sum)
    journal.write_bytes(bytes(data))

    daemon = daemon.restart()
    warm_daemon.append(daemon)
    with Client(daemon.address) as client:
        session = open_pool(daemon, client)
        answers = session.lookup([b"key-A", b"key-B"])
        for key, answer in zip([b"key-A", b"key-B"], answers, strict=True):
            if answer != MISS:  # served: it must at least be its own bytes
                (row,) = session.prepare_load([key])
                assert read_row(region, row) == content(key), f"{key!r} served another's bytes"
        assert answers == [MISS, MISS]
        (stats,) = client.get_stats("edited").pools
        assert (stats.warm_adopted_blocks, stats.warm_dropped_blocks) == (0, 2)


def _adoption_line(daemon: DaemonProcess) -> str:
    lines = [line for line in daemon.log().splitlines() if "warm restart adopted" in line]
    assert len(lines) == 1, daemon.log()
    return lines[0]


def _level(line: str) -> str:
    match = re.match(r"\S+ \S+ (\w+) ", line)
    assert match is not None, line
    return match.group(1)


def _stored_then_stopped(daemon: DaemonProcess) -> tuple[Path, bytearray, list]:
    with Client(daemon.address) as client:
        session = open_pool(daemon, client)
        store(session, [b"one", b"two", b"three"])
        region = session.region.path
    daemon.stop(signal.SIGTERM)
    journal = journal_of(region)
    data = bytearray(journal.read_bytes())
    _, found = records(bytes(data))
    return journal, data, found


def test_a_journal_damaged_in_the_middle_is_a_warning(warm_daemon):
    daemon = warm_daemon[0]
    journal, data, found = _stored_then_stopped(daemon)
    offset, kind, _row, key, _ = next(r for r in found if r[1] == READY)
    assert found[-1][0] > offset  # records follow it: the middle of the file
    data[offset + _HEAD.size] ^= 0xFF  # one byte of its key: its CRC fails
    journal.write_bytes(bytes(data))
    daemon = daemon.restart()
    warm_daemon.append(daemon)
    with Client(daemon.address) as client:
        open_pool(daemon, client)
    line = _adoption_line(daemon)
    assert _level(line) == "WARNING", line
    assert f"from byte {offset}, where the journal is damaged in the middle" in line, line


def test_a_last_write_cut_short_stays_an_info(warm_daemon):
    daemon = warm_daemon[0]
    journal, data, _found = _stored_then_stopped(daemon)
    journal.write_bytes(bytes(data[:-5]))  # what a kill during the last append leaves
    daemon = daemon.restart()
    warm_daemon.append(daemon)
    with Client(daemon.address) as client:
        open_pool(daemon, client)
    line = _adoption_line(daemon)
    assert _level(line) == "INFO", line
    assert "torn journal bytes ignored" in line, line
