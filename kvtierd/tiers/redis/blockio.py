"""The redis tier's block I/O, run on I/O threads only: one value per block.

A value is exactly one block of :mod:`kvtierd.tiers.blockformat` (as an fs block file
is): the 4096-byte integrity header (key, pool fingerprint, payload length, payload
checksum, its own checksum; with integrity keys the key id and a MAC over
header and payload, :mod:`kvtierd.tiers.integrity`), then the row's bytes, under the Redis key
``<key_space><block key>``. :class:`RedisBlockIO` stores a row (``SET NX``, the
row sent unjoined from this thread's bounce buffer), loads one (``GETRANGE``,
bounded to one value's size plus a byte, verified before a byte reaches the
row) and deletes, through the tier's
:class:`~kvtierd.tiers.redis.link.RedisLink`.

Rows are never touched through the region's mapping (a client may truncate the
file under it: SIGBUS would kill the daemon). A store copies its row out with
:meth:`~kvtierd.primary.rows.RegionRows.read` into :func:`~kvtierd.primary.rows.scratch`
(one row-sized buffer per I/O thread, reused: the bytes held are at most
``threads`` x ``block_bytes``), then hashes and sends that copy; a load writes
the verified payload in with :meth:`~kvtierd.primary.rows.RegionRows.write`
straight from the value redis-py returned. A row that cannot be copied
(:class:`~kvtierd.primary.rows.RegionCutShort`) fails that block only.

Ownership: the region rows of the jobs in flight (pinned by the daemon until the
job reports) and the link; no loop state. Each call may block up to the link's
timeout and raises what the server or the verification said: the caller
(:class:`~kvtierd.tiers.redis.tier.RedisTier`'s completion on the loop) counts.
"""

from __future__ import annotations

import redis
from redis.exceptions import AskError

from kvtierd.contract import BlockKey
from kvtierd.primary.rows import RegionRows, scratch
from kvtierd.tiers import blockformat
from kvtierd.tiers.failures import BlockAbsent, BlockRefused
from kvtierd.tiers.integrity import KeyRing
from kvtierd.tiers.iopool import Outcome, Pairs, each_block
from kvtierd.tiers.redis.link import RedisLink
from kvtierd.util.ratelimit import RateLimitedLog

# what a block's store or load did (the value of an I/O task's per-block outcome)
WRITTEN, PRESENT, LOADED = "written", "present", "loaded"


class BlockMissing(BlockAbsent):
    """The server holds no value under the block's key."""


class BlockCorrupt(BlockRefused):
    """The value under the block's key does not verify; it was deleted. ``integrity``:
    it is not sealed under the tier's integrity keys (no MAC, another key, forged)."""

    def __init__(self, reason: str, integrity: bool = False) -> None:
        super().__init__(reason)
        self.integrity = integrity


class RedisBlockIO:
    """One pool's blocks in the server, seen from the I/O threads (thread-safe:
    no state of its own changes after construction)."""

    def __init__(
        self,
        link: RedisLink,
        key_space: bytes,
        identity: blockformat.PoolIdentity,
        rows: RegionRows,
        ttl_ms: int | None,
        faults: RateLimitedLog,
        name: str,
        keys: KeyRing | None = None,
    ) -> None:
        """``keys``: the tier's integrity keys (None: unkeyed values only)."""
        self.link = link
        self.keys = keys
        self.key_space = key_space
        self.fingerprint = identity.fingerprint
        self.block_bytes = identity.block_bytes
        self.value_bytes = blockformat.HEADER_SIZE + self.block_bytes
        self._rows = rows
        self._ttl_ms = ttl_ms
        self._faults = faults
        self._name = name

    def redis_key(self, key: BlockKey) -> bytes:
        return self.key_space + key

    # -- stores --------------------------------------------------------------------------

    def store_group(self, pairs: Pairs) -> list[Outcome]:
        """Stores each (key, row); one outcome per block (WRITTEN, PRESENT or its error)."""
        return each_block(pairs, self.store_one)

    def store_one(self, key: BlockKey, row: int) -> str:
        """Stores row ``row`` as ``key``'s value, sent from a copy (this thread's
        bounce buffer, valid until its next store: redis-py has written the whole
        command when ``store_value`` returns). Raises RegionCutShort when the row
        cannot be read (nothing is sent), or the server's error."""
        payload = scratch(self.block_bytes)
        self._rows.read(row, payload)
        header = blockformat.block_header(
            key=key, fingerprint=self.fingerprint, payload=payload, keys=self.keys
        )
        # header and row copy go out as separate buffers of one SET: never joined
        args: list[bytes] = [b"NX"]
        if self._ttl_ms:
            args += [b"PX", str(self._ttl_ms).encode()]
        redis_key = self.redis_key(key)
        chunks = resp_set(redis_key, header, payload, args)
        written = self.link.store_value(redis_key, chunks, lambda: header + bytes(payload), args)
        return WRITTEN if written else PRESENT

    # -- loads ---------------------------------------------------------------------------

    def load_group(self, pairs: Pairs) -> list[Outcome]:
        """Loads each (key, row); one outcome per block (LOADED or its error)."""
        return each_block(pairs, self.load_one)

    def load_one(self, key: BlockKey, row: int) -> str:
        """The verified payload into ``row`` (LOADED); BlockMissing, BlockCorrupt (the
        value was deleted) or the server's error otherwise, the row then unspecified
        (the daemon frees it: a failed promotion is never served)."""
        redis_key = self.redis_key(key)
        value = self.link.get(redis_key, self.value_bytes)  # bounded: one value + 1 byte
        if not isinstance(value, bytes):  # the client decodes nothing: never a str
            raise TypeError(f"GETRANGE answered {type(value).__name__}")
        if not value:  # GETRANGE of a missing key (a value is never empty)
            raise BlockMissing(key.hex())
        try:
            self.verify(key, value)
        except blockformat.CorruptBlock as exc:
            self.delete_if_same(redis_key, value)
            raise BlockCorrupt(exc.reason, exc.integrity) from None
        self._rows.write(row, value, blockformat.HEADER_SIZE)  # from the value: no copy
        return LOADED

    def verify(self, key: BlockKey, value: bytes) -> None:
        """Raises blockformat.CorruptBlock unless ``value`` is this pool's block of ``key``
        (IntegrityRefused: not sealed under the tier's keys)."""
        if len(value) != self.value_bytes:
            raise blockformat.CorruptBlock(
                f"value of {len(value)} bytes, expected {self.value_bytes}"
            )
        header = blockformat.decode_header(value)
        blockformat.verify_header(
            header, key=key, fingerprint=self.fingerprint, block_bytes=self.block_bytes
        )
        view = memoryview(value)
        blockformat.check_payload(
            view[: blockformat.HEADER_SIZE], header, view[blockformat.HEADER_SIZE :], self.keys
        )

    # -- deletes --------------------------------------------------------------------------

    def delete_if_same(self, redis_key: bytes, value: bytes) -> None:
        """Deletes a bad value unless another writer replaced it meanwhile
        (WATCH/MULTI: a good value another daemon just wrote stays)."""
        try:
            with self.link.node_client(redis_key).pipeline(transaction=True) as pipe:
                pipe.watch(redis_key)
                # bounded as the load's read: ``value`` is at most value_bytes + 1 long
                if pipe.getrange(redis_key, 0, self.value_bytes) != value:
                    return
                pipe.multi()
                pipe.delete(redis_key)
                pipe.execute()
        except (redis.WatchError, AskError):
            pass  # replaced meanwhile, or moved to another node (deleted at its next read)
        except redis.RedisError as exc:
            self._faults.warning(
                ("delete", self._name), "redis tier %s: delete failed: %s", self._name, exc
            )

    def delete(self, redis_keys: list[bytes]) -> int:
        """One DEL per key, pipelined per node (a multi-key DEL would be CROSSSLOT)."""
        replies, _ = self.link.per_node("DEL", redis_keys)
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        return sum(int(r) for r in replies)


def resp_set(
    redis_key: bytes, header: bytes, payload: memoryview, args: list[bytes]
) -> list[bytes | memoryview]:
    """``SET redis_key header+payload *args`` as RESP chunks, the payload unjoined."""
    parts = [b"SET", redis_key]
    head = [b"*%d\r\n" % (len(parts) + 1 + len(args))]
    head += [b"$%d\r\n%s\r\n" % (len(p), p) for p in parts]
    head.append(b"$%d\r\n" % (len(header) + len(payload)))
    tail = [b"\r\n"] + [b"$%d\r\n%s\r\n" % (len(a), a) for a in args]
    return [b"".join(head) + header, payload, b"".join(tail)]
