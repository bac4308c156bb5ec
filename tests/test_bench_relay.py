"""bench/_relay.py, the delaying TCP relay the network benches put in front of nodes: it adds the round trip
it is set to, and says how many bytes crossed each of its addresses (how a bench shows that every
connection of a call went through it)."""

from __future__ import annotations

import importlib.util
import socket
import threading
import time
from pathlib import Path
from types import ModuleType

RELAY_PATH = Path(__file__).resolve().parent.parent / "bench" / "_relay.py"


def _relay_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_relay", RELAY_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _echo_server() -> tuple[socket.socket, int]:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(1 << 16):
                    conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return server, server.getsockname()[1]


def _round_trips(port: int, n: int) -> list[float]:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            s.sendall(b"x")
            assert s.recv(64) == b"x"
            times.append(time.perf_counter() - t0)
    return times


def test_the_relay_adds_its_round_trip_and_counts_the_bytes_of_every_address() -> None:
    relay = _relay_module().relay
    server, port = _echo_server()
    listen, idle = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
    relay_port, idle_port = listen.getsockname()[1], idle.getsockname()[1]
    listen.close()  # free ports for the relay to take
    idle.close()
    try:
        pairs = [
            (f"127.0.0.1:{relay_port}", f"127.0.0.1:{port}"),
            (f"127.0.0.1:{idle_port}", f"127.0.0.1:{port}"),
        ]
        with relay(pairs, 6.0) as said:
            times = sorted(_round_trips(relay_port, 10))
        assert 0.0055 < times[len(times) // 2] < 0.05, times  # the median: the set 6 ms, and not much more
        assert said["carried"] == {f"127.0.0.1:{relay_port}": 20, f"127.0.0.1:{idle_port}": 0}
        mean_late, largest_late = said["late_ms"]
        assert 0 <= mean_late <= largest_late
    finally:
        server.close()
