"""An fs tier's write and read paths on the I/O threads (docs/design/tiers.md).

A job's blocks are cut into groups of about 16 MiB
(:func:`~kvtierd.tiers.iopool.group_tasks`); an I/O thread runs one group at
a time with :class:`BlockGroups`: checks its rows, reserves (store) or marks
being read (load) its keys in the :class:`~kvtierd.tiers.fs.index.BlockIndex`,
sends the group to the tier's :class:`~kvtierd.tiers.fs.blockio.BlockIo` as one
request, and settles the keys from the replies. The tier (:mod:`.tier`) owns the
lifecycle and reports jobs on the loop.

Invariants:

* Every key a group reserved for writing or marked being read is settled in the
  index before the group returns, on every path (an exception included): no
  reservation or read mark outlives its group, and eviction spares a file only
  while a read of it is in flight.
* Capacity: a block is written only once the index reserved its bytes; a block
  that does not fit while earlier blocks of the group wait to be written is
  tried again once they are written (so they can be evicted for it), as if the
  group were written block by block.
* A request that failed as a whole (a worker died or timed out) is a transient
  failure (:mod:`kvtierd.tiers.failures`): it never removes a block file. A
  write's temp file is removed; a whole block file the worker renamed into place
  before it died is kept and indexed as written (a file is renamed only once
  complete, and every read verifies it); any other block fails. A read request
  fails each of its blocks and keeps their files. Only the thread holding a
  key's write reservation writes that key's paths.
* What a failed read means for its file is :func:`kvtierd.tiers.failures.classify`'s:
  a file that failed verification (corrupt) is dropped from the index and
  removed only if its path still names the inode that failed; a vanished file
  (missing) is dropped from the index; any other error (transient, a fault)
  keeps the file and its index entry.
* Runs on I/O threads only: touches the index (under its own lock), the pool's
  files and, through the block I/O, the rows of its job; nothing of the loop.
"""

from __future__ import annotations

from kvtierd.contract import BlockKey
from kvtierd.tiers.blockformat import HEADER_SIZE, check_key
from kvtierd.tiers.failures import LoadFailure, classify
from kvtierd.tiers.fs import fsformat, iowire
from kvtierd.tiers.fs.blockfile import CorruptFile
from kvtierd.tiers.fs.blockio import BlockIo
from kvtierd.tiers.fs.corruptlog import CorruptFileLog
from kvtierd.tiers.fs.files import PoolFiles, beside, name_of
from kvtierd.tiers.fs.fsformat import TEMP_SUFFIX
from kvtierd.tiers.fs.index import BlockIndex, TierFull
from kvtierd.tiers.fs.iowire import RegionRef
from kvtierd.tiers.iopool import Outcome, Pairs


class BlockGroups:
    """Runs one pool's groups of block writes and reads (any I/O thread).

    ``o_direct`` is what the tier's start-up probe decided; it is set before
    the first group runs (the tier's ``prepare``) and read-only after.
    """

    def __init__(
        self,
        name: str,
        index: BlockIndex,
        files: PoolFiles,
        block_io: BlockIo,
        region_ref: RegionRef,
        *,
        fingerprint: bytes,
        num_rows: int,
        fsync: bool,
        keys: tuple[bytes, tuple[bytes, ...]] | None,
        corrupt_log: CorruptFileLog | None = None,
    ) -> None:
        """``keys``: the integrity keys as sent to the block I/O
        (:meth:`~kvtierd.tiers.integrity.KeyRing.wire`; None: unkeyed files).
        ``corrupt_log``: where files that failed verification are logged
        (rate-limited; one of its own when not given)."""
        self.name = name
        self._corrupt_log = corrupt_log or CorruptFileLog(name)
        self.o_direct = False
        self._index = index
        self._files = files
        self._block_io = block_io
        self._region_ref = region_ref
        self._fingerprint = fingerprint
        self._num_rows = num_rows
        self._fsync = fsync
        self._keys = keys
        self._pool_dir = files.pool_dir
        self._file_bytes = HEADER_SIZE + region_ref[3]  # a whole block file

    def store(self, pairs: Pairs) -> list[Outcome]:
        """Writes a group's block files; one Outcome per block, in order: True
        (written), False (present already, not rewritten) or the error (TierFull
        when no room can be made, OSError/ValueError otherwise).

        Blocks are reserved one by one and written together (one request to the
        block I/O per group). A block that does not fit while earlier blocks of
        the group wait to be written is tried again once they are written, so
        they can be evicted for it, as if the group were written block by block.
        """
        outcomes: list[Outcome | None] = [None] * len(pairs)
        reserved: list[tuple[int, BlockKey, int]] = []
        try:
            for i, (key, block_id) in enumerate(pairs):
                try:
                    check_key(key)
                    self._check_row(block_id)
                    try:
                        fresh = self._index.reserve_write(key)
                    except TierFull:
                        if not reserved:
                            raise
                        batch, reserved = reserved, []
                        self._write_reserved(batch, outcomes)
                        fresh = self._index.reserve_write(key)
                except Exception as exc:  # one block's failure is that block's outcome
                    outcomes[i] = Outcome(error=exc)
                    continue
                if fresh:
                    reserved.append((i, key, block_id))
                else:
                    outcomes[i] = Outcome(value=False)
            batch, reserved = reserved, []
            self._write_reserved(batch, outcomes)
        except BaseException:
            self._index.end_writes([key for _, key, _ in reserved], [False] * len(reserved))
            raise
        return [o if o is not None else Outcome(error=RuntimeError("not run")) for o in outcomes]

    def _write_reserved(
        self, reserved: list[tuple[int, BlockKey, int]], outcomes: list[Outcome | None]
    ) -> None:
        """Writes blocks whose keys this thread reserved; ends every reservation."""
        if not reserved:
            return
        keys = [key for _, key, _ in reserved]
        try:
            errors = self._write_files([(key, block_id) for _, key, block_id in reserved])
        except BaseException:
            self._index.end_writes(keys, [False] * len(keys))
            raise
        self._index.end_writes(keys, [error is None for error in errors])
        for (i, _, _), error in zip(reserved, errors, strict=True):
            outcomes[i] = Outcome(value=True) if error is None else Outcome(error=error)

    def _write_files(self, items: Pairs) -> list[BaseException | None]:
        """Writes row ``block_id`` as ``key``'s file for each ``(key, block_id)``, in one
        block I/O request; per item None (written) or the error. The caller holds
        the keys' write reservations, so no one else reads or writes these paths."""
        todo = []
        for key, block_id in items:
            rel = fsformat.block_rel_path(key)
            temp_name = f"{name_of(rel)}.{self._files.temp_name()}{TEMP_SUFFIX}"
            todo.append((block_id, rel, temp_name, key))
        params = (self._fingerprint, self.o_direct, self._fsync, self._keys, self._pool_dir)
        try:
            replies = self._block_io.call((iowire.WRITE, self._region_ref, params, todo))
        except OSError as exc:  # the worker died: which files it renamed is unknown
            return [self._after_lost_write(rel, temp_name, exc) for _, rel, temp_name, _ in todo]
        return [iowire.error_of(reply) for reply in replies]

    def _after_lost_write(self, rel: str, temp_name: str, error: OSError) -> OSError | None:
        """One block of a write request that failed as a whole (its worker died or was
        killed, after it exited): its temp file is removed; a whole block file at
        ``rel`` is what the worker renamed into place before it died (renamed only
        once complete; verified at every read): kept and reported written (None).
        Otherwise ``error``; a file at ``rel`` is never removed for it."""
        self._files.unlink_quietly(beside(rel, temp_name))
        if self._files.holds_whole(rel, self._file_bytes):
            return None
        return error

    def load(self, pairs: Pairs) -> list[Outcome]:
        """Reads and verifies a group's blocks into their rows (one block I/O
        request); one Outcome per block, None or the error.

        The keys count as being read (so eviction spares their files) until
        every block of the group is done. Corrupt files are removed (and
        counted); transient errors keep the file; a vanished file (ENOENT) is
        dropped from the index.
        """
        outcomes: list[Outcome] = [Outcome()] * len(pairs)
        todo: list[tuple[int, BlockKey, int]] = []
        for i, (key, block_id) in enumerate(pairs):
            try:
                self._check_row(block_id)
            except ValueError as exc:
                outcomes[i] = Outcome(error=exc)
                continue
            todo.append((i, key, block_id))
        keys = [key for _, key, _ in todo]
        self._index.begin_reads(keys)
        try:
            errors = self._read_files([(key, block_id) for _, key, block_id in todo])
            for (i, key, _), error in zip(todo, errors, strict=True):
                if error is not None:
                    self._read_failed(key, error)
                    outcomes[i] = Outcome(error=error)
        finally:
            self._index.end_reads(keys)
        self._index.loaded([key for (i, key, _) in todo if outcomes[i].ok])
        return outcomes

    def _read_files(self, items: Pairs) -> list[BaseException | None]:
        """Reads ``key``'s file into row ``block_id`` for each ``(key, block_id)``, in one
        block I/O request; per item None (read and verified) or the error."""
        params = (self._fingerprint, self.o_direct, self._keys, self._pool_dir)
        request = [(block_id, fsformat.block_rel_path(key), key) for key, block_id in items]
        try:
            replies = self._block_io.call((iowire.READ, self._region_ref, params, request))
        except OSError as exc:  # the worker died
            return [exc] * len(items)
        return [iowire.error_of(reply) for reply in replies]

    def _read_failed(self, key: BlockKey, error: BaseException) -> None:
        """Settles a key whose read failed, as its failure's kind says (a transient
        failure or a fault keeps the file and the index entry)."""
        kind = classify(error)
        if kind is LoadFailure.MISSING:
            self._index.drop_vanished(key)
        elif kind is LoadFailure.CORRUPT and isinstance(error, CorruptFile):
            self._discard_corrupt(key, error)

    def _discard_corrupt(self, key: BlockKey, error: CorruptFile) -> None:
        """Drops a key whose file failed verification from the index and removes the
        file if the path still names the inode that failed (never a directory, never
        through a symlink; something else at the path is left there)."""
        path, rel = self._files.path(key), fsformat.block_rel_path(key)
        self._corrupt_log.dropped(path, error)
        identity = error.identity

        def replaced() -> bool:
            return identity is not None and self._files.remove_bad(rel, identity)

        self._index.drop_corrupt(key, error.reason, replaced, error.integrity)

    def _check_row(self, block_id: int) -> None:
        if not 0 <= block_id < self._num_rows:
            raise ValueError(f"block id {block_id} outside the region (0..{self._num_rows - 1})")
