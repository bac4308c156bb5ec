"""A TCP proxy on 127.0.0.1 for tests that look at or slow down what crosses the wire."""

from __future__ import annotations

import socket
import threading
import time


class TcpProxy:
    """Forwards 127.0.0.1:port to `target` ("host:port"). `keep`: every byte of both directions in `seen`;
    `rate`: the answers (target to client) passed on at that many bytes/s (None: at once), counted in `sent`."""

    def __init__(self, target: str, keep: bool = False, rate: float | None = None) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.keep = keep
        self.rate = rate
        self.seen = bytearray()
        self.sent = 0
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(self.target)
            except OSError:
                return
            self._sockets += [client, upstream]
            for src, dst, answers in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(target=self._pump, args=(src, dst, answers), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        try:
            while data := src.recv(32768):
                with self._lock:
                    if self.keep:
                        self.seen += data
                    if answers:
                        self.sent += len(data)
                if answers and self.rate:
                    time.sleep(len(data) / self.rate)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        """The link goes down: every connection through the proxy drops at once, bytes in flight with it
        (what the kernel's buffers still held of a killed process's answers never arrives)."""
        for s in self._sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._listener.close()
        self.cut()
        for s in self._sockets:
            s.close()
