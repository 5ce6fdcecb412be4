"""Start, serve, and shut down the real daemon: sockets, region files, health,
reflection, stale files from a crashed daemon."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat

import faulty_daemon
import grpc
import pytest
from daemon_harness import eventually, fs_tiers_config, health_status, start_daemon, stopped
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from kvtierd_client.client import Client
from kvtierd_client.wire.proto import pb2


def open_pool(daemon, name: str, num_blocks: int = 4):
    stub = daemon.stub()
    return stub, stub.OpenSession(pb2.OpenSessionRequest(
        pool=pb2.PoolSpec(name=name, block_bytes=4096, num_blocks=num_blocks)))  # fmt: skip


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_shuts_down_cleanly(sig):
    # warm: tests/integration/primary/warm/test_warm_restart.py
    daemon = start_daemon("--warm-restart", "false")
    try:
        _, opened = open_pool(daemon, "lifecycle")
        region = opened.region.path
        assert os.path.exists(region)
        assert stat.S_IMODE(os.stat(region).st_mode) == 0o660
        assert stat.S_IMODE(os.stat(daemon.socket_path).st_mode) == 0o660
        assert daemon.stop(sig) == 0, daemon.log()
        assert not os.path.exists(daemon.socket_path)
        assert not os.path.exists(region)
        assert "shutdown complete" in daemon.log()
    finally:
        daemon.cleanup()


def test_a_failing_shutdown_step_skips_none_of_the_others(tmp_path):
    """Scenario: at SIGTERM a tier's ``shutdown()`` and the peer tickets' ``close()``
    raise (faults injected: nothing real can make them fail, tests/faulty_daemon.py).
    The steps after them still run: the pool's region file is unlinked, the listen,
    lane, ticket and region-descriptor sockets are removed; each failure is logged
    once with its step's name and traceback; the daemon exits 1 (the first failure,
    raised once every step ran). Before, the tier's exception skipped every later step."""
    config = (
        '[[security.principals]]\nname = "admin"\nuids = [0]\npools = ["*"]\n'
        + fs_tiers_config(tmp_path / "fs", create_root=True)
    )
    daemon = start_daemon(
        "--warm-restart", "false", config=config,
        command_prefix=faulty_daemon.prefix("tier-shutdown", "tickets-close"),
    )  # fmt: skip
    try:
        with Client(daemon.address) as client:  # over a peer ticket, the region by descriptor
            session = client.open_session("stop/faults", block_bytes=4096, num_blocks=4)
            region = session.region.path
            sockets = [
                os.path.join(daemon.workdir, name)
                for name in os.listdir(daemon.workdir)
                if stat.S_ISSOCK(os.lstat(os.path.join(daemon.workdir, name)).st_mode)
            ]
            assert session.region.fd_socket in sockets and daemon.socket_path in sockets
            assert len(sockets) == 4, sockets  # listen, lane, tickets, region descriptors
            assert os.path.exists(region)
            code = daemon.stop()
        log = daemon.log()
        assert code == 1, log
        assert not os.path.exists(region), log  # the pools closed
        assert [path for path in sockets if os.path.lexists(path)] == [], log
        for step, last_line in (
            ("peer tickets", f"RuntimeError: {faulty_daemon.TICKETS_CLOSE_MESSAGE}"),
            ("tier fs0", f"OSError: [Errno 5] {faulty_daemon.TIER_SHUTDOWN_MESSAGE}"),
        ):
            assert log.count(f"shutdown step '{step}' failed") == 1, log
            assert log.count(last_line) == 1, log  # its traceback's
        assert log.count("Traceback") == 2, log  # each failure once, not again at exit
        assert "2 steps failed: peer tickets, tier fs0" in log, log
        # the first failure, raised again once all ran: its one line on stderr, exit code 1
        assert log.endswith(f"kvtierd: {faulty_daemon.TICKETS_CLOSE_MESSAGE}\n"), log
        assert "shutdown complete" not in log
    finally:
        daemon.cleanup()


def test_health_and_reflection(daemon):
    assert health_status(daemon) == "SERVING"
    assert health_status(daemon, "kvtier.v1.KVTier") == "SERVING"
    with grpc.insecure_channel(daemon.target) as channel:
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert "kvtier.v1.KVTier" in services and "grpc.health.v1.Health" in services


def test_stale_socket_is_replaced_and_live_socket_refused():
    first = start_daemon()
    try:
        second = start_daemon("--listen", "unix://" + first.socket_path, wait=False)
        try:
            assert second.proc.wait(30) == 2  # the operator's to fix: one line, exit 2
            log = second.log()
            assert "cannot start: server.listen: another process is already serving" in log
            assert "Traceback" not in log
        finally:
            second.cleanup()
        assert first.alive() and health_status(first) == "SERVING"
    finally:
        first.stop()
        first.cleanup()

    # a socket file nobody serves (a crashed daemon's) is removed and re-bound
    leftover = start_daemon(wait=False)
    leftover.stop(signal.SIGKILL)
    path = leftover.socket_path
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path + ".x")
    stale.close()
    os.rename(path + ".x", path)
    third = start_daemon("--listen", "unix://" + path)
    try:
        assert "removing stale socket" in third.log()
        assert health_status(third) == "SERVING"
    finally:
        third.stop()
        third.cleanup()
        leftover.cleanup()


def test_a_second_daemon_with_the_same_defaults_is_told_the_socket_is_served():
    """Started twice with the embedded default (an fs tier whose root lock the
    first holds, the same shm_dir): the socket is named, not the fs root."""
    first = start_daemon(config=None)
    try:
        second = start_daemon(
            "--listen", first.address, config=None, shm_dir=first.shm_dir,
            env={"STATE_DIRECTORY": first.workdir}, wait=False,
        )  # fmt: skip
        try:
            assert second.proc.wait(30) == 2
            last = second.log().splitlines()[-1]
            assert last == (
                f"kvtierd: cannot start: server.listen: another process is already serving "
                f"{first.socket_path}; stop it first, or give this daemon another listen path"
            )
        finally:  # its shm_dir is the first's: only its own workdir goes
            if second.alive():
                second.proc.kill()
                second.proc.wait()
            shutil.rmtree(second.workdir, ignore_errors=True)
        assert first.alive() and health_status(first) == "SERVING"
    finally:
        first.stop()
        first.cleanup()


def test_stale_region_from_crashed_daemon_is_replaced_not_reused():
    crashed = start_daemon("--warm-restart", "false")  # warm: adopted (test_warm_restart.py)
    shm_dir = crashed.shm_dir
    try:
        _, opened = open_pool(crashed, "survivor")
        path = opened.region.path
        with open(path, "r+b") as region:  # data the dead daemon's clients wrote
            region.write(b"\xab" * 4096)
        inode = os.stat(path).st_ino
        crashed.stop(signal.SIGKILL)
        assert os.path.exists(path)  # SIGKILL leaves it behind

        restarted = start_daemon("--warm-restart", "false", shm_dir=shm_dir)
        try:
            _, reopened = open_pool(restarted, "survivor")
            assert reopened.region.path == path
            assert os.stat(path).st_ino != inode
            with open(path, "rb") as region:
                assert region.read(4096) == b"\0" * 4096
            assert "stale" in restarted.log()
        finally:
            assert restarted.stop() == 0
            restarted.cleanup()
    finally:
        crashed.cleanup()


def test_memory_budget_is_global_across_pools():
    daemon = start_daemon("--memory-budget", "64KiB")
    try:
        open_pool(daemon, "a", num_blocks=8)  # 32 KiB
        open_pool(daemon, "b", num_blocks=8)  # 32 KiB: budget now full
        with pytest.raises(grpc.RpcError) as info:
            open_pool(daemon, "c", num_blocks=1)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "0 B of the 64.0 KiB memory budget is free" in info.value.details()
        assert daemon.alive()
    finally:
        daemon.stop()
        daemon.cleanup()


@pytest.mark.parametrize(
    ("shm_dir", "fragment"),
    [("/proc", "cannot create files in /proc"), ("/nonexistent/shm", "is not a directory")],
)
def test_unusable_shm_dir_refuses_to_start(shm_dir, fragment):
    daemon = start_daemon("--shm-dir", shm_dir, wait=False)
    try:
        assert daemon.proc.wait(30) == 2
        assert "memory.shm_dir" in daemon.log() and fragment in daemon.log()
        assert not os.path.exists(daemon.socket_path)
    finally:
        daemon.cleanup()


def test_health_goes_not_serving_when_shutdown_begins():
    """A Health.Watch stream sees SERVING, then NOT_SERVING as soon as SIGTERM
    arrives (before the listeners close), so load balancers stop routing first."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    daemon = start_daemon()
    try:
        with grpc.insecure_channel(daemon.target) as channel:
            stream = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service="kvtier.v1.KVTier"), timeout=30
            )
            statuses = iter(stream)
            assert next(statuses).status == health_pb2.HealthCheckResponse.SERVING
            daemon.proc.send_signal(signal.SIGTERM)
            assert next(statuses).status == health_pb2.HealthCheckResponse.NOT_SERVING
            stream.cancel()
        assert daemon.proc.wait(30) == 0
    finally:
        daemon.cleanup()


def test_open_session_waits_for_a_slow_pool_creation_past_the_clients_timeout(daemon):
    """The first OpenSession of a big pool waits while the daemon creates its region
    (seconds per GiB, more on a busy machine): its deadline is at least
    OPEN_SESSION_TIMEOUT, not the client's per-call timeout (0.5 s here). The daemon
    is stopped for 1.5 s while the call waits, as a slow creation would keep it."""
    import threading
    import time

    from kvtierd_client.client import Client
    from kvtierd_client.errors import DeadlineExceeded

    def pause_for(seconds: float) -> threading.Timer:
        """Stops the daemon (every thread: SIGSTOP takes effect asynchronously, and a
        thread still running could answer the call) and resumes it ``seconds`` later."""
        daemon.proc.send_signal(signal.SIGSTOP)
        eventually(lambda: stopped(daemon.proc.pid), 30, "the daemon stopped")
        resume = threading.Timer(seconds, daemon.proc.send_signal, (signal.SIGCONT,))
        resume.start()
        return resume

    with Client(daemon.address, timeout=0.5) as client:
        client.get_stats()  # connected: the pause below hits the call, not the connect
        resume = pause_for(1.5)
        try:
            started = time.monotonic()
            session = client.open_session("slow-open", block_bytes=4096, num_blocks=4)
            assert time.monotonic() - started >= 1.0
            session.close()
        finally:
            resume.join()
            daemon.proc.send_signal(signal.SIGCONT)
        resume = pause_for(1.5)
        try:
            with pytest.raises(DeadlineExceeded):  # an explicit timeout is kept
                client.open_session("slow-open", block_bytes=4096, num_blocks=4, timeout=0.5)
        finally:
            resume.join()  # the daemon runs again before the next test
            daemon.proc.send_signal(signal.SIGCONT)
