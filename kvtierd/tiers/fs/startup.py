"""The start-up probes of one pool's fs tier: root, pool directory, ``pool.json``
and the O_DIRECT decision.

Blocking file I/O (up to two 16 MiB probe files): the daemon runs these off
the event loop, before the tier launches. Each failure raises
:class:`FsTierError` naming the path, or :class:`PoolMismatchError` when the
pool directory belongs to another pool; nothing below the pool directory is
followed through a symlink or opened in a way that can block.
"""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import secrets
import time

from kvtierd.security.trusted_dirs import UntrustedPath
from kvtierd.tiers.blockformat import PoolIdentity
from kvtierd.tiers.configured import TierStartError
from kvtierd.tiers.fs import blockfile, permissions
from kvtierd.tiers.fs.fsformat import POOL_FILE, POOL_FILE_MAX_BYTES, TEMP_SUFFIX, pool_file
from kvtierd.tiers.fs.safefs import PoolDir, UnexpectedEntry

log = logging.getLogger(__name__)

SPEED_PROBE_BYTES = 16 << 20  # at most this much written twice by the o_direct=auto probe
DIRECT_SPEEDUP = 0.8  # O_DIRECT is chosen by "auto" when it takes < 80 % of the time


class FsTierError(TierStartError):
    """The FS tier cannot start (root missing, not writable, pool mismatch...)."""


class PoolMismatchError(FsTierError):
    """The pool directory's ``pool.json`` describes another pool."""


def prepare_root(tier_name: str, root: str, pool_dir: str) -> None:
    """Creates the root (if missing) and the pool directory below it (never
    through a symlink, mode 0750, ours: ``permissions``); FsTierError naming the
    path when either is unusable."""
    try:
        os.makedirs(root, mode=permissions.DIR_MODE, exist_ok=True)
    except OSError as exc:
        raise FsTierError(
            f"FS tier {tier_name}: root directory {root} does not exist and cannot be "
            f"created: {exc.strerror or exc}"
        ) from exc
    if not os.access(root, os.W_OK | os.X_OK):
        raise FsTierError(f"FS tier {tier_name}: root directory {root} is not writable")
    try:
        with PoolDir(pool_dir, create=True) as pool:
            permissions.claim_pool_dir(pool.fd, pool_dir)
    except UntrustedPath as exc:  # another user created it first (a sticky root)
        raise FsTierError(f"FS tier {tier_name}: {exc}") from None
    except UnexpectedEntry as exc:  # planted: a symlink would lead out of the root
        log.warning("FS tier %s: %s: not followed; refusing the pool", tier_name, exc)
        raise FsTierError(
            f"FS tier {tier_name}: {exc}: not followed; remove it (the daemon creates "
            "the pool directory)"
        ) from None
    except OSError as exc:
        raise FsTierError(
            f"FS tier {tier_name}: cannot create pool directory {pool_dir} under root "
            f"{root}: {exc.strerror or exc}"
        ) from exc


def write_pool_file(tier_name: str, pool_dir: str, identity: PoolIdentity) -> None:
    """Checks ``pool.json`` against ``identity``, or writes it when missing. The file
    is opened without blocking or following a symlink and read only if small."""
    path = os.path.join(pool_dir, POOL_FILE)
    ours = pool_file(identity)
    try:
        with PoolDir(pool_dir) as pool:
            raw = pool.read_small(POOL_FILE, POOL_FILE_MAX_BYTES)
            if raw is None:
                text = json.dumps(ours, indent=2, sort_keys=True) + "\n"
                temp = f"{POOL_FILE}.{secrets.token_hex(8)}{TEMP_SUFFIX}"
                pool.write_new(POOL_FILE, text.encode(), temp)
                return
    except UnexpectedEntry as exc:
        log.warning("FS tier %s: %s; refusing the pool", tier_name, exc)
        raise FsTierError(f"FS tier {tier_name}: {exc}; remove it") from None
    except ValueError as exc:
        raise PoolMismatchError(
            f"FS tier {tier_name}: {exc}; remove the directory {pool_dir} or use another root"
        ) from None
    except OSError as exc:
        raise FsTierError(
            f"FS tier {tier_name}: cannot read or write {path}: {exc.strerror or exc}"
        ) from exc
    try:
        theirs = json.loads(raw)
    except ValueError:
        theirs = raw.decode(errors="replace")
    if theirs != ours:
        raise PoolMismatchError(
            f"FS tier {tier_name}: {path} describes {theirs!r}, but this pool is "
            f"{ours!r}; remove the directory {pool_dir} or use another root"
        )


def probe_o_direct(tier_name: str, pool_dir: str, mode: str, block_bytes: int) -> bool:
    """Whether block files are written and read with O_DIRECT.

    "on": if the filesystem supports it (FsTierError otherwise); "auto": if it
    supports it *and* a timed write + read-back of a few blocks is at least 20 %
    faster with it than through the page cache; "off": never. Also proves the
    directory writable (FsTierError naming it otherwise).
    """
    wanted = mode != "off" and blockfile.O_DIRECT != 0
    if wanted:
        try:
            _probe_file(pool_dir, blockfile.O_DIRECT)
            return mode == "on" or _direct_is_faster(tier_name, pool_dir, block_bytes)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise FsTierError(
                    f"FS tier {tier_name}: cannot write in {pool_dir}: {exc}"
                ) from exc
            if mode == "on":
                raise FsTierError(
                    f"FS tier {tier_name}: o_direct=on but {pool_dir} does not support "
                    "O_DIRECT (EINVAL); use o_direct=auto or off"
                ) from exc
    try:
        _probe_file(pool_dir, 0)
    except OSError as exc:
        raise FsTierError(f"FS tier {tier_name}: cannot write in {pool_dir}: {exc}") from exc
    return False


def _direct_is_faster(tier_name: str, pool_dir: str, block_bytes: int) -> bool:
    """Times writing then reading back the same bytes buffered and with O_DIRECT.

    The buffered read-back usually comes from the page cache, as buffered
    promotions of recently cascaded blocks do; O_DIRECT has to beat that.
    """
    nbytes = min(SPEED_PROBE_BYTES, 4 * block_bytes)
    buffer = mmap.mmap(-1, nbytes)  # page-aligned, as O_DIRECT needs
    try:
        buffer.write(os.urandom(4096) * (nbytes // 4096))
        buffered = _time_write_read(pool_dir, buffer, 0)
        direct = _time_write_read(pool_dir, buffer, blockfile.O_DIRECT)
    except OSError as exc:
        log.info("FS tier %s: O_DIRECT speed probe failed (%s); using the page cache",
                 tier_name, exc)  # fmt: skip
        return False
    finally:
        buffer.close()
    faster = direct < DIRECT_SPEEDUP * buffered
    log.info(
        "FS tier %s: write+read of %d bytes: %.1f ms buffered, %.1f ms O_DIRECT -> %s",
        tier_name, nbytes, buffered * 1e3, direct * 1e3, "O_DIRECT" if faster else "page cache",
    )  # fmt: skip
    return faster


def _time_write_read(directory: str, buffer: mmap.mmap, extra_flags: int) -> float:
    """Seconds to write ``buffer`` to a new file in ``directory`` and read it back."""
    path = os.path.join(directory, f".speed-{secrets.token_hex(8)}{TEMP_SUFFIX}")
    view = memoryview(buffer)
    start = time.perf_counter()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | extra_flags, 0o600)
    try:
        blockfile.write_all(fd, [view])
        if blockfile.read_all(fd, [view]) != len(view):
            raise OSError(errno.EIO, f"speed probe {path} read back short")
        return time.perf_counter() - start
    finally:
        view.release()
        os.close(fd)
        blockfile.unlink_quietly(path)


def _probe_file(directory: str, extra_flags: int) -> None:
    path = os.path.join(directory, f".probe-{secrets.token_hex(8)}{TEMP_SUFFIX}")
    page = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        page[:8] = b"kvtierd!"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | extra_flags, 0o600)
        try:
            blockfile.write_all(fd, [memoryview(page)])
            back = mmap.mmap(-1, mmap.PAGESIZE)
            try:
                got = blockfile.read_all(fd, [memoryview(back)])
                if got != mmap.PAGESIZE or back[:8] != b"kvtierd!":
                    raise OSError(errno.EIO, f"probe file {path} read back wrong bytes")
            finally:
                back.close()
        finally:
            os.close(fd)
    finally:
        page.close()
        blockfile.unlink_quietly(path)
