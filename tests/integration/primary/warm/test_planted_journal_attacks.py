"""Issue #29, finding 2: files any local user plants at the warm-restart journal's
names in a shared ``memory.shm_dir`` (sticky and world-writable, as ``/dev/shm``),
against a real daemon running as an unprivileged user (the shipped systemd
setup), planted by another real user who cannot even open the daemon's socket.

Before: a planted ``<journal>`` made OpenSession answer INTERNAL with a traceback
in the log (the daemon tried to unlink another user's file in a sticky
directory); a ``<journal>.tmp`` planted while the daemon was stopped refused the
pool with RESOURCE_EXHAUSTED and "free space" advice; one planted while it ran
killed the journal's thread at its next compaction (no ERROR line, warm restart
silently off, and SIGTERM then took 11.5 s). Now a planted journal is reported
in one line and the pool serves without warm restart; the temporary files have
unpredictable names (a plant at any fixed name is ignored); a journal write that
fails turns warm restart off for its pool with one ERROR line and a metric.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest
from daemon_harness import DaemonProcess, eventually, free_port, scrape, start_daemon, value
from local_users import SYSTEM_PYTHON
from nonroot import as_user_prefix, require_nonroot_daemon
from shm_leftovers import shm_tempdir
from spawn_harness import as_user
from users_harness import ThrowawayAccounts, User, require_root
from warm_harness import BLOCK, HIT, assert_bit_exact, store

from kvtierd.primary.region import region_file_name
from kvtierd.primary.warm.journalformat import journal_path
from kvtierd_client.client import Client

ROWS = 64
PROMPT_STOP_S = 5.0  # a stop with nothing to drain (it took 11.5 s with a dead journal thread)

_PLANT = """
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
os.write(fd, b"planted by another user")
os.close(fd)
"""


class Host:
    """A daemon running as user ``kvtierd`` (a throw-away one) in a sticky shared
    shm_dir, and ``mallory``, another user of the host."""

    def __init__(self, accounts: ThrowawayAccounts) -> None:
        self.kvtierd = accounts.user()
        self.mallory = accounts.user()
        self.shm_dir = shm_tempdir()
        os.chmod(self.shm_dir, 0o1777)  # as /dev/shm: anyone may create, nobody replace
        self.metrics = f"127.0.0.1:{free_port()}"
        self.daemons: list[DaemonProcess] = []

    def start(self) -> DaemonProcess:
        daemon = start_daemon(
            "--memory-budget", "64MiB", "--metrics-address", self.metrics,
            "--lease", "2s", "--write-quarantine", "1s",
            shm_dir=self.shm_dir, command_prefix=as_user_prefix(self.kvtierd),
            owner=(self.kvtierd.uid, self.kvtierd.gid),
        )  # fmt: skip
        assert _uid_of(daemon.proc.pid) == self.kvtierd.uid
        self.daemons.append(daemon)
        return daemon

    def restart(self, daemon: DaemonProcess) -> DaemonProcess:
        again = daemon.restart()
        self.daemons.append(again)
        return again

    def journal(self, pool: str) -> str:
        return journal_path(os.path.join(self.shm_dir, region_file_name(pool)))

    def plant(self, path: str) -> None:
        """``mallory`` creates a regular file at ``path``."""
        done = _run_as(self.mallory, _PLANT, path)
        assert done.returncode == 0, done.stderr
        assert os.stat(path).st_uid == self.mallory.uid

    def metric(self, name: str, pool: str) -> float:
        return value(scrape(f"http://{self.metrics}"), name, pool=pool)

    def close(self) -> None:
        for daemon in self.daemons:
            daemon.stop(signal.SIGKILL)
        for daemon in self.daemons:
            daemon.cleanup()  # each start's work directory (a restart shares its own)
        shutil.rmtree(self.shm_dir, ignore_errors=True)


def _run_as(user: User, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``code`` as ``user`` (through setpriv, never ``subprocess``'s ``user=``: spawn_harness)."""
    return subprocess.run(
        as_user([SYSTEM_PYTHON, "-c", code, *args], user.uid, user.gid),
        capture_output=True, text=True, timeout=60, cwd="/", check=False,
    )  # fmt: skip


def _uid_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("Uid:"):
                return int(line.split()[2])  # the effective uid
    raise AssertionError(f"no Uid line for {pid}")


@pytest.fixture
def host() -> Iterator[Host]:
    require_root()
    require_nonroot_daemon()
    accounts = ThrowawayAccounts()
    made: Host | None = None
    try:
        made = Host(accounts)
        yield made
    finally:
        if made is not None:
            made.close()
        accounts.remove_all()


class _JournalSize:
    """The pool's journal_bytes (GetStats), and a wait for it to change."""

    def __init__(self, client: Client, pool: str) -> None:
        self._client = client
        self._pool = pool

    def now(self) -> int:
        return self._client.get_stats(self._pool).pools[0].journal_bytes

    def changed_from(self, size: int, daemon: DaemonProcess) -> int:
        return eventually(
            lambda: (now := self.now()) != size and now, 30,
            lambda: f"the journal written after {size} bytes:\n{daemon.log()[-4000:]}",
        )  # fmt: skip


def fill(path: str) -> None:
    """Writes ``path`` until its file system is full (ENOSPC)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with pytest.raises(OSError, match="No space"):
            _write_forever(fd)
    finally:
        os.close(fd)


def _write_forever(fd: int) -> None:
    while True:
        os.write(fd, bytes(65536))


def store_unwritten(session, keys: list[bytes]) -> None:
    """Stores ``keys`` without writing their rows (their bytes do not matter here)."""
    grant = session.prepare_store(keys)
    assert grant is not None and grant.keys_to_store == keys
    session.complete_store(keys)


def stop_promptly(daemon: DaemonProcess) -> None:
    started = time.monotonic()
    assert daemon.stop(signal.SIGTERM) == 0, daemon.log()
    took = time.monotonic() - started
    assert took < PROMPT_STOP_S, f"SIGTERM took {took:.1f}s:\n{daemon.log()}"


def test_a_journal_planted_before_the_pool_opens_is_reported_and_the_pool_serves(host, pool_name):
    """Plant 1: ``<journal>`` before the pool's first OpenSession (was: INTERNAL, a
    traceback). The pool serves; one ERROR line names the file and its owner;
    ``kvtierd_warm_restart_off`` says the pool's next start is cold; the file is
    left as it is (the daemon cannot and must not remove it)."""
    daemon = host.start()
    planted = host.journal(pool_name)
    host.plant(planted)
    with Client(daemon.address) as client:
        session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=ROWS, layout="l")
        keys = [b"a", b"b"]
        store(session, keys)
        assert session.lookup(keys) == [HIT, HIT]
        assert_bit_exact(session, keys)
        assert host.metric("kvtierd_warm_restart_off", pool_name) == 1
    log = daemon.log()
    assert "Traceback" not in log, log
    lines = [line for line in log.splitlines() if planted in line]
    assert len(lines) == 1 and "ERROR" in lines[0], log
    assert host.mallory.name in lines[0] and "warm restart is off" in lines[0], lines
    stop_promptly(daemon)
    assert os.stat(planted).st_uid == host.mallory.uid  # left alone


def test_a_temp_file_planted_while_the_daemon_is_stopped_does_not_refuse_the_pool(host, pool_name):
    """Plant 2: ``<journal>.tmp`` while the daemon is stopped (was: the pool, and
    every new pool, refused with RESOURCE_EXHAUSTED "free space in shm_dir"). The
    temporary files' names are unpredictable now: the pool is adopted as if the
    file were not there, and other pools open."""
    daemon = host.start()
    keys = [f"kept-{i}".encode() for i in range(8)]
    with Client(daemon.address) as client:
        session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=ROWS, layout="l")
        store(session, keys)
    stop_promptly(daemon)
    host.plant(host.journal(pool_name) + ".tmp")
    daemon = host.restart(daemon)
    with Client(daemon.address) as client:
        session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=ROWS, layout="l")
        assert session.lookup(keys) == [HIT] * len(keys)  # adopted
        assert_bit_exact(session, keys)
        other = client.open_session(pool_name + "-2", block_bytes=BLOCK, num_blocks=8, layout="l")
        store(other, [b"x"])
        assert host.metric("kvtierd_warm_restart_off", pool_name) == 0
    assert "Traceback" not in daemon.log()
    stop_promptly(daemon)


def test_a_temp_file_planted_while_the_pool_runs_neither_kills_the_journal_nor_slows_the_stop(
    host, pool_name
):
    """Plant 3: ``<journal>.tmp`` while the pool runs, then enough stores that the
    journal compacts (was: its thread died there, warm restart was silently off
    and SIGTERM took 11.5 s). Now the compaction happens, the stop is prompt and
    the next daemon adopts the last blocks."""
    daemon = host.start()
    with Client(daemon.address) as client:
        session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=ROWS, layout="l")
        host.plant(host.journal(pool_name) + ".tmp")
        journal = _JournalSize(client, pool_name)
        largest = journal.now()
        for cycle in range(200):  # ~15 KB of records each: past 2 x live + 1 MiB after ~70
            keys = [f"{cycle:04}-{i:02}-".encode().ljust(200, b"k") for i in range(ROWS)]
            grant = session.prepare_store(keys)
            assert grant is not None and grant.keys_to_store == keys
            before = journal.now()
            session.complete_store(keys)
            # the ready records land once hashed: storing over the rows sooner would
            # hand them out again first (nothing to journal)
            size = journal.changed_from(before, daemon)
            if size < largest // 2:
                break  # compacted
            largest = max(largest, size)
        assert largest > 1 << 20 and size < largest // 2, (largest, size)
        final = [f"final-{i}".encode() for i in range(8)]
        store(session, final)
        assert host.metric("kvtierd_warm_restart_off", pool_name) == 0
    stop_promptly(daemon)
    assert "Traceback" not in daemon.log()
    daemon = host.restart(daemon)
    with Client(daemon.address) as client:
        session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=ROWS, layout="l")
        assert session.lookup(final) == [HIT] * len(final)
        assert_bit_exact(session, final)


def test_a_journal_write_that_fails_turns_warm_restart_off_with_one_error_and_a_metric(
    host, pool_name
):
    """A real ENOSPC: the daemon's shm_dir is a 2 MiB tmpfs of its own, filled by
    root once the pool runs. The journal's next write fails: warm restart is off for
    that pool (one ERROR line, ``kvtierd_warm_restart_off`` 1, the journal removed),
    the pool goes on serving, and the stop is prompt."""
    daemon = start_daemon(
        "--memory-budget", "64MiB", "--metrics-address", host.metrics,
        shm_dir=host.shm_dir,
        command_prefix=as_user_prefix(host.kvtierd, small_tmpfs=(host.shm_dir, 2 << 20)),
        owner=(host.kvtierd.uid, host.kvtierd.gid),
    )  # fmt: skip
    host.daemons.append(daemon)
    seen = f"/proc/{daemon.proc.pid}/root{host.shm_dir}"  # the daemon's own tmpfs
    with Client(daemon.address) as client:
        session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=ROWS, layout="l")
        store_unwritten(session, [b"before"])  # the region is in the daemon's namespace
        journal = seen + "/" + os.path.basename(host.journal(pool_name))
        assert os.path.exists(journal)
        fill(seen + "/filler")
        # the journal's last page may hold a few more records: store until one
        # needs a new page (19 bytes per freed row, 28 per ready one here)
        for i in range(400):
            store_unwritten(session, [f"after-{i}".encode()])
            if host.metric("kvtierd_warm_restart_off", pool_name):
                break
        assert host.metric("kvtierd_warm_restart_off", pool_name) == 1
        assert not os.path.exists(journal)
        assert session.lookup([f"after-{i}".encode()]) == [HIT]  # the pool serves on
    errors = [line for line in daemon.log().splitlines() if " ERROR " in line]
    assert len(errors) == 1, daemon.log()
    assert "No space left on device" in errors[0] and "warm restart is off" in errors[0]
    stop_promptly(daemon)


def test_a_missing_shm_dir_is_created_private_and_nobody_else_can_plant_in_it(host, pool_name):
    """The shipped configurations name ``/dev/shm/kvtierd``: the daemon creates it
    (its own, 0750) under the sticky shared tmpfs, so no other user can create a
    file at any of its names; one another user made first refuses the start
    with one line naming its owner."""
    private = os.path.join(host.shm_dir, "kvtierd")
    daemon = start_daemon(
        "--memory-budget", "64MiB", shm_dir=private,
        command_prefix=as_user_prefix(host.kvtierd), owner=(host.kvtierd.uid, host.kvtierd.gid),
    )  # fmt: skip
    host.daemons.append(daemon)
    st = os.stat(private)
    assert (st.st_uid, oct(st.st_mode & 0o7777)) == (host.kvtierd.uid, "0o750")
    journal = journal_path(os.path.join(private, region_file_name(pool_name)))
    refused = _run_as(host.mallory, _PLANT, journal)
    assert refused.returncode != 0 and "PermissionError" in refused.stderr
    with Client(daemon.address) as client:
        session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=ROWS, layout="l")
        store(session, [b"k"])
        assert session.lookup([b"k"]) == [HIT]
    stop_promptly(daemon)
    shutil.rmtree(private)

    taken = _run_as(host.mallory, "import os, sys; os.mkdir(sys.argv[1], 0o777)", private)
    assert taken.returncode == 0, taken.stderr
    refused_start = start_daemon(
        "--memory-budget", "64MiB", shm_dir=private, wait=False,
        command_prefix=as_user_prefix(host.kvtierd), owner=(host.kvtierd.uid, host.kvtierd.gid),
    )  # fmt: skip
    host.daemons.append(refused_start)
    assert refused_start.proc.wait(30) == 2, refused_start.log()
    errors = [line for line in refused_start.log().splitlines() if "memory.shm_dir" in line]
    assert len(errors) == 1 and host.mallory.name in errors[0], refused_start.log()
