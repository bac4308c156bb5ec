"""Where the processes a bench starts listen: the loopback address, a free port on it, waiting for a listener."""

from __future__ import annotations

import socket
import time

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def wait_port(endpoint: str, timeout: float) -> None:
    host, port = endpoint.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rpc-server at {endpoint} not listening after {timeout} s") from None
            time.sleep(0.1)
