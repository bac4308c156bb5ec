"""Client side of the ExpertNode service, as the coordinator uses it.

    client = NodeClient("127.0.0.1:50051", fingerprint=fp, key=None, stream_port=info.stream_port)
    call = client.compute_async(layer, expert_ids, counts, rows, timeout=5.0)  # returns at once
    out = call.result()  # [sum(counts), D] torch tensor, rows in the order sent

`compute_async` returns a ComputeCall at once, so a coordinator can start the calls to every node of a
layer together and then collect them. With the node's stream port a call travels over its compute stream
(swarm.node.streams: frames on kept connections, a third of a gRPC call's CPU for a decode step's calls);
without one it runs as a
blocking unary gRPC call on a small thread pool of the client's: measured on loopback, that costs the caller
~10 us per call where grpc's own `.future()` costs ~300 us (a rendezvous object per call, woken through the
channel's polling thread), which adds up at one call per node per layer per decoded token. Failures surface as NodeCallError with the
grpc status code (NOT_FOUND, INVALID_ARGUMENT, FAILED_PRECONDITION, RESOURCE_EXHAUSTED,
UNAUTHENTICATED, UNAVAILABLE, DEADLINE_EXCEEDED, ...) and the node's message.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from swarm.node.auth import AUTH_METADATA, TLS_NAME, Signer, SwarmKey, is_loopback_host
from swarm.node.errors import NodeCallError, wrap_rpc_error
from swarm.node.streams import StreamCall, StreamPool, tls_context
from swarm.proto import expert_pb2 as pb
from swarm.proto.channel import CHANNEL_OPTIONS, PROTOCOL_VERSION, SERVICE_NAME
from swarm.proto.codec import SlabKey, compute_request, decode_tensor, held_from_proto
from swarm.proto.frames import COMPUTE_METHOD
from swarm.sharding.errors import UserError
from swarm.sharding.identity import ModelIdentity


@dataclass(frozen=True)
class NodeInfo:
    address: str
    fingerprint: str
    protocol_version: int
    held: frozenset[SlabKey]
    device: str
    memory_budget_bytes: int
    max_message_bytes: int
    workers: int
    hidden_size: int
    name: str
    version: str
    source_sha256: str = ""  # the source GGUF's header hash; "" from an older node
    serves_files: bool = False  # gives out manifest.json and its held slabs' files (Fetch)
    stream_port: int = 0  # its compute stream's port (swarm.node.streams); 0: none
    numerics_class: str = ""  # its ggml build's class (swarm.compute.numclass); "" from an older node

    @property
    def identity(self) -> ModelIdentity:
        return ModelIdentity(self.fingerprint, self.source_sha256)


@dataclass(frozen=True)
class NodeStats:
    calls: int
    rows: int
    errors: int
    experts: dict[SlabKey, tuple[int, int]]  # (layer, expert) -> (calls, rows)
    cache_hits: int
    cache_misses: int
    cache_evictions: int
    cache_bytes: int
    busy_seconds: float
    uptime_seconds: float
    in_flight: int
    dropped: frozenset[SlabKey] = frozenset()  # slabs it stopped serving: their files failed its check


class FileStream:
    """One Fetch call: iterate for (offset, bytes, file size) pieces; `cancel()` ends it from another thread.
    A failure surfaces as NodeCallError while iterating."""

    def __init__(self, address: str, call: Any) -> None:
        self.address = address
        self._call = call

    def __iter__(self) -> Iterator[tuple[int, bytes, int]]:
        try:
            for chunk in self._call:
                yield chunk.offset, chunk.data, chunk.size
        except grpc.RpcError as e:
            raise wrap_rpc_error(self.address, "Fetch", e) from None

    def cancel(self) -> None:
        self._call.cancel()


class ComputeCall:
    """One Compute call in flight. `result()` blocks and returns the output rows [N, D] on the CPU.

    `seconds` is the call's round trip once it has ended (None before), for pacing: how long this node
    takes, and so when waiting on it has become suspicious. Over the compute stream, `result` and `wait` read
    the answer on the caller's thread where they can (see swarm.node.streams); `done`, `succeeded`,
    `wait_calls` and dropping the call leave it to the stream's thread.
    """

    def __init__(
        self, address: str, future: Future[pb.ComputeReply], stream: StreamCall | None = None
    ) -> None:
        self.address = address
        self._future = future
        self._stream = stream
        self.seconds: float | None = None
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

    def result(self, timeout: float | None = None) -> torch.Tensor:
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
        return decode_tensor(reply.rows, "reply rows")

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
    calls travel over the node's compute stream instead of gRPC (see swarm.node.streams); every other call is
    gRPC.
    """

    def __init__(
        self,
        address: str,
        fingerprint: str | None = None,
        key: SwarmKey | None = None,
        max_in_flight: int = 8,
        tls: bool | None = None,
        stream_port: int = 0,
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
            self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._methods: dict[str, Any] = {}
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._calls = ThreadPoolExecutor(max_in_flight, thread_name_prefix=f"swarm-call-{address}")
        self._key, self._max_in_flight = key, max_in_flight
        self._stream: StreamPool | None = None
        self.use_stream(stream_port)

    def use_stream(self, port: int) -> None:
        """Send Compute calls to the node's compute stream on `port` of its host (0: keep them on gRPC)."""
        if not port or self._stream is not None:
            return
        tls = tls_context(self._key, server=False) if self.tls and self._key is not None else None
        host = self.address.rsplit(":", 1)[0]
        self._stream = StreamPool(
            self.address, host, port, self._sign_compute, self._compute_over_grpc, tls, self._max_in_flight
        )

    def _sign_compute(self, body: bytes) -> str:
        return self._signer.token(COMPUTE_METHOD, body) if self._signer else ""

    def _compute_over_grpc(self, body: bytes, token: str, timeout: float | None) -> pb.ComputeReply:
        try:
            return self._send("Compute", body, token, pb.ComputeReply, timeout)
        except grpc.RpcError as e:
            raise wrap_rpc_error(self.address, "Compute", e) from None

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
        rows: torch.Tensor,
        timeout: float | None = None,
        out_dtype: torch.dtype | None = None,
        numerics: str = "native",
    ) -> ComputeCall:
        """Start computing rows [sum(counts), D] (packed expert-major) of `layer`; outputs come in rows' dtype
        unless `out_dtype` says otherwise. `numerics`: native (ggml on the stored quant types) or exact."""
        request = compute_request(
            layer,
            expert_ids,
            counts,
            rows,
            self.fingerprint,
            out_dtype,
            protocol_version=PROTOCOL_VERSION,
            numerics=numerics,
        )
        if self._stream is not None:
            sent = self._stream.submit(request.SerializeToString(), timeout)
            return ComputeCall(self.address, sent.future, sent)
        future = self._calls.submit(self._call, "Compute", request, pb.ComputeReply, timeout)
        return ComputeCall(self.address, future)

    def compute(
        self,
        layer: int,
        expert_ids: Sequence[int],
        counts: Sequence[int],
        rows: torch.Tensor,
        timeout: float | None = None,
        out_dtype: torch.dtype | None = None,
        numerics: str = "native",
    ) -> torch.Tensor:
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
        return NodeInfo(
            address=self.address,
            fingerprint=r.fingerprint,
            protocol_version=r.protocol_version,
            held=frozenset(held_from_proto(r.held)),
            device=r.device,
            memory_budget_bytes=r.memory_budget_bytes,
            max_message_bytes=r.max_message_bytes,
            workers=r.workers,
            hidden_size=r.hidden_size,
            name=r.node_name,
            version=r.version,
            source_sha256=r.source_sha256,
            serves_files=r.serves_files,
            stream_port=r.stream_port,
            numerics_class=r.numerics_class,
        )

    def stats(self, timeout: float | None = 10.0) -> NodeStats:
        try:
            r = self._call("Stats", pb.StatsRequest(), pb.StatsReply, timeout)
        except grpc.RpcError as e:
            raise wrap_rpc_error(self.address, "Stats", e) from None
        return NodeStats(
            calls=r.calls,
            rows=r.rows,
            errors=r.errors,
            experts={(c.layer, c.expert): (c.calls, c.rows) for c in r.experts},
            cache_hits=r.cache_hits,
            cache_misses=r.cache_misses,
            cache_evictions=r.cache_evictions,
            cache_bytes=r.cache_bytes,
            busy_seconds=r.busy_seconds,
            uptime_seconds=r.uptime_seconds,
            in_flight=r.in_flight,
            dropped=frozenset(held_from_proto(r.dropped)),
        )

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
