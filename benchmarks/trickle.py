"""A TCP proxy in front of a Redis node that can trickle its answers (the fleet benchmark's
"trickling node"): once ``slow`` is set, the node's answers reach the client one byte
every :attr:`TrickleProxy.TRICKLE_S`, so the connection stays alive and no socket
timeout fires; cleared, bytes flow as they come."""

from __future__ import annotations

import socket
import threading
import time


class TrickleProxy:
    """Listens on a free loopback port and forwards to ``upstream_port``."""

    TRICKLE_S = 0.2

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.slow = threading.Event()
        self.closed = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                return
            self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, answers: bool) -> None:
        try:
            while not self.closed.is_set():
                data = source.recv(1 << 16)
                if not data:
                    return
                if answers and self.slow.is_set():
                    for i in range(len(data)):
                        sink.sendall(data[i : i + 1])
                        time.sleep(self.TRICKLE_S)
                        if not self.slow.is_set():
                            sink.sendall(data[i + 1 :])
                            break
                else:
                    sink.sendall(data)
        except OSError:
            return

    def close(self) -> None:
        self.closed.set()
        for each in self._sockets:
            each.close()
