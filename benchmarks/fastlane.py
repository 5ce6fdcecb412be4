"""The fast lane against gRPC and a raw echo floor (issue #21), in one run.

Three ways to answer a 32-key Lookup from a blocking client, interleaved in
rounds so that the machine's load hits each alike:

- **echo floor**: a uvloop server process that reads a length-prefixed
  LookupRequest, parses it, and answers a LookupResponse of 32 MISS results
  (no daemon work at all): what any framed protobuf transport costs here;
- **fast lane**: ``Session.lookup`` through the client library on the
  session's lane (the default);
- **gRPC**: the same call with ``Client(fast_lane=False)``.

p50 µs per call, and CPU per call of each end (the server process and this
client process, from /proc). Targets: fast lane <= 3x the echo floor's p50,
daemon CPU per call <= 4x the echo server's.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import time

from benchmarks.common import BenchDaemon, Row, cpu_seconds, percentile
from kvtierd_client.client import Client
from kvtierd_client.wire.proto import pb2

POOL = "bench/fastlane"
ROUNDS = 5
CALLS_PER_ROUND = 3000
WARMUP = 200
KEYS = [f"lane-{i:012d}-".encode().ljust(36, b"k") for i in range(32)]

ECHO_SERVER = textwrap.dedent("""
    import asyncio, struct, sys
    import uvloop
    from kvtierd_client.wire.proto import pb2
    HEADER = struct.Struct("<IB")
    ANSWER = pb2.LookupResponse(results=[pb2.LOOKUP_RESULT_MISS] * 32).SerializeToString()
    FRAME = HEADER.pack(len(ANSWER) + 1, 0) + ANSWER

    class Echo(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport, self.pending = transport, b""
        def data_received(self, data):
            data = self.pending + data if self.pending else data
            pos = 0
            while len(data) - pos >= 5:
                length, kind = HEADER.unpack_from(data, pos)
                if len(data) - pos - 4 < length:
                    break
                request = pb2.LookupRequest.FromString(memoryview(data)[pos + 5 : pos + 4 + length])
                assert len(request.keys) == 32
                self.transport.write(FRAME)
                pos += 4 + length
            self.pending = data[pos:]

    async def main(path):
        loop = asyncio.get_running_loop()
        server = await loop.create_unix_server(Echo, path)
        print("ready", flush=True)
        await server.serve_forever()

    uvloop.run(main(sys.argv[1]))
""")


class EchoServer:
    """The floor's server process (uvloop, like the daemon)."""

    def __init__(self) -> None:
        self.workdir = tempfile.mkdtemp(prefix="kvtb-echo-", dir="/tmp")
        self.path = os.path.join(self.workdir, "echo.sock")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ECHO_SERVER, self.path], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the echo server did not start")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path)
        body = pb2.LookupRequest(session_id="x" * 32, keys=KEYS).SerializeToString()
        self.request = struct.pack("<IB", len(body) + 1, 1) + body

    def call(self) -> None:
        self.sock.sendall(self.request)
        header = self.sock.recv(5)
        length = struct.unpack_from("<I", header)[0]
        body = b""
        while len(body) < length - 1:
            body += self.sock.recv(length - 1 - len(body))
        pb2.LookupResponse.FromString(body)

    def close(self) -> None:
        self.sock.close()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(10)


def _measure(call, server_pid: int, calls: int) -> tuple[list[float], float, float]:  # noqa: ANN001
    """Per-call seconds, and the server's and this process's CPU seconds per call."""
    samples = []
    server_before, client_before = cpu_seconds(server_pid), time.process_time()
    for _ in range(calls):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    server = (cpu_seconds(server_pid) - server_before) / calls
    client = (time.process_time() - client_before) / calls
    return samples, server, client


def run() -> list[Row]:
    echo = EchoServer()
    try:
        with BenchDaemon("--memory-budget", "256MiB") as daemon:
            lane_client = Client(daemon.address)
            grpc_client = Client(daemon.address, fast_lane=False)
            lane = lane_client.open_session(POOL, block_bytes=4096)
            grpc_session = grpc_client.open_session(POOL, block_bytes=4096)
            if not lane.fast_lane:
                raise RuntimeError("the daemon offered no fast lane")
            ways = {
                "echo floor": (echo.call, echo.proc.pid),
                "fast lane": (lambda: lane.lookup(KEYS), daemon.proc.pid),
                "gRPC": (lambda: grpc_session.lookup(KEYS), daemon.proc.pid),
            }
            results: dict[str, tuple[list[float], list[float], list[float]]] = {
                name: ([], [], []) for name in ways
            }
            for call, _pid in ways.values():
                for _ in range(WARMUP):
                    call()
            for _ in range(ROUNDS):
                for name, (call, pid) in ways.items():
                    samples, server, client = _measure(call, pid, CALLS_PER_ROUND)
                    results[name][0].extend(samples)
                    results[name][1].append(server)
                    results[name][2].append(client)
            lane.close()
            grpc_session.close()
            lane_client.close()
            grpc_client.close()
    finally:
        echo.close()
    return _rows(results)


def _rows(results: dict[str, tuple[list[float], list[float], list[float]]]) -> list[Row]:
    p50 = {name: percentile(samples, 0.5) * 1e6 for name, (samples, _, _) in results.items()}
    p99 = {name: percentile(samples, 0.99) * 1e6 for name, (samples, _, _) in results.items()}
    server = {name: sorted(cpu)[len(cpu) // 2] * 1e6 for name, (_, cpu, _) in results.items()}
    client = {name: sorted(cpu)[len(cpu) // 2] * 1e6 for name, (_, _, cpu) in results.items()}
    group = "fast lane: Lookup(32 keys)"
    rows = []
    for name in results:
        floor = name != "echo floor"
        rows.append(Row(group, f"{name} p50", p50[name], "µs",
                        "echo p50" if floor else "",
                        p50[name] / p50["echo floor"] if floor else None,
                        "<= 3x echo" if name == "fast lane" else ""))  # fmt: skip
        rows.append(Row(group, f"{name} p99", p99[name], "µs"))
        rows.append(Row(group, f"{name} server CPU per call", server[name], "µs",
                        "echo server" if floor else "",
                        server[name] / server["echo floor"] if floor else None,
                        "<= 4x echo" if name == "fast lane" else ""))  # fmt: skip
        rows.append(Row(group, f"{name} client CPU per call", client[name], "µs"))
    return rows
