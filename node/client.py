"""Client side of the ExpertNode service, as the coordinator uses it.

    client = NodeClient("127.0.0.1:50051", fingerprint=fp, key=None, stream_port=info.stream_port)
    call = client.compute_async(layer, expert_ids, counts, rows, timeout=5.0)  # returns at once
    out = call.result()  # [sum(counts), D], rows in the order sent: numpy, or torch for torch rows

`compute_async` returns a ComputeCall at once, so a coordinator can start the calls to every node of a
layer together and then collect them. The client chooses each call's transport, here alone: with the node's
stream port a call travels over its compute stream (swarm.node.streams: frames on kept connections, much less
CPU than gRPC for a decode step's calls); without one, or while no connection to the stream can be made (a
firewall that lets only the gRPC port through), it runs as a blocking unary gRPC call on a small thread pool
of the client's, which costs the caller far less than grpc's own `.future()` (a rendezvous object per call,
woken through the channel's polling thread) at one call per node per layer per decoded token
(bench/transport.py, docs/BENCHMARKS.md). Failures surface as NodeCallError with the grpc status code
(NOT_FOUND, INVALID_ARGUMENT, FAILED_PRECONDITION, RESOURCE_EXHAUSTED, UNAUTHENTICATED, UNAVAILABLE,
DEADLINE_EXCEEDED, ...) and the node's message.
"""

from __future__ import annotations

import logging
import socket
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from concurrent.futures import wait as futures_wait
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from swarm.node.auth import AUTH_METADATA, TLS_NAME, Signer, SwarmKey, is_loopback_host
from swarm.node.errors import NodeCallError, wrap_rpc_error
from swarm.node.replies import FileStream, NodeInfo, NodeStats
from swarm.node.stream_pool import RETRY_STREAM_SECONDS, StreamCall, StreamPool, StreamUnreachable
from swarm.node.streams import tls_context
from swarm.proto import expert_pb2 as pb
from swarm.proto.arrays import is_numpy, to_torch
from swarm.proto.channel import CHANNEL_OPTIONS, PROTOCOL_VERSION, SERVICE_NAME
from swarm.proto.codec import compute_request, decode_array
from swarm.proto.frames import COMPUTE_METHOD
from swarm.proto.numerics import Numerics
from swarm.sharding.errors import UserError

log = logging.getLogger(__name__)


class ComputeCall:
    """One Compute call in flight. `result()` blocks and returns the output rows [N, D] on the CPU: a numpy
    array, or a torch tensor where the rows were sent as one (`torch_rows`).

    `seconds` is the call's round trip once it has ended (None before), for pacing: how long this node
    takes, and so when waiting on it has become suspicious. Over the compute stream, `result` and `wait` read
    the answer on the caller's thread where they can (see swarm.node.streams); `done`, `succeeded`,
    `wait_calls` and dropping the call leave it to the stream's thread.
    """

    def __init__(
        self,
        address: str,
        future: Future[pb.ComputeReply],
        stream: StreamCall | None = None,
        torch_rows: bool = False,
    ) -> None:
        self.address = address
        self._torch = torch_rows
        self._future = future
        self._stream = stream
        self.seconds: float | None = None
        self.answer_bytes = 0  # the answer's bytes as they came (once result() has read them)
        self.inner_bytes = 0  # ... and those of the inner products, where they were asked for
        self._inner: Any = None  # the reply's inner products as sent (pb.Tensor), read by inner_products()
        started = time.perf_counter()
        me = weakref.ref(self)  # the future must not keep the call alive (see __del__)

        def ended(_: Future[pb.ComputeReply]) -> None:
            call = me()
            if call is not None:
                call.seconds = time.perf_counter() - started

        future.add_done_callback(ended)

    def __del__(self) -> None:
        if getattr(self, "_stream", None) is not None:
            self._let_go()  # a call nobody waited for still frees its connection

    def _read_here(self, timeout: float | None) -> float | None:
        """Read the answer here where it is ours to read; what is left of `timeout` to wait for the future
        (the stream's thread may have taken the call over: a connection to make again, an answer late)."""
        if self._stream is None:
            return timeout
        end = None if timeout is None else time.monotonic() + timeout
        self._stream.read_here(timeout)
        return None if end is None else max(0.0, end - time.monotonic())

    def _let_go(self) -> None:
        if self._stream is not None:
            self._stream.let_go()

    def result(self, timeout: float | None = None) -> Any:
        left = self._read_here(timeout)
        try:
            reply = self._future.result(timeout=left)
        except grpc.RpcError as e:
            raise wrap_rpc_error(self.address, "Compute", e) from None
        except CancelledError:
            raise NodeCallError(
                self.address, "Compute", grpc.StatusCode.CANCELLED, "the call was cancelled"
            ) from None
        except FutureTimeoutError:
            raise NodeCallError(
                self.address, "Compute", grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout} s"
            ) from None
        self.answer_bytes = len(reply.rows.data)
        if reply.HasField("inner"):
            self.inner_bytes = len(reply.inner.data)
            self._inner = reply.inner  # (decoded when they are checked: not on the model's way)
        rows = decode_array(reply.rows, "reply rows")
        return to_torch(rows) if self._torch else rows

    @property
    def has_inner(self) -> bool:
        """Whether the answer came with its inner products (once `result()` has read it)."""
        return self._inner is not None

    def inner_products(self) -> np.ndarray:
        """[N, 2F] float32: the gate and up products the answer came with (CodecError when the node sent
        bytes that are not an array)."""
        if self._inner is None:
            raise ValueError("this call's answer came without inner products")
        if not isinstance(self._inner, np.ndarray):
            self._inner = decode_array(self._inner, "reply inner products")
        return self._inner

    def done(self) -> bool:
        self._let_go()
        return self._future.done()

    def succeeded(self) -> bool:
        """Ended with an answer (not an error)."""
        self._let_go()
        return self._future.done() and not self._future.cancelled() and self._future.exception() is None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the call ends or `timeout` s pass; whether it ended."""
        futures_wait([self._future], self._read_here(timeout))
        return self._future.done()


def _cancelled(address: str, why: str) -> NodeCallError:
    return NodeCallError(address, "Compute", grpc.StatusCode.CANCELLED, why)


def _pass_on(done: Future[pb.ComputeReply], to: Future[pb.ComputeReply], address: str) -> None:
    """End `to` as `done` ended (a cancelled `done`: CANCELLED, as ComputeCall.result says it)."""
    if done.cancelled():
        to.set_exception(_cancelled(address, "the call was cancelled"))
    elif (e := done.exception()) is not None:
        to.set_exception(e)
    else:
        to.set_result(done.result())


def wait_calls(calls: Iterable[ComputeCall], timeout: float | None = None) -> None:
    """Block until the first of `calls` ends (or `timeout` s pass)."""
    calls = list(calls)
    for c in calls:
        c._let_go()
    futures_wait([c._future for c in calls], timeout, return_when=FIRST_COMPLETED)


def is_loopback(address: str) -> bool:
    """Whether "host:port" names this machine's loopback (where the wire needs no privacy)."""
    return is_loopback_host(address.rsplit(":", 1)[0])


class NodeClient:
    """A channel to one node (address "host:port"). Thread-safe; reuse one per node.

    With a swarm key every call carries a swarm-auth tag (see swarm.node.auth); `tls` (default: off loopback
    whenever there is a key) makes the channel TLS with the key's identity, as nodes off loopback serve it.
    `max_in_flight` bounds the Compute calls running at once to this node (more wait their turn here).
    With `stream_port` (the node's InfoReply.stream_port or mDNS record; `use_stream` sets it later) Compute
    calls travel over the node's compute stream instead of gRPC (see swarm.node.streams), but for those the
    stream cannot take: while no connection to it can be made, they go over gRPC, and the first answer there
    says that the stream is out of reach (when gRPC does not answer either, the node is down, and its callers'
    failover says so). Every other call is gRPC. `dial` (a joined node's) gives stream connections instead.
    """

    def __init__(
        self,
        address: str,
        fingerprint: str | None = None,
        key: SwarmKey | None = None,
        max_in_flight: int = 8,
        tls: bool | None = None,
        stream_port: int = 0,
        dial: Callable[[float | None], socket.socket] | None = None,
    ) -> None:
        self.address = address
        self.fingerprint = fingerprint or ""
        self._signer = Signer(key) if key is not None else None
        self.tls = (key is not None and not is_loopback(address)) if tls is None else tls
        if self.tls:
            if key is None:
                raise ValueError("a TLS channel needs the swarm key")
            key_pem, cert_pem = key.tls_identity
            creds = grpc.ssl_channel_credentials(
                root_certificates=cert_pem, private_key=key_pem, certificate_chain=cert_pem
            )
            options = (*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", TLS_NAME))
            self._channel = grpc.secure_channel(address, creds, options=options)
        else:
            # a joined node's gRPC crosses its link, which comes back within seconds of a drop: grpc's own
            # reconnect backoff (up to two minutes) would keep Info and Stats failing long after that
            options = (*CHANNEL_OPTIONS, ("grpc.max_reconnect_backoff_ms", 2000)) if dial else CHANNEL_OPTIONS
            self._channel = grpc.insecure_channel(address, options=options)
        self._methods: dict[str, Any] = {}
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._calls = ThreadPoolExecutor(max_in_flight, thread_name_prefix=f"swarm-call-{address}")
        self._key, self._max_in_flight = key, max_in_flight
        self._stream: StreamPool | None = None
        self._stream_down: str | None = None  # why the stream could not be reached, until gRPC answers
        if dial is not None:  # a joined node (swarm.node.join): its stream connections come over its link
            self._stream = StreamPool(
                address, "", 0, self._sign_compute, self._stream_unreachable, None, max_in_flight, dial
            )
        self.use_stream(stream_port)

    def use_stream(self, port: int) -> None:
        """Send Compute calls to the node's compute stream on `port` of its host (0: keep them on gRPC)."""
        if not port or self._stream is not None:
            return
        tls = tls_context(self._key, server=False) if self.tls and self._key is not None else None
        host = self.address.rsplit(":", 1)[0]
        self._stream = StreamPool(
            self.address, host, port, self._sign_compute, self._stream_unreachable, tls, self._max_in_flight
        )

    def _sign_compute(self, body: bytes) -> str:
        return self._signer.token(COMPUTE_METHOD, body) if self._signer else ""

    def _call(
        self, method: str, request: Any, reply: Any, timeout: float | None, stream: bool = False
    ) -> Any:
        """One call (unary, or answered by a stream): the request serialized once, so that the tag covers
        exactly the bytes sent."""
        body = request.SerializeToString()
        token = self._signer.token(f"/{SERVICE_NAME}/{method}", body) if self._signer else ""
        return self._send(method, body, token, reply, timeout, stream)

    def _send(
        self, method: str, body: bytes, token: str, reply: Any, timeout: float | None, stream: bool = False
    ) -> Any:
        path = f"/{SERVICE_NAME}/{method}"
        stub = self._methods.get(path)
        if stub is None:
            make = self._channel.unary_stream if stream else self._channel.unary_unary
            stub = self._methods[path] = make(
                path, request_serializer=None, response_deserializer=reply.FromString
            )
        metadata = ((AUTH_METADATA, token),) if token else None
        return stub(body, timeout=timeout, metadata=metadata)

    def compute_async(
        self,
        layer: int,
        expert_ids: Sequence[int],
        counts: Sequence[int],
        rows: Any,
        timeout: float | None = None,
        out_dtype: object | None = None,
        numerics: Numerics = Numerics.NATIVE,
        inner: bool = False,
    ) -> ComputeCall:
        """Start computing rows [sum(counts), D] (packed expert-major) of `layer`; outputs come in rows' dtype
        unless `out_dtype` says otherwise. `numerics`: native (ggml on the stored quant types) or exact;
        `inner`: the gate and up products come too (ComputeCall.inner_products(), once `result()` has read the answer)."""
        request = compute_request(
            layer,
            expert_ids,
            counts,
            rows,
            self.fingerprint,
            out_dtype,
            protocol_version=PROTOCOL_VERSION,
            numerics=numerics,
            inner=inner,
        )
        as_torch = not is_numpy(rows)
        if self._stream is None:
            future = self._calls.submit(self._call, "Compute", request, pb.ComputeReply, timeout)
            return ComputeCall(self.address, future, torch_rows=as_torch)
        body = request.SerializeToString()
        if self._stream.reachable():
            sent = self._stream.submit(body, timeout)
            return ComputeCall(self.address, sent.future, sent, torch_rows=as_torch)
        future = self._calls.submit(self._instead_of_stream, body, timeout)
        return ComputeCall(self.address, future, torch_rows=as_torch)

    def _stream_unreachable(
        self, body: bytes, future: Future[pb.ComputeReply], timeout: float | None, error: StreamUnreachable
    ) -> None:
        """The stream could not take this call (it was not sent): it goes over gRPC instead, ending `future`."""
        if error.fresh:
            self._stream_down = error.why
        try:
            retry = self._calls.submit(self._instead_of_stream, body, timeout)
        except RuntimeError:  # the client was closed meanwhile
            future.set_exception(_cancelled(self.address, "the client was closed"))
            return
        retry.add_done_callback(lambda answered: _pass_on(answered, future, self.address))

    def _instead_of_stream(self, body: bytes, timeout: float | None) -> pb.ComputeReply:
        """A Compute call over gRPC because the node's compute stream cannot be reached; the first answer after
        a connection to it failed says so, once."""
        try:
            reply = self._send("Compute", body, self._sign_compute(body), pb.ComputeReply, timeout)
        except grpc.RpcError as e:
            raise wrap_rpc_error(self.address, "Compute", e) from None
        why, self._stream_down = self._stream_down, None
        if why is not None and self._stream is not None:
            log.warning(
                "node %s: its compute stream (port %d) cannot be reached (%s); its calls go over gRPC for the next "
                "%.0f s (if only that port is blocked, open it beside the node's gRPC port, or start the node with "
                "--no-stream)",
                self.address, self._stream.port, why, RETRY_STREAM_SECONDS,
            )  # fmt: skip
        return reply

    def compute(
        self,
        layer: int,
        expert_ids: Sequence[int],
        counts: Sequence[int],
        rows: Any,
        timeout: float | None = None,
        out_dtype: object | None = None,
        numerics: Numerics = Numerics.NATIVE,
    ) -> Any:
        return self.compute_async(layer, expert_ids, counts, rows, timeout, out_dtype, numerics).result()

    def fetch(self, path: str, offset: int = 0, timeout: float | None = None) -> FileStream:
        """Stream one file of the node's shard directory from byte `offset` on (see FetchRequest)."""
        request = pb.FetchRequest(
            fingerprint=self.fingerprint, protocol_version=PROTOCOL_VERSION, path=path, offset=offset
        )
        return FileStream(self.address, self._call("Fetch", request, pb.FileChunk, timeout, stream=True))

    def info(self, timeout: float | None = 10.0) -> NodeInfo:
        try:
            r = self._call("Info", pb.InfoRequest(), pb.InfoReply, timeout)
        except grpc.RpcError as e:
            raise wrap_rpc_error(self.address, "Info", e) from None
        return NodeInfo.from_reply(self.address, r)

    def stats(self, timeout: float | None = 10.0) -> NodeStats:
        try:
            r = self._call("Stats", pb.StatsRequest(), pb.StatsReply, timeout)
        except grpc.RpcError as e:
            raise wrap_rpc_error(self.address, "Stats", e) from None
        return NodeStats.from_reply(r)

    def health(self, timeout: float | None = 5.0, service: str = SERVICE_NAME) -> bool:
        """True when the node answers SERVING (no key needed)."""
        try:
            r = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            raise wrap_rpc_error(self.address, "Health.Check", e) from None
        return r.status == health_pb2.HealthCheckResponse.SERVING

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Block until the channel connects (raises NodeCallError UNAVAILABLE after `timeout`)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise NodeCallError(
                self.address, "connect", grpc.StatusCode.UNAVAILABLE, f"no node answered within {timeout} s"
            ) from None

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self._calls.shutdown(wait=False, cancel_futures=True)
        self._channel.close()

    def __enter__(self) -> NodeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ask_peer(address: str, key: SwarmKey | None, timeout: float = 10.0) -> tuple[NodeClient, NodeInfo]:
    """A client of a static peer (--peer) and its Info. A peer that refuses the key is the user's to fix (a
    UserError saying so); one that does not answer raises NodeCallError (its client closed)."""
    client = NodeClient(address, key=key)
    try:
        info = client.info(timeout=timeout)
        client.use_stream(info.stream_port)
        return client, info
    except NodeCallError as e:
        client.close()
        if e.code == grpc.StatusCode.UNAUTHENTICATED:
            raise UserError(
                f"peer {address} refuses this swarm key ({e.details}); give this command the key the nodes "
                "were started with (--key-file, $SWARM_KEY_FILE or $SWARM_KEY)"
            ) from None
        raise
