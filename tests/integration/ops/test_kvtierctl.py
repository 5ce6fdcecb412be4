"""kvtierctl against a live daemon (output and exit codes), against a dead socket and
against a server that sends escape sequences; ``make run`` saying how to reach the
daemon with it."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from daemon_harness import (
    KVTIERCTL,
    REPO,
    DaemonProcess,
    ctl,
    eventually,
    free_port,
    fs_tiers_config,
    start_daemon,
    wait_tier_jobs,
)

from kvtierd import __version__
from kvtierd_client.client import Client
from kvtierd_client.wire.proto import pb2, pb2_grpc

BLOCK = 4096


@pytest.fixture(scope="module")
def tiered(tmp_path_factory) -> Iterator[DaemonProcess]:
    root = tmp_path_factory.mktemp("fs")
    daemon = start_daemon(config=fs_tiers_config(root))
    try:
        yield daemon
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.cleanup()


@pytest.fixture
def stored(tiered, pool_name) -> Iterator[tuple[Client, str]]:
    client = Client(tiered.address)
    session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=2, layout="ctl")
    session.prepare_store([b"alpha", b"beta"])
    session.complete_store([b"alpha", b"beta"])
    wait_tier_jobs(tiered.stub(), pool_name)
    session.prepare_store([b"gamma"])  # evicts alpha (least recently used)
    session.complete_store([b"gamma"])
    wait_tier_jobs(tiered.stub(), pool_name)
    yield client, pool_name
    client.close()


def test_status_lists_pools_and_tiers(tiered, stored):
    _, pool = stored
    result = ctl(tiered.address, "status")
    assert result.returncode == 0, result.stderr
    assert "kvtierd " in result.stdout and " session" in result.stdout
    assert f"pool {pool}: 2 blocks x 4.0 KiB, lru" in result.stdout
    assert "  primary    2/2 blocks" in result.stdout
    assert "  fs0        3/" in result.stdout


def test_stats_table_and_json(tiered, stored):
    _, pool = stored
    table = ctl(tiered.address, "stats", "--pool", pool)
    assert table.returncode == 0, table.stderr
    tiers_table = table.stdout.split("\n\n")[0]  # then the fs tier's admission table
    header, *rows = tiers_table.splitlines()
    assert header.split()[:4] == ["pool", "tier", "used", "capacity"]
    assert [row.split()[1] for row in rows] == ["primary", "fs0"]
    # warm restart is on: the primary's journal lag, in seconds (nothing waits now)
    lag = header.split().index("lag")  # cells like "0 B" hold spaces: from the end
    assert [row.split()[lag - len(header.split())] for row in rows] == ["0.000s", "-"]
    as_json = ctl(tiered.address, "stats", "--pool", pool, "--json")
    data = json.loads(as_json.stdout)
    (pool_stats,) = data["pools"]
    assert pool_stats["name"] == pool
    # numbers are JSON numbers (protobuf's JSON mapping writes 64-bit ones as strings)
    assert pool_stats["tiers"][1]["cascade_blocks"] == 3
    assert (pool_stats["block_bytes"], data["memory_budget_bytes"]) == (BLOCK, 1 << 30)
    primary = pool_stats["tiers"][0]
    assert (primary["used_blocks"], primary["hits"], primary["misses"]) == (2, 0, 0)  # 0s too
    # the primary answers HIT / MISS, never RETRY: ready (it was false while serving HITs)
    assert (primary["ready"], pool_stats["tiers"][1]["ready"]) == (True, True)
    assert numbers_as_text(data) == []


def numbers_as_text(value: object, where: str = "") -> list[str]:
    """Where in a JSON value a number was written as a string."""
    if isinstance(value, dict):
        return [bad for k, v in value.items() for bad in numbers_as_text(v, f"{where}.{k}")]
    if isinstance(value, list):
        return [bad for i, v in enumerate(value) for bad in numbers_as_text(v, f"{where}[{i}]")]
    return [where] if isinstance(value, str) and value.lstrip("-").isdigit() else []


def test_counts_agree_with_their_nouns():
    """One session, one pool of one block: "1 session, 1 pool", "1 block" (it said
    "1 sessions, 1 pools"); flush says "1 block evicted"."""
    daemon = start_daemon()
    try:
        with Client(daemon.address) as client:
            session = client.open_session("solo", block_bytes=BLOCK, num_blocks=1)
            session.prepare_store([b"k"])
            session.complete_store([b"k"])
            status = ctl(daemon.address, "status")
            assert status.returncode == 0, status.stderr
            assert ": up " in status.stdout and ", 1 session, 1 pool, memory " in status.stdout
            assert "pool solo: 1 block x 4.0 KiB, lru, 1 session, layout ''" in status.stdout
            flushed = ctl(daemon.address, "flush", "solo")
            assert flushed.stdout.startswith("pool solo: 1 block evicted"), flushed.stdout
    finally:
        daemon.stop()
        daemon.cleanup()


def test_version():
    result = subprocess.run([KVTIERCTL, "--version"], capture_output=True, text=True, timeout=30)
    assert (result.returncode, result.stdout) == (0, f"kvtierctl {__version__}\n"), result.stderr


def test_status_names_the_address_from_the_environment(tiered):
    """With $KVTIERD_ADDRESS set, status names that address, not "the default socket"."""
    result = subprocess.run(
        [KVTIERCTL, "status"], capture_output=True, text=True, timeout=30,
        env={**os.environ, "KVTIERD_ADDRESS": tiered.address},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    first = result.stdout.splitlines()[0]
    assert first.startswith(f"kvtierd {__version__} at {tiered.address} ($KVTIERD_ADDRESS): up")
    given = ctl(tiered.address, "status").stdout.splitlines()[0]
    assert given.startswith(f"kvtierd {__version__} at {tiered.address}: up")


@pytest.mark.parametrize(
    "command",
    [["stats", "--json"], ["stats"], ["status"], ["stats", "--watch", "0.1"], ["watch", "p"]],
)
def test_a_closed_pipe_ends_quietly(tiered, stored, command):
    """``kvtierctl stats --json | head``: once stdout's reader is gone, kvtierctl ends
    with the status a SIGPIPE gives (141) and nothing on stderr (it was a
    BrokenPipeError traceback). Here the reader is closed before kvtierctl starts, so
    its first write finds it gone."""
    _, pool = stored
    args = [*command[:-1], pool] if command[0] == "watch" else command
    if command[0] == "watch":  # replays the pool's events: something to write at once
        args += ["--after-seq", "0"]
    reader, writer = os.pipe()
    os.close(reader)
    try:
        result = subprocess.run(
            [KVTIERCTL, "--address", tiered.address, *args],
            stdout=writer, stderr=subprocess.PIPE, text=True, timeout=30,
        )  # fmt: skip
    finally:
        os.close(writer)
    assert (result.returncode, result.stderr) == (141, "")


def test_explain_flush_and_watch(tiered, stored):
    client, pool = stored
    evicted = ctl(tiered.address, "explain", pool, "alpha")
    assert evicted.returncode == 0, evicted.stderr
    assert "held by tier fs0: the next Lookup promotes it" in evicted.stdout
    assert "primary: evicted: least recently used, to make room" in evicted.stdout
    never = ctl(tiered.address, "explain", pool, "6e6f7065", "--hex")  # b"nope"
    assert "MISS: never stored" in never.stdout

    # the stream replays from the pool's last event, so the flush's is seen however
    # late the stream opens (it waited a second for the stream to open)
    after = client.get_stats(pool).pools[0].last_event_seq
    watcher = subprocess.Popen(
        [KVTIERCTL, "--address", tiered.address, "watch", pool, "--count", "1",
         "--after-seq", str(after)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    flushed = ctl(tiered.address, "flush", pool)
    assert flushed.returncode == 0, flushed.stderr
    assert f"pool {pool}: 2 blocks evicted" in flushed.stdout
    out, err = watcher.communicate(timeout=30)
    assert watcher.returncode == 0, err
    assert " removed cpu/primary 2 keys: " in out
    assert "flushed (FlushPool)" in ctl(tiered.address, "explain", pool, "beta").stdout


def test_daemon_errors_are_one_readable_line(tiered):
    result = ctl(tiered.address, "flush", "no-such-pool")
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0
    assert "kvtierctl flush: NOT_FOUND: pool 'no-such-pool' does not exist" in result.stderr


# OSC (set the window title, BEL-ended), erase the screen, a C1 CSI (UTF-8 terminals act
# on it too), a right-to-left override: what a terminal would act on or hide behind
HOSTILE = "\x1b]0;owned\x07\x1b[2J\x9b31m\u202e"


class Impostor(pb2_grpc.KVTierServicer):
    """A server that is not kvtierd, at the address an operator gives kvtierctl (anyone
    may listen on a TCP port while the daemon is down): every string it sends carries
    ``HOSTILE``. A real daemon sends none (it refuses such pool and tier names and
    quotes what it echoes), so only an impostor shows what kvtierctl prints raw."""

    def GetStats(self, request, context):  # noqa: N802 - the RPC's name
        tiers = [pb2.TierStats(tier="primary", medium=pb2.MEDIUM_CPU),
                 pb2.TierStats(tier="redis" + HOSTILE, medium=pb2.MEDIUM_REMOTE,
                               nodes_known=1, nodes_reachable=1)]  # fmt: skip
        pool = pb2.PoolStats(name="p" + HOSTILE, eviction_policy="lru" + HOSTILE,
                             layout="L" + HOSTILE, tiers=tiers)  # fmt: skip
        return pb2.GetStatsResponse(version="9" + HOSTILE, pools=[pool])

    def Explain(self, request, context):  # noqa: N802
        return pb2.ExplainResponse(
            primary=pb2.LOOKUP_RESULT_MISS,
            summary="held" + HOSTILE,
            tiers=[pb2.TierPresence(tier="redis" + HOSTILE, present=True, known=True)],
            history=[pb2.KeyRecord(unix_time=1.0, tier="fs" + HOSTILE, what="gone" + HOSTILE)],
        )

    def FlushPool(self, request, context):  # noqa: N802
        context.abort(grpc.StatusCode.NOT_FOUND, "no pool" + HOSTILE)

    def WatchEvents(self, request, context):  # noqa: N802
        yield pb2.Event(seq=1, keys=[b"k"], medium=pb2.MEDIUM_REMOTE, tier="redis" + HOSTILE)


class NewerDaemon(pb2_grpc.KVTierServicer):
    """A server answering Explain with a lookup state this kvtierctl has no name for
    (a newer daemon's), or the wire's unset 0."""

    def __init__(self, state: int) -> None:
        self.state = state

    def GetStats(self, request, context):  # noqa: N802 - the RPC's name
        return pb2.GetStatsResponse(version="9.9", pools=[pb2.PoolStats(name="p")])

    def Explain(self, request, context):  # noqa: N802
        return pb2.ExplainResponse(primary=self.state, summary="a newer state")


@contextlib.contextmanager
def serving(servicer: pb2_grpc.KVTierServicer) -> Iterator[str]:
    """``servicer`` on a TCP port of 127.0.0.1 (anyone may listen there); its address."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb2_grpc.add_KVTierServicer_to_server(servicer, server)
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    server.start()
    try:
        yield address
    finally:
        server.stop(grace=None)


@pytest.fixture
def impostor() -> Iterator[str]:
    with serving(Impostor()) as address:
        yield address


@pytest.mark.parametrize(
    ("state", "shown"), [(7, "unknown state 7"), (0, "LOOKUP_RESULT_UNSPECIFIED (0)")]
)
def test_explain_shows_a_state_it_has_no_name_for(state, shown):
    """A newer daemon's lookup state is printed as what is known of it: a traceback
    (ValueError: 7 is not a valid LookupResult) ended kvtierctl explain."""
    with serving(NewerDaemon(state)) as address:
        result = ctl(address, "explain", "p", "k")
    assert result.returncode == 0, result.stderr
    assert f"  primary: {shown} (ref count 0)" in result.stdout.splitlines(), result.stdout


@pytest.mark.parametrize(
    "command",
    [["status"], ["stats"], ["explain", "p", "k"], ["flush", "p"], ["watch", "p", "--count", "1"]],
)
def test_a_servers_strings_reach_the_terminal_escaped(impostor, command):
    """Scenario: kvtierctl asks a server whose pool, tier and policy names, version,
    explanations and error details carry escape sequences. Every one reaches stdout
    and stderr escaped (\\x1b, \\x9b, \\u202e): no character a terminal acts on
    but the line breaks kvtierctl writes itself. Before: printed raw."""
    result = ctl(impostor, *command)
    output = result.stdout + result.stderr
    acted_on = sorted({char for char in output if not char.isprintable() and char != "\n"})
    assert acted_on == [], f"{acted_on} reached the terminal:\n{output!r}"
    assert "\\x1b]0;owned\\x07\\x1b[2J\\x9b31m\\u202e" in output, output
    assert result.returncode == (1 if command[0] == "flush" else 0), output


def test_json_output_is_escaped_by_json(impostor):
    result = ctl(impostor, "stats", "--json")
    assert result.returncode == 0, result.stderr
    assert all(char.isprintable() or char == "\n" for char in result.stdout)
    assert json.loads(result.stdout)["pools"][0]["name"] == "p" + HOSTILE


@pytest.mark.parametrize("command", [["status"], ["stats"], ["flush", "p"], ["explain", "p", "k"]])
def test_dead_socket_is_a_clear_error(tmp_path, command):
    result = ctl(f"unix://{tmp_path}/gone.sock", *command)
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr and "Traceback" not in result.stderr


def test_make_run_says_how_to_reach_it_and_the_command_works(tmp_path, socket_dir):
    """``make run`` prints where the daemon serves, the kvtierctl command that reaches
    it (the venv's, kvtierctl is not on PATH) and what it writes outside the checkout;
    the printed command works while the daemon runs. ``-o install``: the venv this
    test runs in is used as it is (``BIN``), never rebuilt."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("needs make")
    sock, shm, state = f"{socket_dir}/k.sock", tmp_path / "shm", tmp_path / "state"
    shm.mkdir()
    state.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env.pop("KVTIERD_ADDRESS", None)
    env.update(
        KVTIERD_SERVER_LISTEN=f"unix://{sock}", KVTIERD_SERVER_METRICS_ADDRESS="",
        KVTIERD_MEMORY_SHM_DIR=str(shm), STATE_DIRECTORY=str(state), PYTHONUNBUFFERED="1",
    )  # fmt: skip
    bin_dir = str(Path(sys.executable).parent)
    make_run = subprocess.Popen(
        [make, "--no-print-directory", "-o", "install", "run", f"BIN={bin_dir}"], cwd=REPO,
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its own process group: Ctrl-C reaches make and the daemon
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(make_run.stdout), daemon=True)
    reader.start()
    try:
        eventually(
            lambda: any("kvtierd ready" in line for line in lines) or make_run.poll() is not None,
            60, lambda: "".join(lines),
        )  # fmt: skip
        assert make_run.poll() is None, "".join(lines)
        assert lines[0] == f"kvtierd will serve on unix://{sock} (Ctrl-C stops it)\n"
        command = lines[1].removeprefix("reach it with: ").split("   (")[0]
        assert command == f"{bin_dir}/kvtierctl --address unix://{sock} status", lines[1]
        assert "kvtierctl is in the venv, not on PATH" in lines[1]
        writes = f"{socket_dir} (socket), {state}/fs (fs tier fs), {shm} (region files, kept"
        assert lines[2].startswith(("as root, " if os.geteuid() == 0 else "") + "it writes: ")
        assert writes in lines[2]
        status = subprocess.run(
            shlex.split(command), cwd=REPO, env=env, capture_output=True, text=True, timeout=30
        )
        assert status.returncode == 0, status.stderr
        assert status.stdout.startswith(f"kvtierd {__version__} at unix://{sock}: up")
    finally:
        os.killpg(make_run.pid, signal.SIGINT)
        make_run.wait(60)
        reader.join(10)
    assert any("shutdown complete" in line for line in lines), "".join(lines)
