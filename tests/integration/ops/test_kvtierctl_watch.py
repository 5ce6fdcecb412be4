"""``kvtierctl stats --watch SECONDS`` against a live daemon: on a terminal (a real
pseudo-terminal) it clears the screen and redraws the table each interval, and
Ctrl-C (SIGINT) ends it with exit code 0 and nothing on the screen; bad values
are usage errors."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_harness import eventually

from kvtierd.ops.ctl import CLEAR_SCREEN
from kvtierd_client.client import Client

KVTIERCTL = str(Path(sys.executable).parent / "kvtierctl")


def watch_command(address: str, pool: str) -> list[str]:
    return [KVTIERCTL, "--address", address, "stats", "--pool", pool, "--watch"]


def read_until(fd: int, done, timeout: float) -> bytes:  # noqa: ANN001 - predicate
    """Reads ``fd`` until ``done(all read so far)`` or ``timeout`` seconds; wakes when
    ``fd`` is readable."""
    out = bytearray()

    def read_more(seconds: float) -> None:
        if not select.select([fd], [], [], seconds)[0]:
            return
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the other side closed
            chunk = b""
        if not chunk:
            raise AssertionError(f"the terminal closed; read: {bytes(out)!r}")
        out.extend(chunk)

    eventually(
        lambda: done(bytes(out)), timeout, lambda: f"read so far: {bytes(out)!r}", wake=read_more
    )
    return bytes(out)


def drain(fd: int) -> bytes:
    """What is left to read on ``fd`` (the process has ended)."""
    rest = b""
    while select.select([fd], [], [], 0.5)[0]:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the other side closed
            break
        if not chunk:
            break
        rest += chunk
    return rest


def test_watch_redraws_on_a_terminal_and_ctrl_c_exits_0(daemon, pool_name):
    clear = CLEAR_SCREEN.encode()
    with Client(daemon.address) as client:
        session = client.open_session(pool_name, block_bytes=4096, num_blocks=4)
        master, slave = os.openpty()
        proc = subprocess.Popen(
            [*watch_command(daemon.address, pool_name), "0.1"],
            stdin=slave, stdout=slave, stderr=slave, close_fds=True,
        )  # fmt: skip
        os.close(slave)
        try:
            first = read_until(master, lambda out: out.count(clear) >= 2, timeout=20)
            assert re.search(rf"{re.escape(pool_name)}\s+primary\s+0\s+4\s".encode(), first)
            session.prepare_store([b"k"])  # a later redraw shows it
            session.complete_store([b"k"])
            stored = rf"{re.escape(pool_name)}\s+primary\s+1\s+4\s".encode()
            later = read_until(master, lambda out: re.search(stored, out) is not None, 20)
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
            rest = drain(master)
            os.close(master)
    assert proc.returncode == 0, rest
    screen = later[later.rindex(clear) + len(clear) :].decode()
    header, table_header, primary = screen.splitlines()[:3]
    assert header.startswith("kvtierd stats every 0.1s, ") and header.endswith("(Ctrl-C exits)")
    assert table_header.split()[:5] == ["pool", "tier", "used", "capacity", "hits"]
    assert primary.split()[:4] == [pool_name, "primary", "1", "4"]
    assert b"Traceback" not in first + later + rest
    assert b"KeyboardInterrupt" not in rest


def test_watch_without_a_terminal_prints_tables_without_escapes(daemon, pool_name):
    with Client(daemon.address) as client:
        client.open_session(pool_name, block_bytes=4096, num_blocks=4)
        proc = subprocess.Popen(
            [*watch_command(daemon.address, pool_name), "0.1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            row = f"\n{pool_name}  primary".encode()
            out = read_until(proc.stdout.fileno(), lambda out: out.count(row) >= 2, 20)
            proc.send_signal(signal.SIGINT)
            rest, err = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert (proc.returncode, err) == (0, b""), out + rest
    assert CLEAR_SCREEN.encode() not in out
    frames = out.split(b"kvtierd stats every 0.1s, ")[1:]
    assert len(frames) >= 2
    assert all(row in frame for frame in frames[:2]), out  # each frame whole: header and row
    assert err == b""


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "0 is out of range; give 0.1 to 86400 seconds"),
        ("-1", "-1 is out of range"),
        ("nan", "nan is out of range"),
        ("inf", "inf is out of range"),
        ("soon", "'soon' is not a number of seconds"),
    ],
)
def test_watch_value_is_validated(value, message):
    result = subprocess.run(
        [KVTIERCTL, "--address", "unix:///nonexistent.sock", "stats", "--watch", value],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 2
    assert f"argument --watch: {message}" in result.stderr


def test_watch_and_json_exclude_each_other():
    result = subprocess.run(
        [KVTIERCTL, "stats", "--watch", "1", "--json"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert "not allowed with argument" in result.stderr


def test_watch_is_in_the_help():
    result = subprocess.run([KVTIERCTL, "stats", "--help"], capture_output=True, text=True)
    assert "--watch SECONDS" in result.stdout and "until Ctrl-C" in result.stdout
