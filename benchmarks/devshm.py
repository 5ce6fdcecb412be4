"""What a run leaves in ``/dev/shm``, and which of it no process holds any more.

Python's multiprocessing names its shared memory ``psm_*`` and its semaphores
``mp-*`` (glibc keeps a named semaphore as ``/dev/shm/sem.<name>``). Its resource
tracker, a helper process, unlinks those a process leaked once every process
using it has exited, unless it is killed with them: a process group's SIGKILL (a
vLLM OpenAI server's API server, engine core, worker and tracker) leaves them
behind, hundreds of MB each, held by no process.

Used by ``benchmarks/vllm_http.py`` (after stopping a server's group) and by the
test suites' check at the end of a session (``tests/shm_leftovers.py``).
Linux only: ``/proc`` says who holds what.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

SHM = "/dev/shm"
MULTIPROCESSING_PREFIXES = ("psm_", "sem.mp-")  # SharedMemory, SemLock (Lock, Event, ...)


def entries(directory: str = SHM) -> frozenset[str]:
    """The names in ``directory`` now (empty when it does not exist)."""
    try:
        return frozenset(os.listdir(directory))
    except FileNotFoundError:
        return frozenset()


def held(paths: Iterable[str]) -> set[str]:
    """Those of ``paths`` that a live process maps, has open, or (a directory)
    holds something under or works in. Processes this one may not inspect (another
    user's, when not root) count as holding nothing; a process that exits while it
    is looked at is skipped."""
    wanted = {os.path.normpath(path) for path in paths}
    if not wanted:
        return set()
    found: set[str] = set()
    for pid in _pids():
        for used in _paths_of(pid):
            used = used.removesuffix(" (deleted)")
            found.update(path for path in wanted if used == path or used.startswith(path + "/"))
        if found == wanted:
            break
    return found


def remove_unheld_multiprocessing(before: frozenset[str], directory: str = SHM) -> list[str]:
    """Unlinks the multiprocessing segments and semaphores of this user that appeared
    in ``directory`` since ``before`` (its :func:`entries` then) and that no process
    holds: what a killed resource tracker could not. Returns their names."""
    fresh = [
        name
        for name in sorted(entries(directory) - before)
        if name.startswith(MULTIPROCESSING_PREFIXES) and _own(os.path.join(directory, name))
    ]
    paths = [os.path.join(directory, name) for name in fresh]
    holding = held(paths)
    removed = []
    for path in paths:
        if path not in holding:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(os.path.basename(path))
    return removed


def _own(path: str) -> bool:
    try:
        return os.lstat(path).st_uid == os.geteuid()
    except FileNotFoundError:
        return False


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _paths_of(pid: int) -> list[str]:
    """The files process ``pid`` maps, has open, and works in (its cwd)."""
    paths: list[str] = []
    try:
        with open(f"/proc/{pid}/maps") as maps:  # address perms offset dev inode [path]
            fields = (line.split(maxsplit=5) for line in maps)
            paths += [parts[5].strip() for parts in fields if len(parts) == 6]
        fd_dir = f"/proc/{pid}/fd"
        for fd in os.listdir(fd_dir):
            with contextlib.suppress(OSError):
                paths.append(os.readlink(f"{fd_dir}/{fd}"))
        paths.append(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:  # gone, or not ours to read
        pass
    return paths
