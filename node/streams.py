"""The compute stream, both ends: Compute calls as frames (swarm.proto.frames) on kept TCP connections.

A decode step makes one Compute call per node and MoE layer, so what a call costs beside its compute is paid
hundreds of times a second. Over gRPC from Python that is ~1 ms of CPU per call between the two ends; on a
kept connection a third of that (bench/transport.py; prompt-sized calls, a megabyte each way, cost the same
on both: there copying the rows is the cost). The node serves both: the ExpertNode service over gRPC (Info, Stats,
Fetch, health, and Compute for any client) and this stream on a port of its own, which it announces
(InfoReply.stream_port, the mDNS record). What crosses it is what a gRPC Compute call carries: the same
ComputeRequest / ComputeReply bytes, the same swarm-auth tag over them (one tag is good for one call on either
transport), the same checks and status codes, TLS with the swarm key's identity off loopback.

Node side: `StreamServer`, a thread per connection (one call at a time on each; a client opens as many
connections as it wants calls in flight). Client side: `StreamPool`, up to `size` connections to one node,
each with its own thread that sends a call, reads its answer and resolves the call's future; a call whose node
does not answer by its deadline ends DEADLINE_EXCEEDED and its connection is dropped. A small call on an open
connection is sent by the caller's thread, and its answer is read there too when the caller comes to wait for
it (`StreamCall.read_here`): a decode step then wakes no thread of ours per call, only the node. A caller that
does not wait for it alone hands the reading to the connection's thread (`StreamCall.let_go`). When the stream cannot be
reached at all (a firewall that lets only the gRPC port through), its calls go over gRPC (`fallback`) for a while
before it tries the stream again, and the pool says so once gRPC answers (when neither answers, the node is
down, and its callers' failover says so).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import socket
import ssl
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import grpc

from swarm.node.auth import TLS_NAME, SwarmKey, Verifier
from swarm.node.errors import NodeCallError
from swarm.proto import expert_pb2 as pb
from swarm.proto.frames import (
    COMPUTE_METHOD,
    FrameError,
    read_call,
    read_reply,
    send_call,
    send_reply,
)

log = logging.getLogger(__name__)

# Connections a node serves at once (a thread each); one more is closed at once, and its client falls back.
MAX_CONNECTIONS = 256
# How long a new connection may take to connect and finish its TLS handshake.
CONNECT_SECONDS = 5.0
# A connection that brings no frame, or none of the rest of one, for this long is closed (as is one that
# takes no reply for this long): a peer that opens connections and sends nothing must not hold the node's
# MAX_CONNECTIONS. A coordinator's kept connection that was idle comes back on its next call, made once
# more on a new connection (KEPT_CONNECTION_CLOSED).
IDLE_SECONDS = 300.0
# After the stream could not be reached, calls go over gRPC for this long before the stream is tried again.
RETRY_STREAM_SECONDS = 30.0
# A call this small on a connection already open is sent by the caller's own thread (it fits the socket's
# buffer: the send does not wait on the network), and its answer is read by the caller when it waits for it
# (or by the connection's thread when the caller lets it go). A decode step's calls are a few to a few tens of
# kilobytes: that saves two thread hand-offs per call (the reader's wake-up, and its wake-up of the caller).
INLINE_SEND_BYTES = 64 << 10

Answer = Callable[[bytes], tuple[grpc.StatusCode, bytes]]
NO_ANSWER = "no answer before the deadline"
# How a kept connection looks when the node closed it while it was idle: a call that finds it so is made once
# more, on a new connection.
KEPT_CONNECTION_CLOSED = (EOFError, BrokenPipeError, ConnectionResetError)


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


def _readable(sock: socket.socket, timeout: float | None) -> bool:
    """Whether sock has bytes to read within `timeout` s (None: until it has). poll, not select: select takes
    no descriptor past 1,023, and a process that maps a thousand slab files has its sockets beyond that."""
    p = select.poll()
    p.register(sock, select.POLLIN)
    return bool(p.poll(None if timeout is None else math.ceil(timeout * 1000)))


def _nodelay(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# ---------------------------------------------------------------------------------------------------
# Node side


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
            _nodelay(conn)
            if self.tls is not None:
                conn.settimeout(CONNECT_SECONDS)
                sock = self.tls.wrap_socket(conn, server_side=True)
            sock.settimeout(self.idle_seconds)
            while True:
                token, body = read_call(sock)
                refused = self.verifier.check(COMPUTE_METHOD, token or None, body) if self.verifier else ""
                code, payload = (
                    (grpc.StatusCode.UNAUTHENTICATED, refused.encode()) if refused else self.answer(body)
                )
                send_reply(sock, code, payload)
        except EOFError:
            pass  # the client closed between calls
        except (FrameError, OSError) as e:  # ssl.SSLError is an OSError
            log.debug("compute stream connection ended: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            sock.close()


# ---------------------------------------------------------------------------------------------------
# Client side


class _Job:
    __slots__ = ("body", "future", "deadline", "sent")

    def __init__(self, body: bytes, future: Future[pb.ComputeReply], deadline: float | None) -> None:
        self.body, self.future, self.deadline = body, future, deadline
        self.sent = False  # already on the connection's socket (sent by the caller's thread)

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())


class _Unreachable(OSError):
    """A new connection to the stream could not be made."""


class StreamPool:
    """Compute calls to one node's stream at host:port; `sign(body)` gives a call's swarm-auth token ("" for
    none), `fallback(body, token, timeout)` makes the same call over gRPC (used while the stream is unreachable; it
    raises NodeCallError).
    `address` names the node in errors."""

    def __init__(
        self,
        address: str,
        host: str,
        port: int,
        sign: Callable[[bytes], str],
        fallback: Callable[[bytes, str, float | None], pb.ComputeReply],
        tls: ssl.SSLContext | None = None,
        size: int = 8,
    ) -> None:
        self.address, self.host, self.port = address, host.strip("[]"), port
        self.sign, self.fallback, self.tls, self.size = sign, fallback, tls, size
        self._lock = threading.Lock()
        self._idle: list[_Conn] = []
        self._conns: list[_Conn] = []
        self._queue: deque[_Job] = deque()
        self._closed = False
        self._unreachable_until = 0.0
        self._unreachable_why: str | None = None  # said once gRPC answers (else the node itself is down)

    def submit(self, body: bytes, timeout: float | None) -> StreamCall:
        """Start one call; its future ends with the ComputeReply or a NodeCallError."""
        future: Future[pb.ComputeReply] = Future()
        future.set_running_or_notify_cancel()
        job = _Job(body, future, None if timeout is None else time.monotonic() + timeout)
        with self._lock:
            if self._closed:
                raise RuntimeError("the client is closed")
            if self._idle:
                conn = self._idle.pop()
            elif len(self._conns) < self.size:
                conn = _Conn(self)
                self._conns.append(conn)
            else:
                self._queue.append(job)  # the next connection to finish takes it
                return StreamCall(job, None)
        return StreamCall(job, conn if conn.give(job) else None)

    def _next(self, conn: _Conn) -> _Job | None:
        """A connection finished its call: its next job, or None (it goes idle; or it is closed)."""
        with self._lock:
            if self._queue and not self._closed:
                return self._queue.popleft()
            if self._closed:
                return None
            self._idle.append(conn)
            return None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._conns, self._idle = self._conns, [], []
            queued, self._queue = list(self._queue), deque()
        for job in queued:
            job.future.set_exception(_error(self.address, grpc.StatusCode.CANCELLED, "the client was closed"))
        for conn in conns:
            conn.stop()

    def _connect(self, job: _Job) -> socket.socket:
        if time.monotonic() < self._unreachable_until:
            raise _Unreachable("unreachable a moment ago")
        limit = job.remaining()
        limit = CONNECT_SECONDS if limit is None else min(CONNECT_SECONDS, max(limit, 0.05))
        try:
            sock = socket.create_connection((self.host, self.port), timeout=limit)
            _nodelay(sock)
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_hostname=TLS_NAME)
        except OSError as e:
            self._unreachable_until = time.monotonic() + RETRY_STREAM_SECONDS
            self._unreachable_why = str(e)
            raise _Unreachable(str(e)) from e
        return sock

    def _over_grpc(self, job: _Job) -> None:
        try:
            job.future.set_result(self.fallback(job.body, self.sign(job.body), job.remaining()))
        except NodeCallError as e:
            job.future.set_exception(e)  # the node is down, not just its stream: the caller says so
            return
        why, self._unreachable_why = self._unreachable_why, None
        if why is not None:  # the node answers over gRPC: only its stream's port is out of reach
            log.warning(
                "node %s: its compute stream (port %d) cannot be reached (%s); its calls go over gRPC for the next "
                "%.0f s (if only that port is blocked, open it beside the node's gRPC port, or start the node with "
                "--no-stream)",
                self.address,
                self.port,
                why,
                RETRY_STREAM_SECONDS,
            )


def _error(address: str, code: grpc.StatusCode, details: str) -> NodeCallError:
    return NodeCallError(address, "Compute", code, details)


class StreamCall:
    """One call submitted to a StreamPool: its `future`, and where the caller may read the answer itself."""

    __slots__ = ("future", "_job", "_conn")

    def __init__(self, job: _Job, conn: _Conn | None) -> None:
        self.future, self._job, self._conn = job.future, job, conn

    def read_here(self, timeout: float | None = None) -> None:
        """Read the answer on this thread if it is the caller's to read (it was sent from the caller's thread
        and not let go), waiting up to `timeout` s for it (None: until the call's deadline). An answer that
        has not come by then stays the caller's to read later (or to let go)."""
        if self._conn is not None and self._conn.read_here(self._job, timeout):
            self._conn = None

    def let_go(self) -> None:
        """Leave the answer to the connection's thread (a caller that waits on several calls at once, or on
        none)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.let_go(self._job)


class _Conn:
    """One kept connection and the thread that runs its calls, one at a time."""

    def __init__(self, pool: StreamPool) -> None:
        self.pool = pool
        self.sock: socket.socket | None = None
        self._job: _Job | None = None
        self._go = threading.Semaphore(0)
        self._stopped = False
        self._lock = threading.Lock()
        self._callers: _Job | None = None  # sent from the caller's thread; its answer is the caller's to read
        threading.Thread(target=self._run, name=f"swarm-stream-{pool.address}", daemon=True).start()

    def give(self, job: _Job) -> bool:
        """Run `job` on this (idle) connection: a small one is sent from the caller's thread at once, and
        then (True) its answer is the caller's to read (`read_here`) until it lets go of it (`let_go`)."""
        if self.sock is not None and len(job.body) <= INLINE_SEND_BYTES:
            try:
                self._send(job)
                job.sent = True
            except OSError:
                self._drop()  # the connection's thread sends it on a new connection
        if job.sent:
            with self._lock:
                if not self._stopped:
                    self._callers = job
                    return True
        self._hand_over(job)
        return False

    def _hand_over(self, job: _Job) -> None:
        """The connection's thread runs `job` (sends it if it is not sent, reads its answer)."""
        self._job = job
        self._go.release()

    def _fail(self, job: _Job, code: grpc.StatusCode, details: str) -> None:
        job.future.set_exception(_error(self.pool.address, code, details))

    def _claim(self, job: _Job) -> bool:
        with self._lock:
            if self._callers is not job:
                return False
            self._callers = None
            return True

    def let_go(self, job: _Job) -> None:
        if self._claim(job):
            self._hand_over(job)

    def read_here(self, job: _Job, timeout: float | None) -> bool:
        """`job`'s answer, read on the calling thread (see StreamCall.read_here); whether the caller is done
        with the job here (False: no answer within `timeout`, it is still the caller's to read)."""
        with self._lock:
            if self._callers is not job:
                return True
        sock = self.sock
        left = job.remaining()
        wait = left if timeout is None else timeout if left is None else min(timeout, left)
        try:
            ready = sock is not None and (
                (isinstance(sock, ssl.SSLSocket) and sock.pending() > 0) or _readable(sock, wait)
            )
        except (OSError, ValueError):  # closed under us (the pool is closing): the thread's path ends it
            self.let_go(job)
            return True
        if not ready and (job.deadline is None or time.monotonic() < job.deadline):
            return False  # the caller waits again, or lets go
        if not self._claim(job):
            return True
        try:
            if not ready:
                raise TimeoutError
            assert sock is not None
            sock.settimeout(None if left is None else max(left, 1e-3))
            code, payload = read_reply(sock)
        except TimeoutError:
            self._drop()
            self._fail(job, grpc.StatusCode.DEADLINE_EXCEEDED, NO_ANSWER)
        except (EOFError, OSError) as e:  # FrameError and ssl errors are OSErrors
            self._drop()
            if isinstance(e, KEPT_CONNECTION_CLOSED):
                job.sent = False  # the connection's thread makes the call once more, on a new connection
                self._hand_over(job)
                return True
            self._fail(job, grpc.StatusCode.UNAVAILABLE, f"compute stream connection lost ({e})")
        else:
            self._resolve(job, code, payload)
        follow = self.pool._next(self)
        if follow is not None:
            self._hand_over(follow)
        return True

    def _send(self, job: _Job) -> None:
        assert self.sock is not None
        left = job.remaining()
        self.sock.settimeout(None if left is None else max(left, 1e-3))
        send_call(self.sock, self.pool.sign(job.body), job.body)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            job, self._callers = self._callers, None
        self._drop()
        if job is not None:
            self._fail(job, grpc.StatusCode.CANCELLED, "the client was closed")
        self._go.release()

    def _drop(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _run(self) -> None:
        while True:
            self._go.acquire()
            job, self._job = self._job, None
            if job is None or self._stopped:
                if job is not None:
                    self._fail(job, grpc.StatusCode.CANCELLED, "closed")
                return
            while job is not None:
                self._call(job)
                job = self.pool._next(self)
                if self._stopped:
                    return

    def _call(self, job: _Job) -> None:
        pool = self.pool
        for attempt in (1, 2):
            reused = self.sock is not None
            try:
                if self.sock is None:
                    self.sock = pool._connect(job)
                if not job.sent:
                    self._send(job)
                job.sent = False  # a second attempt sends it again, on a new connection
                code, payload = read_reply(self.sock)
            except _Unreachable:
                pool._over_grpc(job)
                return
            except TimeoutError:
                self._drop()  # its answer may still come: the connection is out of step
                self._fail(job, grpc.StatusCode.DEADLINE_EXCEEDED, NO_ANSWER)
                return
            except (EOFError, OSError) as e:  # FrameError and ssl errors are OSErrors
                self._drop()
                if self._stopped:
                    self._fail(job, grpc.StatusCode.CANCELLED, "the client was closed")
                    return
                if reused and attempt == 1 and isinstance(e, KEPT_CONNECTION_CLOSED):
                    continue  # once more, on a new connection
                self._fail(job, grpc.StatusCode.UNAVAILABLE, f"compute stream connection lost ({e})")
                return
            self._resolve(job, code, payload)
            return

    def _resolve(self, job: _Job, code: grpc.StatusCode, payload: bytearray) -> None:
        if code == grpc.StatusCode.OK:
            try:
                job.future.set_result(pb.ComputeReply.FromString(payload))
            except Exception as e:  # a reply that does not parse: the node is broken
                self._fail(job, grpc.StatusCode.INTERNAL, f"bad reply ({e})")
        else:
            self._fail(job, code, payload.decode("utf-8", "replace"))
