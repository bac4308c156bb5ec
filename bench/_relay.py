"""A TCP relay that delays every byte by half a round trip in each direction: a network link's latency on
loopback, for benches. One process relays many listening addresses, each to its own target.

    python bench/_relay.py --rtt-ms 5 127.0.0.2:40001=127.0.0.1:40001 127.0.0.2:40002=127.0.0.1:40002

It prints "ready" once every address listens, and runs until stdin closes; then it prints, as one JSON
object, the bytes it carried through each listening address (both directions) and how late it wrote chunks,
so that a bench can show that every connection of a call crossed it and what delay it really added.

A chunk read at time t is written on at t + rtt/2, in order: the link keeps its bandwidth (nothing waits
behind a chunk in flight) and adds only latency, as a long fast link does; a reply crosses the relay again,
so a call and its answer see the whole round trip. Each direction of a connection is a reading thread and a
writing thread that sleeps until a chunk is due: the sleep is the kernel's high-resolution one (an event
loop's epoll timers round up to whole milliseconds, and spinning instead would take CPU from the processes
under test, which share this machine's cores).

A node on 127.0.0.1 reached through a relay on 127.0.0.2 at the same port numbers keeps announcing its own
ports (Info's stream_port): a client connecting to 127.0.0.2 finds the compute stream on that host at the
announced port, which is the relay's, so both the gRPC channel and the compute stream cross the delay.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence

CHUNK = 1 << 16


class _Tally:
    """Bytes carried per listening address, and how late chunks were written (thread-safe)."""

    def __init__(self, listens: Sequence[str]) -> None:
        self.carried = dict.fromkeys(listens, 0)
        self.late_sum = self.late_max = 0.0
        self.chunks = 0
        self.lock = threading.Lock()

    def add(self, listen: str, n: int) -> None:
        with self.lock:
            self.carried[listen] += n

    def late(self, seconds: float) -> None:
        with self.lock:
            self.chunks += 1
            self.late_sum += seconds
            self.late_max = max(self.late_max, seconds)

    def report(self) -> dict[str, object]:
        with self.lock:
            mean = self.late_sum / self.chunks if self.chunks else 0.0
            return {"carried": dict(self.carried), "late_ms": [mean * 1e3, self.late_max * 1e3]}


def _pipe(src: socket.socket, dst: socket.socket, delay: float, tally: _Tally, listen: str) -> None:
    """Copy src to dst, each chunk written `delay` s after it was read, in order; then half-close dst."""
    chunks: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()

    def send() -> None:
        while True:
            due, data = chunks.get()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            if not data:
                break
            tally.late(time.monotonic() - due)
            try:
                dst.sendall(data)
            except OSError:
                break
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        while data := src.recv(CHUNK):
            tally.add(listen, len(data))
            chunks.put((time.monotonic() + delay, data))
    except OSError:
        pass
    finally:
        chunks.put((time.monotonic() + delay, b""))
        sender.join()


def _connection(
    client: socket.socket, target: tuple[str, int], delay: float, tally: _Tally, listen: str
) -> None:
    try:
        upstream = socket.create_connection(target)
    except OSError:
        client.close()
        return
    for s in (client, upstream):
        with contextlib.suppress(OSError):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    back = threading.Thread(target=_pipe, args=(upstream, client, delay, tally, listen), daemon=True)
    back.start()
    _pipe(client, upstream, delay, tally, listen)
    back.join()
    client.close()
    upstream.close()


def _address(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


def _serve(
    listener: socket.socket, target: tuple[str, int], delay: float, tally: _Tally, listen: str
) -> None:
    while True:
        try:
            client, _ = listener.accept()
        except OSError:  # closed: the relay is stopping
            return
        threading.Thread(target=_connection, args=(client, target, delay, tally, listen), daemon=True).start()


def serve(pairs: list[tuple[str, str]], rtt_ms: float) -> None:
    """Relay until stdin closes, then print what was carried."""
    delay = rtt_ms / 2000.0
    tally = _Tally([listen for listen, _ in pairs])
    listeners = []
    for listen, target in pairs:
        listener = socket.create_server(_address(listen))
        listeners.append(listener)
        args = (listener, _address(target), delay, tally, listen)
        threading.Thread(target=_serve, args=args, daemon=True).start()
    print("ready", flush=True)
    sys.stdin.read()  # until whoever started the relay closes its stdin (or goes away)
    for listener in listeners:
        listener.close()
    print(json.dumps(tally.report()), flush=True)


@contextlib.contextmanager
def relay(
    pairs: Sequence[tuple[str, str]], rtt_ms: float, prefix: Sequence[str] = ()
) -> Iterator[dict[str, object]]:
    """A relay process for (listen, target) pairs while the block runs; the dict it yields gets, once the
    block is done, "carried" (bytes through each listening address) and "late_ms" (mean and largest delay
    past the set one of a chunk), or nothing if the relay did not say. `prefix`: what runs it (a rig device's
    join, so that other work on the machine does not make it late)."""
    cmd = [*prefix, sys.executable, __file__, "--rtt-ms", str(rtt_ms), *(f"{a}={b}" for a, b in pairs)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    said: dict[str, object] = {}
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"the relay did not start (exit code {proc.poll()})")
        yield said
    finally:
        try:
            # closing its stdin stops the relay, which then says what it carried
            out, _ = proc.communicate(timeout=10)
            with contextlib.suppress(ValueError, IndexError):
                said.update(json.loads(out.strip().splitlines()[-1]))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def measured_rtt_ms(rtt_ms: float, host: str = "127.0.0.2", pings: int = 50) -> float:
    """The median round trip of a 1-byte ping through a relay set to `rtt_ms` (to an echo server here)."""
    echo = socket.create_server(("127.0.0.1", 0))
    port = echo.getsockname()[1]

    def answer() -> None:
        conn, _ = echo.accept()
        with conn:
            while data := conn.recv(64):
                conn.sendall(data)

    threading.Thread(target=answer, daemon=True).start()
    with relay([(f"{host}:{port}", f"127.0.0.1:{port}")], rtt_ms):
        with socket.create_connection((host, port)) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            times = []
            for _ in range(pings):
                t0 = time.perf_counter()
                s.sendall(b"x")
                s.recv(64)
                times.append(time.perf_counter() - t0)
    echo.close()
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="a TCP relay adding a round trip's latency")
    p.add_argument("--rtt-ms", type=float, required=True, help="round-trip time to add, in milliseconds")
    p.add_argument("pairs", nargs="+", metavar="LISTEN=TARGET", help="host:port=host:port")
    args = p.parse_args(argv)
    pairs = []
    for pair in args.pairs:
        listen, sep, target = pair.partition("=")
        if not sep:
            p.error(f"{pair!r}: give LISTEN=TARGET, e.g. 127.0.0.2:4000=127.0.0.1:4000")
        pairs.append((listen, target))
    serve(pairs, args.rtt_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
