"""Attach to a pool's shared-memory region (the worker side).

Ownership: the daemon creates the region file, sizes it, allocates it and is
the only process that unlinks it (``kvtierd.primary.region``). A worker learns the path,
geometry and identity (``st_dev``, ``st_ino``) from OpenSession's ``region`` and
*attaches* (:func:`attach_announced`): it maps the existing file read/write only
if the file it opened is the one the daemon created (the daemon keeps that file
open for the region's life, so no other file can share its identity), and never
creates, resizes or unlinks it. Closing an
:class:`AttachedRegion` unmaps it; the file stays for the daemon and the other
workers.

Row layout: row ``b`` is bytes ``[b * block_bytes, (b + 1) * block_bytes)``.
Inside a row, rank ``r``'s page is bytes ``[r * page_bytes, (r + 1) * page_bytes)``
(:meth:`AttachedRegion.rank_view`); ranks never share bytes.

Importing this module does not import torch or numpy (the scheduler side
imports the client package too); the methods that return tensors or arrays
import them when called.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from typing import TYPE_CHECKING, Any

from kvtierd_client._shm.cuda_runtime import clear_last_error, error_text
from kvtierd_client.wire import trust

if TYPE_CHECKING:
    import numpy as np
    import torch

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14


class AttachedRegion:
    """A worker's read/write mapping of a region file the daemon created.

    Views (:attr:`tensor`, :meth:`numpy`, :meth:`rank_view`) are zero-copy and
    valid until :meth:`close`. Close every copy engine using the region first: a
    CUDA copy still in flight must not outlive the registration or the mapping.
    Not thread-safe for attach/close; the views may be used from any thread.
    """

    def __init__(self, path: str, mapping: mmap.mmap, num_blocks: int, block_bytes: int) -> None:
        """Internal: use :meth:`attach`. Takes ownership of ``mapping``."""
        self.path = path
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        # Invariant: size == num_blocks * block_bytes == len(self._mmap) while open
        self.size = num_blocks * block_bytes
        self._mmap: mmap.mmap | None = mapping  # None once closed
        self._tensor: torch.Tensor | None = None
        self._array: np.ndarray | None = None
        self._cuda_registered_ptr: int | None = None  # set while cudaHostRegister'ed

    @classmethod
    def attach(
        cls,
        path: str | os.PathLike[str],
        num_blocks: int,
        block_bytes: int,
        *,
        populate: bool = True,
        identity: tuple[int, int] | None = None,
    ) -> AttachedRegion:
        """Maps ``num_blocks * block_bytes`` bytes of the existing region file ``path``.

        ``populate`` maps every page up front (MADV_POPULATE_WRITE, or reading one
        byte per page on kernels without it) so that copies do not page-fault.
        ``identity`` (``(st_dev, st_ino)`` the daemon announced, see
        :func:`attach_announced`): the file opened must be that very file.

        Raises:
            RegionIdentityError: the file at ``path`` is not ``identity`` (replaced).
            ValueError: bad geometry, or the file is smaller than the geometry
                (the daemon creates and sizes region files; this is not one of
                them, or not this pool's).
            FileNotFoundError, PermissionError: from opening ``path``.
        """
        path = os.fspath(path)
        if num_blocks < 1 or block_bytes < 1:
            raise ValueError(
                f"region {path}: num_blocks and block_bytes must be >= 1, "
                f"got {num_blocks} and {block_bytes}"
            )
        return cls.attach_fd(
            os.open(path, os.O_RDWR | os.O_CLOEXEC),
            path,
            num_blocks,
            block_bytes,
            populate=populate,
            identity=identity,
        )

    @classmethod
    def attach_fd(
        cls,
        fd: int,
        path: str,
        num_blocks: int,
        block_bytes: int,
        *,
        populate: bool = True,
        identity: tuple[int, int] | None = None,
    ) -> AttachedRegion:
        """:meth:`attach` of the open region descriptor ``fd`` (read/write; from the
        daemon over SCM_RIGHTS, or opened by path), which this call closes;
        ``path`` names it in messages. Raises as :meth:`attach` does."""
        if num_blocks < 1 or block_bytes < 1:
            os.close(fd)
            raise ValueError(
                f"region {path}: num_blocks and block_bytes must be >= 1, "
                f"got {num_blocks} and {block_bytes}"
            )
        size = num_blocks * block_bytes
        try:
            st = os.fstat(fd)
            if identity is not None:
                check_identity(path, st, identity)  # checked on the fd that gets mapped
            file_size = st.st_size
            if file_size < size:
                raise ValueError(
                    f"region file {path} has {file_size} bytes but {num_blocks} blocks x "
                    f"{block_bytes} bytes need {size}; region files are created and sized "
                    "by the kvtierd daemon (use the path and geometry OpenSession returned)"
                )
            mapping = mmap.mmap(
                fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        finally:
            os.close(fd)  # the mapping keeps its own reference to the file
        try:
            if populate:
                _populate(mapping)
        except BaseException:
            mapping.close()
            raise
        return cls(path, mapping, num_blocks, block_bytes)

    @property
    def closed(self) -> bool:
        return self._mmap is None

    @property
    def tensor(self) -> torch.Tensor:
        """The region as a zero-copy uint8 tensor of shape (num_blocks, block_bytes)."""
        if self._tensor is None:
            import torch

            # frombuffer keeps a reference to the object it is given but not a
            # buffer export: over the bare mmap, mmap.close() would unmap under a
            # live tensor. A memoryview holds the export, so close() refuses
            # (BufferError) while any tensor view is alive.
            base = torch.frombuffer(memoryview(self._mapping()), dtype=torch.uint8)
            self._tensor = base.view(self.num_blocks, self.block_bytes)
        return self._tensor

    def numpy(self) -> np.ndarray:
        """The region as a zero-copy numpy uint8 array of shape (num_blocks, block_bytes)."""
        if self._array is None:
            import numpy as np

            flat = np.frombuffer(self._mapping(), dtype=np.uint8)
            self._array = flat.reshape(self.num_blocks, self.block_bytes)
        return self._array

    def rank_view(self, rank: int, page_bytes: int) -> torch.Tensor:
        """Rank ``rank``'s page of every row: a strided (num_blocks, page_bytes) uint8 view.

        Bytes ``[rank * page_bytes, (rank + 1) * page_bytes)`` of each row.
        Raises ValueError if that range does not fit in ``block_bytes``.
        """
        if rank < 0 or page_bytes < 1 or (rank + 1) * page_bytes > self.block_bytes:
            raise ValueError(
                f"rank {rank} with pages of {page_bytes} bytes needs bytes "
                f"[{rank * page_bytes}, {(rank + 1) * page_bytes}) of each row, but rows of "
                f"region {self.path} have {self.block_bytes} bytes"
            )
        start = rank * page_bytes
        return self.tensor[:, start : start + page_bytes]

    def register_cuda(self) -> None:
        """Page-locks the whole mapping for CUDA DMA (``cudaHostRegister``), once.

        Call it with the worker's device current. A no-op without CUDA, or if
        already registered. Raises RuntimeError with the CUDA error code on failure.
        """
        import torch

        if self._cuda_registered_ptr is not None or not torch.cuda.is_available():
            return
        ptr = self.tensor.data_ptr()
        code = int(torch.cuda.cudart().cudaHostRegister(ptr, self.size, 0))
        if code != 0:
            clear_last_error()  # else torch's next launch check reports it as its own
            raise RuntimeError(
                f"cudaHostRegister of region {self.path} ({self.size} bytes at {ptr:#x}) "
                f"failed with cudaError {code} ({error_text(code)})"
            )
        self._cuda_registered_ptr = ptr

    def unregister_cuda(self) -> None:
        """Undoes :meth:`register_cuda`; a no-op if not registered.

        Raises RuntimeError with the CUDA error code on failure (the region is
        then considered unregistered: retrying cannot help).
        """
        ptr, self._cuda_registered_ptr = self._cuda_registered_ptr, None
        if ptr is None:
            return
        import torch

        code = int(torch.cuda.cudart().cudaHostUnregister(ptr))
        if code != 0:
            clear_last_error()
            raise RuntimeError(
                f"cudaHostUnregister of region {self.path} at {ptr:#x} failed with cudaError "
                f"{code} ({error_text(code)})"
            )

    def close(self) -> None:
        """Unregisters from CUDA, drops the views and unmaps. Never unlinks. Idempotent.

        If the caller still holds a view (a tensor or array from this region),
        the mapping cannot be closed now: that is logged and the mapping is left
        to the garbage collector, which unmaps it when the last view dies.
        """
        if self._mmap is None:
            return
        try:
            self.unregister_cuda()
        finally:
            mapping, self._mmap = self._mmap, None
            self._tensor = None
            self._array = None
            try:
                mapping.close()
            except BufferError:
                log.warning(
                    "region %s: views of it are still alive; the mapping is left to the "
                    "garbage collector",
                    self.path,
                )

    def __enter__(self) -> AttachedRegion:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<AttachedRegion {self.path} {self.num_blocks} x {self.block_bytes} bytes {state}>"

    def _mapping(self) -> mmap.mmap:
        if self._mmap is None:
            raise ValueError(f"region {self.path} is closed")
        return self._mmap


class RegionIdentityError(ValueError):
    """The file at a region's path is not the file the daemon created (its device
    and inode differ from those OpenSession announced): someone replaced it."""


def check_identity(path: str, st: os.stat_result, identity: tuple[int, int]) -> None:
    """Raises RegionIdentityError unless ``st`` (an fstat of the file opened at
    ``path``) has the ``(st_dev, st_ino)`` the daemon announced."""
    found = (st.st_dev, st.st_ino)
    if found != tuple(identity):
        raise RegionIdentityError(
            f"region file {path} is not the region the daemon created: it is device "
            f"{found[0]} inode {found[1]}, the daemon announced device {identity[0]} inode "
            f"{identity[1]}; another process replaced it (check who may write "
            "memory.shm_dir). Refusing to map it"
        )


def announced_identity(region: Any) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of a ``pb2.Region`` from OpenSession; None when the
    daemon predates region identities (both 0)."""
    if not region.st_dev and not region.st_ino:
        return None
    return int(region.st_dev), int(region.st_ino)


def attach_announced(
    region: Any,
    *,
    populate: bool = True,
    session_id: str | None = None,
    daemon_uid: int | None = None,
) -> AttachedRegion:
    """:meth:`AttachedRegion.attach` of the ``pb2.Region`` OpenSession returned
    (``session.region``): its path and geometry, and the file must be the one the
    daemon created (RegionIdentityError otherwise).

    With ``session_id`` and a daemon that offers region descriptors
    (``region.fd_socket``), the descriptor comes from the daemon over the Unix
    socket (:mod:`kvtierd_client._shm.region_fd`; RegionAccessDenied when this
    process may not map the pool), not from the path.

    ``daemon_uid`` (``session.daemon_uid``): the uid of the daemon that announced the
    region; the file mapped must be that uid's. Without it, the owner of the
    descriptor socket (or of the region file) once its path is shown to be placed
    by a trusted user (:mod:`kvtierd_client.wire.trust`).
    """
    return attach_region(
        region.path,
        int(region.num_blocks),
        int(region.block_bytes),
        identity=announced_identity(region),
        fd_socket=getattr(region, "fd_socket", ""),
        session_id=session_id,
        populate=populate,
        daemon_uid=daemon_uid,
    )


def attach_region(
    path: str,
    num_blocks: int,
    block_bytes: int,
    *,
    identity: tuple[int, int] | None,
    fd_socket: str = "",
    session_id: str | None = None,
    populate: bool = True,
    daemon_uid: int | None = None,
) -> AttachedRegion:
    """Maps a region the daemon announced (``path``, geometry, ``identity``), the
    way the daemon offers: by descriptor when it serves them (``fd_socket``, the
    announced ``Region.fd_socket``) and ``session_id`` names a session of the
    region's pool, the path then playing no part; by ``path`` otherwise (an older
    daemon: ``fd_socket`` empty). ``identity`` is checked on the descriptor that
    gets mapped either way, and so is its owner: ``daemon_uid``, else the placed
    owner of the socket or file (:func:`daemon_uid_of`). The descriptor socket must be
    served by that uid (``SO_PEERCRED``) before it learns the session id.

    Raises as :meth:`AttachedRegion.attach` does, RegionAccessDenied when the
    daemon refuses this process the pool's region (never retried by path), and
    ``kvtierd_client.wire.trust.UntrustedDaemon`` when the socket or the file is
    another user's (nothing is mapped).
    """
    by_descriptor = bool(fd_socket and session_id)
    uid = daemon_uid if daemon_uid is not None else daemon_uid_of(fd_socket or path)
    if by_descriptor:
        from kvtierd_client._shm.region_fd import request_region_fd

        fd = request_region_fd(fd_socket, session_id or "", server_uid=uid)
    else:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        require_file_owner(fd, path, uid)
    except BaseException:
        os.close(fd)
        raise
    return AttachedRegion.attach_fd(
        fd, path, num_blocks, block_bytes, populate=populate, identity=identity
    )


def daemon_uid_of(path: str) -> int:
    """The owner of ``path`` (a region file or its descriptor socket), once its path
    is shown to be placed by a user this process trusts (``wire.trust``). Raises
    ``UntrustedDaemon``, and OSError when it cannot be looked at."""
    return trust.placed_entry(path, trust.trusted_uids(), "the region").st_uid


def require_file_owner(fd: int, path: str, uid: int) -> None:
    """Raises ``UntrustedDaemon`` unless the open file ``fd`` (the region ``path``)
    belongs to the daemon's ``uid``: a file of another user is never mapped."""
    owner = os.fstat(fd).st_uid
    if owner != uid:
        raise trust.UntrustedDaemon(
            f"region file {path} is owned by {trust.user_name(owner)}, not by the daemon's "
            f"user {trust.user_name(uid)}: refusing to map it"
        )


def _populate(mapping: mmap.mmap) -> None:
    """Maps every page of ``mapping``; EINVAL (kernel < 5.14) -> read one byte per page.

    The fallback only *reads*: other workers may be writing the region right now,
    and a read-modify-write could undo their byte. On a shared tmpfs mapping a read
    fault installs a writable page-table entry, so later writes do not fault.
    """
    try:
        _madvise_populate_write(mapping)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        _read_pages(mapping)


def _madvise_populate_write(mapping: mmap.mmap) -> None:
    mapping.madvise(MADV_POPULATE_WRITE)


def _read_pages(mapping: Any) -> None:
    view = memoryview(mapping)
    try:
        sum(view[:: mmap.PAGESIZE])  # reads one byte per page
    finally:
        view.release()
