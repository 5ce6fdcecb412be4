"""A daemon that replaces the one serving its sockets without a refused connection
(``server.takeover``, ``kvtierd --takeover``; docs/operations/upgrades.md).

gRPC's Python server can only bind an address itself: it cannot serve a listening
socket it is handed (no ``fd:`` address, and grpcio's wheels are built without
gRPC core's systemd socket activation), so the sockets cannot pass from one
process to the next. What can be made atomic is the *name*: the new daemon binds
every Unix socket (gRPC, fast lane, region descriptors, tickets) at a temporary
name and serves it, then renames it over the path (``kvtierd.util.sockets``). A
``connect()`` to the path reaches the old daemon until that instant and the new
one after it.

Sequence: :func:`find_running_daemon` before anything is bound;
:meth:`Takeover.publish` once this daemon serves its temporary sockets (rename
them over the paths, then SIGTERM the old daemon); :meth:`Takeover.wait_gone`
(its graceful stop keeps its regions and journals, which this daemon adopts; its
connections get UNAVAILABLE and GOAWAY and their clients reconnect, to this
daemon). Until the old daemon has exited the new one creates no pool (the old one
still holds the regions): ``OpenSession`` waits at most ``OPEN_WAIT`` seconds,
then answers UNAVAILABLE saying why; other calls are answered. If it has not
stopped within ``stop_timeout`` it gets SIGKILL (the next adoption is then a
crash's: still never wrong); if even that does not end it, pools stay held and
the error is logged until it has. TCP listeners and the metrics endpoint cannot
be shared (no ``SO_REUSEPORT``): they start once the old daemon has exited.

Who is signalled (never a process of another uid, never one found through a
planted link): the path must be a socket file (``lstat``, no link followed)
owned by this daemon's uid; the pid is the kernel's answer (``SO_PEERCRED`` of a
connection to it) and must run as this uid; a pidfd is taken while that
connection is open, so the signal reaches that process and never one that
reused its pid; the path must still be the same file after the probe.

All or nothing: every socket name is checked and linked before the first rename
(``SocketPlacement.publish``); a refusal there, or a rename that fails half-way
(the replaced sockets are put back), leaves the old daemon serving every path,
unsignalled, and this one exits with code 2 and one line naming the path.

A chain is refused: a daemon that still waits for the one *it* replaced (it
holds a pidfd of that live process: the kernel's ``/proc/PID/fdinfo`` says which)
is not taken over. Replacing it would leave its predecessor holding the pools'
regions with nobody waiting for it (every ``OpenSession`` refused while it
lives); the start stops with code 2 naming both pids, and succeeds once the
predecessor has exited.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtierd.errors import StartupError
from kvtierd.util.sockets import PublishError, SocketPlacement

log = logging.getLogger(__name__)

_UCRED = struct.Struct("iII")  # pid_t pid; uid_t uid; gid_t gid
PROBE_TIMEOUT = 1.0  # seconds a connect to the running daemon's socket may take
KILL_WAIT = 5.0  # seconds between SIGKILL and each "still alive" error
OPEN_WAIT = 10.0  # seconds an OpenSession waits for the old daemon's exit
KEY = "server.takeover"


@dataclass(frozen=True, slots=True)
class RunningDaemon:
    """The process serving the listen path: its pid and a pidfd that names it
    (signals through the pidfd never reach a process that reused the pid)."""

    pid: int
    pidfd: int


def find_running_daemon(path: str) -> RunningDaemon | None:
    """The daemon serving the Unix socket ``path``; None when there is none to
    replace (no file, or a stale socket file nobody listens on). Raises
    StartupError, signalling nothing, when the path is not a socket file of this
    uid, the process serving it runs as another uid, or it still waits for the
    daemon it took over (module docstring: a chain)."""
    before = _own_socket_file(path)
    if before is None:
        return None
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.settimeout(PROBE_TIMEOUT)
    try:
        try:
            probe.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            return None
        except OSError as exc:
            raise StartupError(KEY, f"cannot reach the daemon serving {path}: {exc}") from None
        pid, uid, _ = _UCRED.unpack(
            probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        )
        _check_uid(path, pid, uid)
        pidfd = _pidfd(path, pid)  # while connected: the listener's process is alive
    finally:
        probe.close()
    try:
        _check_uid(path, pid, _process_uid(pid))  # its uid now, not at listen()
        if _own_socket_file(path) != before:
            raise StartupError(KEY, f"{path} was replaced while it was probed; try again")
        _refuse_a_chain(path, pid)
    except BaseException:
        os.close(pidfd)
        raise
    return RunningDaemon(pid, pidfd)


def _refuse_a_chain(path: str, pid: int) -> None:
    """Raises StartupError when daemon ``pid`` still waits for the one it took over."""
    waited = waited_for(pid)
    if waited is not None:
        raise StartupError(
            KEY,
            f"the daemon serving {path} (pid {pid}) is itself still waiting for the daemon "
            f"it took over (pid {waited}) to exit (it may still hold the pools' regions): "
            f"not replaced; try again once pid {waited} has exited",
        )


def waited_for(pid: int) -> int | None:
    """The live process that process ``pid`` holds a pidfd of (a daemon waiting for
    the one it took over), itself and its children aside; None when there is none,
    or when ``/proc/PID/fd`` cannot be read (a WARNING: the chain goes unchecked)."""
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError as exc:
        log.warning(
            "cannot tell whether pid %d still waits for a daemon it took over (%s: %s)",
            pid, fd_dir, exc.strerror,
        )  # fmt: skip
        return None
    for fd in fds:
        try:
            if "pidfd" not in os.readlink(f"{fd_dir}/{fd}"):
                continue
            waited = _pidfd_target(f"/proc/{pid}/fdinfo/{fd}")
        except OSError:  # closed since the listing
            continue
        if waited is not None and waited != pid and _parent_of(waited) != pid:
            return waited
    return None


def _pidfd_target(fdinfo: str) -> int | None:
    """The pid a pidfd names (its fdinfo's ``Pid:`` line); None once it has exited."""
    with open(fdinfo, encoding="ascii", errors="replace") as info:
        for line in info:  # a handful of short lines
            if line.startswith("Pid:"):
                value = line[len("Pid:") :].strip()
                return int(value) if value.isdigit() and int(value) > 0 else None
    return None


def _parent_of(pid: int) -> int:
    """The parent pid of process ``pid`` (``/proc/PID/status``); -1 if gone."""
    return _status_field(pid, "PPid:", 1)


def _own_socket_file(path: str) -> tuple[int, int] | None:
    """(device, inode) of the socket file at ``path`` (no link followed); None
    when nothing is there. Raises StartupError for anything but a socket of this
    uid."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISSOCK(info.st_mode):
        raise StartupError(KEY, f"{path} is not a socket (a link or another file): not replaced")
    if info.st_uid != os.geteuid():
        raise StartupError(
            KEY,
            f"the socket {path} belongs to uid {info.st_uid}, not to this daemon's uid "
            f"{os.geteuid()}: a takeover only replaces a daemon of the same user",
        )
    return info.st_dev, info.st_ino


def _check_uid(path: str, pid: int, uid: int) -> None:
    if uid != os.geteuid():
        raise StartupError(
            KEY,
            f"the process serving {path} (pid {pid}) runs as uid {uid}, not as this "
            f"daemon's uid {os.geteuid()}: a takeover only replaces a daemon of the same user",
        )


def _pidfd(path: str, pid: int) -> int:
    try:
        return os.pidfd_open(pid)
    except OSError as exc:
        raise StartupError(KEY, f"cannot watch pid {pid} serving {path}: {exc}") from None


def _process_uid(pid: int) -> int:
    """The effective uid of process ``pid`` now (``/proc/PID/status``); -1 if gone."""
    return _status_field(pid, "Uid:", 2)


def _status_field(pid: int, name: str, column: int) -> int:
    """Column ``column`` of the line ``name`` of ``/proc/PID/status``; -1 if gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith(name):
                    return int(line.split()[column])
    except (OSError, ValueError, IndexError):
        pass
    return -1


class Takeover:
    """The replacement of the daemon ``old`` by this one (see the module).

    ``placement`` holds this daemon's Unix sockets, bound at temporary names;
    ``stop_timeout``: how long the old daemon may take to stop after SIGTERM
    before it gets SIGKILL. ``clock``: monotonic seconds (tests inject one).
    Owns ``old.pidfd`` (closed by :meth:`wait_gone`)."""

    def __init__(
        self,
        old: RunningDaemon,
        placement: SocketPlacement,
        stop_timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.old = old
        self.placement = placement
        self.stop_timeout = stop_timeout
        self._clock = clock
        self.published_at = 0.0  # clock reading when the sockets were renamed
        self.old_gone_at = 0.0  # clock reading when the old daemon had exited
        self.gone = asyncio.Event()  # set once the old daemon has exited

    def publish(self) -> None:
        """Puts the sockets at the paths, all or none, then asks the old daemon to
        stop. Raises StartupError, signalling nothing, when they cannot all be put
        there: every path then holds what it held before."""
        try:
            self.placement.publish()
        except PublishError as exc:
            raise StartupError(
                KEY, f"{exc}; nothing was replaced: pid {self.old.pid} serves on"
            ) from None
        self.published_at = self._clock()
        log.info(
            "took over %s; stopping the previous daemon (pid %d)",
            ", ".join(s.path for s in self.placement.bound), self.old.pid,
        )  # fmt: skip
        _signal(self.old.pidfd, signal.SIGTERM)

    async def wait_gone(self) -> None:
        """Returns once the old daemon has exited (SIGKILL after ``stop_timeout``;
        an error logged every ``KILL_WAIT`` seconds while even that has not ended
        it), then puts back any socket name it removed at its exit."""
        try:
            if not await _exited(self.old.pidfd, self.stop_timeout):
                log.error(
                    "the previous daemon (pid %d) did not stop within %gs; killing it",
                    self.old.pid, self.stop_timeout,
                )  # fmt: skip
                _signal(self.old.pidfd, signal.SIGKILL)
                while not await _exited(self.old.pidfd, KILL_WAIT):
                    log.error(
                        "the previous daemon (pid %d) is still alive after SIGKILL; "
                        "no pool opens until it has exited", self.old.pid,
                    )  # fmt: skip
        finally:
            os.close(self.old.pidfd)
        self._gone()

    def _gone(self) -> None:
        self.old_gone_at = self._clock()
        restored = self.placement.restore()
        if restored:
            log.warning("the previous daemon removed %s at its exit; put back", restored)
        self.placement.forget_links()
        self.gone.set()
        log.info(
            "the previous daemon (pid %d) stopped %.2fs after the takeover",
            self.old.pid, self.old_gone_at - self.published_at,
        )  # fmt: skip


def _signal(pidfd: int, signum: int) -> None:
    """Sends ``signum`` to the process of ``pidfd`` (nothing if it has exited)."""
    try:
        signal.pidfd_send_signal(pidfd, signum)
    except ProcessLookupError:
        pass


async def _exited(pidfd: int, timeout: float) -> bool:
    """Whether the process of ``pidfd`` exits within ``timeout`` seconds (a pidfd
    turns readable once it has)."""
    loop = asyncio.get_running_loop()
    exited = loop.create_future()

    def readable() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(pidfd, readable)
    try:
        await asyncio.wait_for(exited, timeout)
        return True
    except asyncio.TimeoutError:
        return False
    finally:
        loop.remove_reader(pidfd)
