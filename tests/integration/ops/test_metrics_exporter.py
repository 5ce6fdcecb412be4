"""The metrics exporter process of a real daemon (``kvtierd.ops.metrics_endpoint``):
it runs below the daemon's priority, dies with it, stops with it (a daemon taking
over then binds the port), and one that dies alone is replaced while the port
stays bound."""

from __future__ import annotations

import os
import signal
import socket
import urllib.request
from collections.abc import Iterator

import pytest
from daemon_harness import (
    DaemonProcess,
    children_running,
    eventually,
    free_port,
    gone,
    start_daemon,
)
from takeover_harness import take_over

from kvtierd.ops.metrics_exporter import NICENESS

EXPORTER = "kvtierd.ops.metrics_exporter"


@pytest.fixture
def metered() -> Iterator[tuple[DaemonProcess, str]]:
    address = f"127.0.0.1:{free_port()}"
    daemon = start_daemon("--metrics-address", address)
    try:
        yield daemon, address
    finally:
        daemon.cleanup()


def exporters(daemon: DaemonProcess) -> list[int]:
    return children_running(daemon.proc.pid, EXPORTER)


def exporter_of(daemon: DaemonProcess) -> int:
    found = eventually(lambda: exporters(daemon), 30, "the metrics exporter to run")
    assert len(found) == 1, found
    return found[0]


def scrape_status(address: str) -> int:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as response:
        return int(response.status)


def port_free(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the daemon binds
        try:
            probe.bind((host, int(port)))
        except OSError:
            return False
        return True


def test_the_exporter_serves_below_the_daemons_priority(metered):
    daemon, address = metered
    exporter = exporter_of(daemon)
    assert scrape_status(address) == 200
    daemon_nice = os.getpriority(os.PRIO_PROCESS, daemon.proc.pid)
    assert os.getpriority(os.PRIO_PROCESS, exporter) == daemon_nice + NICENESS
    assert os.stat(f"/proc/{exporter}").st_uid == os.stat(f"/proc/{daemon.proc.pid}").st_uid
    assert daemon.stop() == 0, daemon.log()


def test_an_exporter_that_dies_alone_is_replaced(metered):
    """Killed, the exporter is started again (at most one start every 5 s); scrapes
    are answered by the new one, and the log says what happened."""
    daemon, address = metered
    first = exporter_of(daemon)
    os.kill(first, signal.SIGKILL)
    second = eventually(
        lambda: [pid for pid in exporters(daemon) if pid != first], 30, "a new exporter"
    )[0]
    assert scrape_status(address) == 200
    assert f"metrics exporter (pid {first}) exited with status -9; starting another" in (
        daemon.log()
    )
    assert not gone(second)
    assert daemon.stop() == 0, daemon.log()


def test_the_exporter_dies_with_a_killed_daemon(metered):
    """SIGKILL of the daemon ends the exporter too (PR_SET_PDEATHSIG), which frees
    the port for the next daemon."""
    daemon, address = metered
    exporter = exporter_of(daemon)
    daemon.proc.kill()
    daemon.proc.wait()
    eventually(lambda: gone(exporter), 30, f"exporter {exporter} to die with the daemon")
    eventually(lambda: port_free(address), 30, f"{address} to be free")


def test_a_daemon_stopping_stops_its_exporter_and_frees_the_port(metered):
    daemon, address = metered
    exporter = exporter_of(daemon)
    assert scrape_status(address) == 200
    assert daemon.stop() == 0, daemon.log()
    assert gone(exporter)
    assert port_free(address)


def test_a_daemon_taking_over_serves_the_metrics_once_the_old_one_is_gone(metered):
    """The old daemon's exporter is stopped and reaped before the old daemon exits,
    so the port is free when the new daemon starts its endpoint."""
    old, address = metered
    first = exporter_of(old)
    new = take_over(old)
    try:
        assert gone(first)
        exporter_of(new)
        assert eventually(lambda: scrape_status(address) == 200, 30, "the new daemon's metrics")
        assert "cannot listen" not in new.log(), new.log()
        assert new.stop() == 0, new.log()
    finally:
        new.cleanup()
