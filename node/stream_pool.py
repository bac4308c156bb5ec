"""The compute stream's client side: `StreamPool`, up to `size` kept connections to one node's stream
(swarm.node.streams), each with its own thread that sends a call, reads its answer and resolves the call's
future; a call whose node does not answer by its deadline ends DEADLINE_EXCEEDED and its connection is
dropped. A small call on an open connection is sent by the caller's thread, and its answer is read there too
when the caller comes to wait for it (`StreamCall.read_here`): a decode step then wakes no thread of ours per
call, only the node. A caller that does not wait for it alone hands the reading to the connection's thread
(`StreamCall.let_go`).

When no connection to the stream can be made (a firewall that lets only the gRPC port through), the pool
sends nothing: it reports the call, unsent, to its client's `unreachable`, and is not `reachable` for
RETRY_STREAM_SECONDS. The transport is the client's to choose (swarm.node.client makes those calls over gRPC).
"""

from __future__ import annotations

import contextlib
import math
import select
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import grpc

from swarm.node.auth import TLS_NAME
from swarm.node.errors import NodeCallError
from swarm.node.streams import CONNECT_SECONDS, set_nodelay
from swarm.proto import expert_pb2 as pb
from swarm.proto.frames import read_reply, send_call

# After the stream could not be reached, the pool is not `reachable` for this long (its client uses gRPC).
RETRY_STREAM_SECONDS = 30.0
# A call this small on a connection already open is sent by the caller's own thread (it fits the socket's
# buffer: the send does not wait on the network), and its answer is read by the caller when it waits for it
# (or by the connection's thread when the caller lets it go). A decode step's calls are a few to a few tens of
# kilobytes: that saves two thread hand-offs per call (the reader's wake-up, and its wake-up of the caller).
INLINE_SEND_BYTES = 64 << 10

NO_ANSWER = "no answer before the deadline"
# How a kept connection looks when the node closed it while it was idle: a call that finds it so is made once
# more, on a new connection.
KEPT_CONNECTION_CLOSED = (EOFError, BrokenPipeError, ConnectionResetError)


def _readable(sock: socket.socket, timeout: float | None) -> bool:
    """Whether sock has bytes to read within `timeout` s (None: until it has). poll, not select: select takes
    no descriptor past 1,023, and a process that maps a thousand slab files has its sockets beyond that."""
    p = select.poll()
    p.register(sock, select.POLLIN)
    return bool(p.poll(None if timeout is None else math.ceil(timeout * 1000)))


class _Job:
    __slots__ = ("body", "future", "deadline", "sent")

    def __init__(self, body: bytes, future: Future[pb.ComputeReply], deadline: float | None) -> None:
        self.body, self.future, self.deadline = body, future, deadline
        self.sent = False  # already on the connection's socket (sent by the caller's thread)

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())


class StreamUnreachable(Exception):
    """No connection to the node's compute stream could be made, so a call was not sent. `why`: what the
    connection attempt met; `fresh`: a connection was tried for this call (else the stream was found
    unreachable a moment ago)."""

    def __init__(self, why: str, fresh: bool) -> None:
        super().__init__(why)
        self.why, self.fresh = why, fresh


# What a pool reports a call the stream could not take to: its body, its future (to end), what is left of its
# timeout, and why.
Unreachable = Callable[[bytes, Future[pb.ComputeReply], float | None, StreamUnreachable], None]


class StreamPool:
    """Compute calls to one node's stream at host:port; `sign(body)` gives a call's swarm-auth token ("" for
    none); a call the stream cannot take goes, unsent, to `unreachable` (see Unreachable), which ends its
    future. `address` names the node in errors."""

    def __init__(
        self,
        address: str,
        host: str,
        port: int,
        sign: Callable[[bytes], str],
        unreachable: Unreachable,
        tls: ssl.SSLContext | None = None,
        size: int = 8,
        dial: Callable[[float | None], socket.socket] | None = None,
    ) -> None:
        self.address, self.host, self.port = address, host.strip("[]"), port
        self.dial = dial  # a joined node's connections, asked of it (its stream has no port to reach)
        self.sign, self.unreachable, self.tls, self.size = sign, unreachable, tls, size
        self._lock = threading.Lock()
        self._idle: list[_Conn] = []
        self._conns: list[_Conn] = []
        self._queue: deque[_Job] = deque()
        self._closed = False
        self._unreachable_until = 0.0

    def reachable(self) -> bool:
        """Whether calls may go to the stream: no connection to it failed in the last RETRY_STREAM_SECONDS."""
        return time.monotonic() >= self._unreachable_until

    def submit(self, body: bytes, timeout: float | None) -> StreamCall:
        """Start one call; its future ends with the ComputeReply or a NodeCallError (or as `unreachable`
        ends it)."""
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
            raise StreamUnreachable("unreachable a moment ago", fresh=False)
        limit = job.remaining()
        limit = CONNECT_SECONDS if limit is None else min(CONNECT_SECONDS, max(limit, 0.05))
        if self.dial is not None:
            # no gRPC to fall back to that would fare better: a failure is the call's, which fails over
            sock = self.dial(limit)
            sock.settimeout(None)
            return sock
        try:
            sock = socket.create_connection((self.host, self.port), timeout=limit)
            set_nodelay(sock)
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_hostname=TLS_NAME)
        except OSError as e:
            self._unreachable_until = time.monotonic() + RETRY_STREAM_SECONDS
            raise StreamUnreachable(str(e), fresh=True) from e
        return sock


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
            except StreamUnreachable as e:
                pool.unreachable(job.body, job.future, job.remaining(), e)
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
