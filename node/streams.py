"""The compute stream: Compute calls as frames (swarm.proto.frames) on kept TCP connections; its node side.

A decode step makes one Compute call per node and MoE layer, so what a call costs beside its compute is paid
hundreds of times a second, and a gRPC call from Python costs both ends much more CPU than a frame on a kept
connection (bench/transport.py; the figures are in docs/BENCHMARKS.md). Prompt-sized calls, a megabyte each
way, cost the same on both: there copying the rows is the cost. The node serves both: the ExpertNode service over gRPC (Info, Stats, Fetch,
health, and Compute for any client) and this stream on a port of its own, which it announces
(InfoReply.stream_port, the mDNS record). What crosses it is what a gRPC Compute call carries: the same
ComputeRequest / ComputeReply bytes, the same swarm-auth tag over them (one tag is good for one call on either
transport), the same checks and status codes, TLS with the swarm key's identity off loopback.

Node side: `StreamServer` (here), a thread per connection (one call at a time on each; a client opens as many
connections as it wants calls in flight). Client side: `StreamPool` (swarm.node.stream_pool), which
swarm.node.client sends Compute calls through, choosing gRPC instead while the stream cannot be reached.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import grpc

from swarm.node.auth import SwarmKey, Verifier
from swarm.proto.frames import COMPUTE_METHOD, FrameError, read_call, send_reply

log = logging.getLogger(__name__)

# Connections a node serves at once (a thread each); one more is closed at once, and its client falls back.
MAX_CONNECTIONS = 256
# How long a new connection may take to connect and finish its TLS handshake.
CONNECT_SECONDS = 5.0
# A connection that brings no frame, or none of the rest of one, for this long is closed (as is one that
# takes no reply for this long): a peer that opens connections and sends nothing must not hold the node's
# MAX_CONNECTIONS. A coordinator's kept connection that was idle comes back on its next call, made once
# more on a new connection (swarm.node.stream_pool.KEPT_CONNECTION_CLOSED).
IDLE_SECONDS = 300.0

Answer = Callable[[bytes], tuple[grpc.StatusCode, bytes]]


def tls_context(key: SwarmKey, server: bool) -> ssl.SSLContext:
    """TLS with the swarm key's identity, both ways: each end shows the key's certificate and accepts only it
    (what the gRPC channels do: see swarm.node.auth)."""
    key_pem, cert_pem = key.tls_identity
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cadata=cert_pem.decode())
    ctx.verify_mode = ssl.CERT_REQUIRED
    with tempfile.TemporaryDirectory(prefix="swarm-tls-") as tmp:  # ssl reads a certificate chain from files
        chain = Path(tmp) / "identity.pem"
        fd = os.open(chain, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(cert_pem + key_pem)
        ctx.load_cert_chain(chain)
    return ctx


def set_nodelay(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class StreamServer:
    """Serves Compute frames on host:port (0: any free port) with `answer(body) -> (status, payload)`; with a
    verifier every call's tag is checked first (UNAUTHENTICATED otherwise, as on gRPC)."""

    def __init__(
        self,
        host: str,
        port: int,
        answer: Answer,
        verifier: Verifier | None = None,
        tls: ssl.SSLContext | None = None,
        max_connections: int = MAX_CONNECTIONS,
        idle_seconds: float = IDLE_SECONDS,
    ) -> None:
        self.answer, self.verifier, self.tls = answer, verifier, tls
        self.max_connections, self.idle_seconds = max_connections, idle_seconds
        bind_host = host.strip("[]") or "0.0.0.0"
        family, kind, proto, _, where = socket.getaddrinfo(
            bind_host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        self._listener = socket.socket(family, kind, proto)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(where)
        self._listener.listen(64)
        self.port: int = self._listener.getsockname()[1]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._accepter = threading.Thread(target=self._accept, name="swarm-stream-accept", daemon=True)

    def start(self) -> StreamServer:
        self._accepter.start()
        return self

    def stop(self) -> None:
        """Close the port and every connection (a call in flight ends UNAVAILABLE at its client)."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        if self._accepter.is_alive():
            self._accepter.join(timeout=5)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # stopped
            with self._lock:
                if self._closed or len(self._conns) >= self.max_connections:
                    full = not self._closed
                    conn.close()
                    if full:
                        log.warning(
                            "compute stream: %d connections already; refused one", self.max_connections
                        )
                    continue
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="swarm-stream", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        sock = conn
        try:
            set_nodelay(conn)
            if self.tls is not None:
                conn.settimeout(CONNECT_SECONDS)
                sock = self.tls.wrap_socket(conn, server_side=True)
            serve_frames(sock, self.answer, self.verifier, self.idle_seconds)
        except OSError as e:  # ssl.SSLError is an OSError
            log.debug("compute stream connection ended: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            sock.close()


def serve_frames(sock: socket.socket, answer: Answer, verifier: Verifier | None, idle_seconds: float) -> None:
    """Answer Compute frames on one connection until the caller closes it or breaks the framing (the node's
    compute stream, and a joined node's stream connections, swarm.node.join)."""
    sock.settimeout(idle_seconds)
    try:
        while True:
            token, body = read_call(sock)
            refused = verifier.check(COMPUTE_METHOD, token or None, body) if verifier else ""
            code, payload = (grpc.StatusCode.UNAUTHENTICATED, refused.encode()) if refused else answer(body)
            send_reply(sock, code, payload)
    except EOFError:
        pass  # the client closed between calls
    except (FrameError, OSError) as e:  # ssl.SSLError is an OSError
        log.debug("compute stream connection ended: %s", e)
