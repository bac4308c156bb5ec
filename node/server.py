"""The node's gRPC server: the ExpertNode service over an ExpertStore, the health service, the swarm key.

The servicer decodes, calls the store's pure compute, encodes; every failure becomes a status code with
a message that says what to do, in one place (`_answer`), so a bad call never takes the node down.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from swarm.compute.numclass import numerics_class
from swarm.compute.store import BadCall, ExpertStore, MissingSlabs
from swarm.node.auth import AUTH_METADATA, SwarmKey, Verifier
from swarm.node.files import BadPath, NotOffered, ShardFiles, chunks
from swarm.node.streams import StreamServer, tls_context
from swarm.proto import expert_pb2 as pb
from swarm.proto import expert_pb2_grpc as pb_grpc
from swarm.proto.arrays import F32, cast_rows
from swarm.proto.channel import (
    CHANNEL_OPTIONS,
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    SERVICE_NAME,
)
from swarm.proto.codec import (
    CodecError,
    decode_rows,
    dtype_from_proto,
    encode_planes,
    encode_tensor,
    held_to_proto,
    is_q8,
    numerics_from_proto,
)
from swarm.proto.numerics import Numerics
from swarm.sharding.errors import UserError

log = logging.getLogger(__name__)

DEFAULT_WORKERS = 8
# A Fetch stream holds one of the node's worker threads while it lasts: at most a quarter of them (and at
# least one) give out files at once, so that fetching nodes never starve the Compute calls.
FETCH_SHARE = 4
_HEALTH_PREFIX = "/grpc.health.v1.Health/"

Reply = TypeVar("Reply")


@functools.cache
def software_version() -> str:
    """This install's version (read once: importlib.metadata scans the path each time)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("swarm-moe")
    except PackageNotFoundError:
        return "unknown"


class Refused(Exception):
    """A call the node answers with a specific status code (wrong model, wrong protocol, ...)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class CallStats:
    """What this node has done since it started; updated under one small lock."""

    started: float = field(default_factory=time.monotonic)
    calls: int = 0
    rows: int = 0
    errors: int = 0
    busy_seconds: float = 0.0
    in_flight: int = 0
    per_expert: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # -> [calls, rows]
    lock: threading.Lock = field(default_factory=threading.Lock)

    def begin(self) -> None:
        with self.lock:
            self.in_flight += 1

    def end(
        self, layer: int | None, expert_ids: list[int], counts: list[int], seconds: float, ok: bool
    ) -> None:
        with self.lock:
            self.in_flight -= 1
            if not ok:
                self.errors += 1
                return
            self.calls += 1
            self.busy_seconds += seconds
            self.rows += sum(counts)
            for e, n in zip(expert_ids, counts, strict=True):
                c = self.per_expert.setdefault((layer, e), [0, 0])
                c[0] += 1
                c[1] += n


def status_of(e: Exception, method: str) -> tuple[grpc.StatusCode, str]:
    """Every way a call can fail, as a status code and a message that says what to do."""
    if isinstance(e, Refused):
        return e.code, str(e)
    if isinstance(e, MissingSlabs | NotOffered):
        return grpc.StatusCode.NOT_FOUND, str(e)
    if isinstance(e, FileNotFoundError):
        return grpc.StatusCode.NOT_FOUND, f"{e.filename}: gone from this node; ask another holder"
    if isinstance(e, BadCall | CodecError | BadPath):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":  # torch's, on a GPU node
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"out of memory computing this call ({e}); send fewer rows"
    # the node must outlive any bad call; the log keeps the traceback
    log.error("%s failed", method, exc_info=e)
    return grpc.StatusCode.INTERNAL, f"node error: {type(e).__name__}: {e}"


def _answer(method: Callable[..., Reply]) -> Callable[..., Reply]:
    """A gRPC method whose failures end the call with `status_of`'s code and message."""

    @functools.wraps(method)
    def wrapper(self: ExpertServicer, request: Any, context: grpc.ServicerContext) -> Reply:
        try:
            return method(self, request, context)
        except Exception as e:
            code, msg = status_of(e, method.__name__)
        context.abort(code, msg)

    return wrapper


class ExpertServicer(pb_grpc.ExpertNodeServicer):
    def __init__(
        self,
        store: ExpertStore,
        fingerprint: str,
        workers: int,
        name: str = "",
        stats: CallStats | None = None,
        source_sha256: str = "",
        files: ShardFiles | None = None,
    ) -> None:
        self.store = store
        self.files = files
        self.fingerprint = fingerprint
        self.source_sha256 = source_sha256
        self.workers = workers
        self.name = name
        self.stats = stats or CallStats()
        self.stream_port = 0  # the compute stream's port, once NodeServer has opened it
        self._fetch_slots = threading.BoundedSemaphore(max(1, workers // FETCH_SHARE))

    def _check_model(self, request: pb.ComputeRequest | pb.FetchRequest) -> None:
        if request.fingerprint and self.fingerprint and request.fingerprint != self.fingerprint:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this node serves model {self.fingerprint}, the call is for model {request.fingerprint}; "
                "start the node on the same model (GGUF or shard dir) as the coordinator",
            )
        if request.protocol_version and request.protocol_version != PROTOCOL_VERSION:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this node speaks protocol {PROTOCOL_VERSION}, the call uses {request.protocol_version}; "
                "run the same swarm version on the coordinator and the nodes",
            )

    @_answer
    def Compute(self, request: pb.ComputeRequest, context: grpc.ServicerContext) -> pb.ComputeReply:
        return self.compute(request)

    def compute_frame(self, body: bytes) -> tuple[grpc.StatusCode, bytes]:
        """A Compute call from the compute stream (swarm.node.streams): (status, the serialized ComputeReply or
        the message), with the gRPC method's checks and codes."""
        try:
            request = pb.ComputeRequest.FromString(body)
        except DecodeError as e:
            return grpc.StatusCode.INVALID_ARGUMENT, f"not a Compute request ({e})".encode()
        try:
            return grpc.StatusCode.OK, self.compute(request).SerializeToString()
        except Exception as e:
            code, msg = status_of(e, "Compute")
            return code, msg.encode()

    def compute(self, request: pb.ComputeRequest) -> pb.ComputeReply:
        expert_ids, counts = list(request.expert_ids), list(request.counts)
        self.stats.begin()
        ok, t0 = False, time.perf_counter()
        try:
            self._check_model(request)
            numerics = numerics_from_proto(request.numerics)
            if numerics == Numerics.EXACT and is_q8(request.rows.dtype):
                raise BadCall("8-bit rows are for native numerics; send float rows (f32) for exact")
            rows = decode_rows(request.rows, "rows")  # 8-bit rows: float32 rows that quantize back to them
            planes = request.out_dtype == pb.F32_PLANES  # float32 answers, packed without losing a bit
            if planes:
                out_dtype = F32
            else:
                out_dtype = dtype_from_proto(request.out_dtype) if request.out_dtype else rows.dtype
            compute = self.store.compute_inner if request.inner else self.store.compute
            done = compute(request.layer, expert_ids, counts, rows, numerics)  # type: ignore[operator]
            out, inner = done if request.inner else (done, None)  # (answers, their gate and up products)
            answer = cast_rows(out, out_dtype)
            reply = pb.ComputeReply(rows=encode_planes(answer) if planes else encode_tensor(answer))
            if inner is not None:  # float32 whatever the answer's type: the check needs the node's own bits
                reply.inner.CopyFrom(encode_planes(inner) if planes else encode_tensor(inner))
            ok = True
            return reply
        finally:
            self.stats.end(request.layer, expert_ids, counts, time.perf_counter() - t0, ok)

    @_answer
    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoReply:
        return pb.InfoReply(
            fingerprint=self.fingerprint,
            protocol_version=PROTOCOL_VERSION,
            held=held_to_proto(self.store.held()),
            device=str(self.store.device),
            memory_budget_bytes=self.store.memory_budget,
            max_message_bytes=MAX_MESSAGE_BYTES,
            workers=self.workers,
            hidden_size=self.store.hidden_size or 0,
            node_name=self.name,
            version=software_version(),
            source_sha256=self.source_sha256,
            serves_files=self.files is not None,
            stream_port=self.stream_port,
            numerics_class=numerics_class(),
        )

    @_answer
    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsReply:
        cache = self.store.cache_stats()
        s = self.stats
        with s.lock:
            experts = [
                pb.ExpertCount(layer=layer, expert=e, calls=c, rows=r)
                for (layer, e), (c, r) in sorted(s.per_expert.items())
            ]
            return pb.StatsReply(
                calls=s.calls,
                rows=s.rows,
                errors=s.errors,
                experts=experts,
                cache_hits=cache.hits,
                cache_misses=cache.misses,
                cache_evictions=cache.evictions,
                cache_bytes=cache.resident_bytes,
                busy_seconds=s.busy_seconds,
                uptime_seconds=time.monotonic() - s.started,
                in_flight=s.in_flight,
                dropped=held_to_proto(self.store.dropped()),
            )

    @_answer
    def Fetch(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> Iterator[pb.FileChunk]:
        """The checks and the opening happen here, in the call (so that a refusal is a status code); the
        returned generator only reads."""
        self._check_model(request)
        if self.files is None:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this node gives out no files (it serves a whole GGUF, or slabs it did not verify: "
                "--no-verify); fetch from a node started on a shard directory",
            )
        f, size = self.files.open(request.path, request.offset)
        log.debug("fetch %s from byte %d of %d", request.path, request.offset, size)
        return self._stream(request.path, f, request.offset, size, context)

    def _stream(
        self, path: str, f: Any, offset: int, size: int, context: grpc.ServicerContext
    ) -> Iterator[pb.FileChunk]:
        if not self._fetch_slots.acquire(blocking=False):
            f.close()
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "this node is giving out files to as many fetchers as it may; ask another holder or again soon",
            )
        try:
            for at, data in chunks(f, offset, size):
                yield pb.FileChunk(offset=at, data=data, size=size)
        except OSError as e:
            log.warning("fetch of %s failed: %s", path, e)
            context.abort(
                grpc.StatusCode.INTERNAL, f"{path}: cannot be read on this node ({e}); ask another holder"
            )
        finally:
            self._fetch_slots.release()


class GateInterceptor(grpc.ServerInterceptor):
    """Every call but health checks passes here first (Fetch's stream included): with a swarm key, refused
    (UNAUTHENTICATED) unless its swarm-auth token verifies; bytes that are not the method's message are
    INVALID_ARGUMENT.

    The check runs on the raw request bytes before they are parsed (the tag covers their digest), so an
    unauthenticated call costs the node one hash and never reaches the parser or the servicer.
    """

    def __init__(self, verifier: Verifier | None) -> None:
        self.verifier = verifier

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or details.method.startswith(_HEALTH_PREFIX):
            return handler
        token = next((v for k, v in details.invocation_metadata or () if k == AUTH_METADATA), None)
        method, parse = details.method, handler.request_deserializer
        token = token if isinstance(token, str) else None

        def deserialize(raw: bytes) -> tuple[grpc.StatusCode | None, Any]:
            refused = self.verifier.check(method, token, raw) if self.verifier is not None else ""
            if refused:
                return grpc.StatusCode.UNAUTHENTICATED, refused
            try:
                return None, parse(raw) if parse else raw
            except DecodeError as e:
                return grpc.StatusCode.INVALID_ARGUMENT, f"not a {method.rsplit('/', 1)[-1]} request ({e})"

        def gated(serve: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[..., Any]:
            def behavior(checked: tuple[grpc.StatusCode | None, Any], context: grpc.ServicerContext) -> Any:
                code, request = checked
                if code is not None:
                    context.abort(code, request)
                return serve(request, context)

            return behavior

        # Every method of this service takes one request: unary (Compute, Info, Stats) or answered by a stream
        # (Fetch); the stream's request is checked the same way, before its first reply. Anything else is refused.
        if handler.unary_unary is not None:
            make, serve = grpc.unary_unary_rpc_method_handler, handler.unary_unary
        elif handler.unary_stream is not None:
            make, serve = grpc.unary_stream_rpc_method_handler, handler.unary_stream
        else:
            return grpc.unary_unary_rpc_method_handler(
                lambda r, c: c.abort(grpc.StatusCode.UNIMPLEMENTED, "unknown method")
            )
        return make(
            gated(serve), request_deserializer=deserialize, response_serializer=handler.response_serializer
        )


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class NodeServer:
    """A running expert node: the gRPC server with the expert and health services on host:port, and the
    compute stream (swarm.node.streams) on `stream_port` (0: any free port; None: none)."""

    def __init__(
        self,
        store: ExpertStore,
        fingerprint: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        workers: int = DEFAULT_WORKERS,
        key: SwarmKey | None = None,
        tls: bool = False,
        name: str = "",
        source_sha256: str = "",
        files: ShardFiles | None = None,
        stream_port: int | None = 0,
    ) -> None:
        self.store = store
        self.host = host
        self.tls = tls
        if tls and key is None:
            raise UserError("TLS needs a swarm key (its identity is derived from it): give --key-file")
        self.servicer = ExpertServicer(
            store, fingerprint, workers, name, source_sha256=source_sha256, files=files
        )
        self.health = health.HealthServicer()
        verifier = Verifier(key) if key is not None else None  # one replay window for both transports
        self.verifier = verifier  # (a joined node's stream connections check with it too: swarm.node.join)
        interceptors = [GateInterceptor(verifier)]
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="swarm-node"),
            options=CHANNEL_OPTIONS,
            interceptors=interceptors,
        )
        pb_grpc.add_ExpertNodeServicer_to_server(self.servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        try:
            if tls and key is not None:
                key_pem, cert_pem = key.tls_identity
                creds = grpc.ssl_server_credentials(
                    [(key_pem, cert_pem)], root_certificates=cert_pem, require_client_auth=True
                )
                self.port = self._server.add_secure_port(format_address(host, port), creds)
            else:
                self.port = self._server.add_insecure_port(format_address(host, port))
        except RuntimeError as e:
            raise UserError(
                f"cannot listen on {format_address(host, port)} ({e}); pick another --host/--port"
            ) from e
        if self.port == 0:
            raise UserError(
                f"cannot listen on {format_address(host, port)}: the port is taken or the address is not "
                "this machine's; pick another --port (0 = any free port) or --host"
            )
        self.stream: StreamServer | None = None
        if stream_port is not None:
            tls_ctx = tls_context(key, server=True) if tls and key is not None else None
            try:
                self.stream = StreamServer(host, stream_port, self.servicer.compute_frame, verifier, tls_ctx)
            except OSError as e:
                self._server.stop(None)
                raise UserError(
                    f"cannot listen on {format_address(host, stream_port)} for the compute stream ({e}); pick "
                    "another --stream-port (0 = any free port), or --no-stream"
                ) from e
            self.servicer.stream_port = self.stream.port

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    def start(self) -> NodeServer:
        self._server.start()
        if self.stream is not None:
            self.stream.start()
        for service in ("", SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %d slabs on %s", len(self.store.slabs), self.address)
        return self

    def stop(self, grace: float | None = 2.0) -> None:
        """Say NOT_SERVING, let in-flight calls finish for up to `grace` seconds, then stop."""
        self.health.enter_graceful_shutdown()
        self._server.stop(grace).wait()
        if self.stream is not None:
            self.stream.stop()

    def wait(self, timeout: float | None = None) -> bool:
        return self._server.wait_for_termination(timeout)
