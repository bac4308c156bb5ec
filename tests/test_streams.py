"""The compute stream (swarm.node.streams): Compute calls as frames on kept connections, beside gRPC.

Real node processes on 127.0.0.1, a real byte-logging TCP proxy (tests/tcp_proxy.py) in front of the stream
port where a test needs to see or cut the wire, raw sockets for what a listener or a broken peer would send.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import socket
import threading
import time

import grpc
import pytest
import torch
from conftest import FIXTURES
from tcp_proxy import TcpProxy

from swarm.coordinator.cli.spawn import start_nodes, stop_nodes
from swarm.node.auth import Signer, SwarmKey, generate_key_text
from swarm.node.client import NodeCallError, NodeClient
from swarm.proto import expert_pb2 as pb
from swarm.proto.channel import PROTOCOL_VERSION
from swarm.proto.codec import compute_request, decode_tensor, encode_tensor
from swarm.proto.frames import COMPUTE_METHOD, call_frame, read_call, read_reply, send_reply

GGUF = FIXTURES / "qwen3moe-tiny" / "model-f32.gguf"  # D = 64, 32 experts
KEY_TEXT = generate_key_text()
KEY = SwarmKey.from_text(KEY_TEXT)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """open: no key; keyed: keyed, plaintext on loopback; tls: keyed, --tls on; grpc: --no-stream."""
    work = tmp_path_factory.mktemp("streams")
    key_file = work / "swarm.key"
    key_file.write_text(KEY_TEXT)
    kf = ["--key-file", str(key_file), "--no-mdns"]
    specs = [
        (GGUF, ["--no-mdns"]),
        (GGUF, kf),
        (GGUF, [*kf, "--tls", "on"]),
        (GGUF, ["--no-mdns", "--no-stream"]),
    ]
    started = start_nodes(specs, work / "nodes")
    yield dict(zip(("open", "keyed", "tls", "grpc"), started, strict=True))
    assert stop_nodes(started) == [0, 0, 0, 0]


def _rows(n: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 64, generator=g)


def _stream_port(address: str, key: SwarmKey | None = None, tls: bool | None = None) -> int:
    with NodeClient(address, key=key, tls=tls) as c:
        return c.info().stream_port


def _raw_call(port: int, body: bytes, token: str) -> tuple[grpc.StatusCode, bytes]:
    """One frame with exactly these bytes and this token, on a connection of its own."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(call_frame(token, body))
        code, payload = read_reply(s)
        return code, bytes(payload)


def test_stream_answers_equal_grpc_and_the_calls_take_the_stream(nodes):
    node = nodes["open"]
    port = _stream_port(node.address)
    assert port > 0 and _stream_port(nodes["grpc"].address) == 0  # --no-stream announces none
    rows = _rows(5)
    with NodeClient(node.address, fingerprint=node.fingerprint) as plain:
        want = plain.compute(0, [3, 7, 30], [2, 1, 2], rows)
    proxy = TcpProxy(f"127.0.0.1:{port}", keep=True)
    try:
        with NodeClient(node.address, fingerprint=node.fingerprint, stream_port=proxy.port) as client:
            calls = [
                client.compute_async(0, [3, 7, 30], [2, 1, 2], rows) for _ in range(6)
            ]  # several at once
            outs = [c.result() for c in calls]
            half = client.compute(1, [5], [2], rows[:2], out_dtype=torch.float16)
    finally:
        proxy.close()
    for out in outs:
        assert torch.equal(out, want)
    assert half.dtype == torch.float16 and half.shape == (2, 64)
    assert rows.numpy().tobytes()[:64] in bytes(proxy.seen), "the calls went over the stream"


def test_stream_errors_are_the_grpc_status_codes(nodes):
    node = nodes["open"]
    with NodeClient(node.address, fingerprint=node.fingerprint, stream_port=_stream_port(node.address)) as c:
        with pytest.raises(NodeCallError) as e:
            c.compute(0, [99], [1], _rows(1))  # an expert this model does not have
        assert e.value.code is grpc.StatusCode.NOT_FOUND
        with pytest.raises(NodeCallError) as e:
            c.compute(0, [1], [2], _rows(1))  # counts that do not match the rows
        assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT
        c.fingerprint = "0" * 64
        with pytest.raises(NodeCallError) as e:
            c.compute(0, [1], [1], _rows(1))
        assert e.value.code is grpc.StatusCode.FAILED_PRECONDITION and "serves model" in e.value.details
        c.fingerprint = node.fingerprint
        assert c.compute(0, [1], [1], _rows(1)).shape == (1, 64)  # the connection is still good


def test_stream_calls_are_authenticated_and_never_replayed_on_either_transport(nodes):
    node = nodes["keyed"]
    port = _stream_port(node.address, KEY)
    body = compute_request(0, [0], [1], _rows(1), node.fingerprint, protocol_version=PROTOCOL_VERSION)
    body_bytes = body.SerializeToString()
    signer = Signer(KEY)
    token = signer.token(COMPUTE_METHOD, body_bytes)
    code, payload = _raw_call(port, body_bytes, token)
    assert code is grpc.StatusCode.OK and pb.ComputeReply.FromString(payload).rows.shape == [1, 64]
    assert _raw_call(port, body_bytes, token)[0] is grpc.StatusCode.UNAUTHENTICATED  # replayed
    code, why = _raw_call(port, body_bytes, "")
    assert code is grpc.StatusCode.UNAUTHENTICATED and b"needs the swarm key" in why
    altered = compute_request(0, [1], [1], _rows(1), node.fingerprint, protocol_version=PROTOCOL_VERSION)
    assert _raw_call(port, altered.SerializeToString(), signer.token(COMPUTE_METHOD, body_bytes))[0] is (
        grpc.StatusCode.UNAUTHENTICATED
    )
    forged = Signer(SwarmKey.from_text("a guess")).token(COMPUTE_METHOD, body_bytes)
    assert _raw_call(port, body_bytes, forged)[0] is grpc.StatusCode.UNAUTHENTICATED
    # a tag spent on gRPC is spent on the stream too (one replay window for both transports)
    fresh = signer.token(COMPUTE_METHOD, body_bytes)
    with grpc.insecure_channel(node.address) as ch:
        stub = ch.unary_unary(COMPUTE_METHOD, request_serializer=None, response_deserializer=None)
        stub(body_bytes, metadata=(("swarm-auth", fresh),), timeout=10)
    assert _raw_call(port, body_bytes, fresh)[0] is grpc.StatusCode.UNAUTHENTICATED
    # the coordinator's own client, with the key, over the stream
    with NodeClient(node.address, fingerprint=node.fingerprint, key=KEY, stream_port=port) as c:
        assert c.compute(0, [0, 2], [1, 1], _rows(2)).shape == (2, 64)


def test_tls_stream_keeps_activations_private_and_admits_only_key_holders(nodes):
    node = nodes["tls"]
    port = _stream_port(node.address, KEY, tls=True)
    proxy = TcpProxy(f"127.0.0.1:{port}", keep=True)
    rows = torch.full((2, 64), 1234.5678)
    try:
        with NodeClient(
            node.address, fingerprint=node.fingerprint, key=KEY, tls=True, stream_port=proxy.port
        ) as c:
            out = c.compute(0, [0, 1], [1, 1], rows)
    finally:
        proxy.close()
    with NodeClient(nodes["keyed"].address, fingerprint=node.fingerprint, key=KEY) as plain:
        assert torch.equal(out, plain.compute(0, [0, 1], [1, 1], rows))
    wire = bytes(proxy.seen)
    assert len(wire) > 1000 and rows.numpy().tobytes()[:16] not in wire
    assert node.fingerprint.encode() not in wire and KEY.secret not in wire
    # plaintext frames to a TLS stream get no answer: the connection ends
    body = compute_request(0, [0], [1], _rows(1), node.fingerprint).SerializeToString()
    with pytest.raises((ConnectionError, EOFError)):
        _raw_call(port, body, Signer(KEY).token(COMPUTE_METHOD, body))
    # a client of another swarm gets no TLS session, so its call fails as a dead node's would
    stranger_key = SwarmKey.from_text("another swarm")
    with NodeClient(node.address, key=stranger_key, tls=True, stream_port=port) as stranger:
        with pytest.raises(NodeCallError) as e:
            stranger.compute(0, [0], [1], _rows(1), timeout=5)
    assert e.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED)


def test_garbage_on_the_stream_ends_that_connection_only(nodes):
    node = nodes["open"]
    port = _stream_port(node.address)
    for junk in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"SWc1" + b"\xff" * 8, b"\x00" * 3):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(junk)
            try:
                s.shutdown(socket.SHUT_WR)
                assert s.recv(100) == b""  # closed without an answer
            except ConnectionResetError:
                pass  # closed with bytes of ours unread
            except OSError as e:  # the node's reset came before our shutdown: the same close, seen earlier
                assert e.errno == errno.ENOTCONN, e
    with NodeClient(node.address, fingerprint=node.fingerprint, stream_port=port) as c:
        assert c.compute(0, [0], [1], _rows(1)).shape == (1, 64)


def test_a_kept_connection_the_link_dropped_is_replaced_on_the_next_call(nodes):
    node = nodes["open"]
    proxy = TcpProxy(f"127.0.0.1:{_stream_port(node.address)}")
    try:
        with NodeClient(node.address, fingerprint=node.fingerprint, stream_port=proxy.port) as c:
            first = c.compute(0, [4], [1], _rows(1))
            proxy.cut()  # every kept connection drops while idle
            time.sleep(0.2)
            assert torch.equal(c.compute(0, [4], [1], _rows(1)), first)
    finally:
        proxy.close()


def test_unreachable_stream_falls_back_to_grpc_and_says_so(nodes, caplog):
    node = nodes["open"]
    with socket.create_server(("127.0.0.1", 0)) as s:
        closed_port = s.getsockname()[1]  # nothing listens there once the block ends
    with NodeClient(node.address, fingerprint=node.fingerprint) as plain:
        want = plain.compute(0, [2], [1], _rows(1))
    with caplog.at_level(logging.WARNING, logger="swarm.node.streams"):
        with NodeClient(node.address, fingerprint=node.fingerprint, stream_port=closed_port) as c:
            assert torch.equal(c.compute(0, [2], [1], _rows(1)), want)
            assert torch.equal(c.compute(0, [2], [1], _rows(1)), want)
    said = [r.getMessage() for r in caplog.records if "compute stream" in r.getMessage()]
    assert len(said) == 1 and "over gRPC" in said[0] and str(closed_port) in said[0]


def test_a_node_that_is_down_is_not_called_a_blocked_stream(caplog):
    """Nothing answers at the node's gRPC port nor at its stream's (the node was killed): the call fails
    UNAVAILABLE for the caller's failover, and nothing suggests opening the stream's port in a firewall."""
    with socket.create_server(("127.0.0.1", 0)) as a, socket.create_server(("127.0.0.1", 0)) as b:
        grpc_port, stream_port = a.getsockname()[1], b.getsockname()[1]  # closed once the block ends
    with caplog.at_level(logging.WARNING, logger="swarm.node.streams"):
        with NodeClient(f"127.0.0.1:{grpc_port}", stream_port=stream_port) as c:
            with pytest.raises(NodeCallError) as e:
                c.compute(0, [2], [1], _rows(1), timeout=10)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert not [r.getMessage() for r in caplog.records if "compute stream" in r.getMessage()]


def test_a_node_that_never_answers_ends_the_call_at_its_deadline():
    node = _SlowNode(delay=None)
    try:
        with NodeClient("127.0.0.1:1", stream_port=node.port) as c:
            t0 = time.monotonic()
            with pytest.raises(NodeCallError) as e:
                c.compute(0, [0], [1], _rows(1), timeout=0.5)
            assert e.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
            assert 0.4 < time.monotonic() - t0 < 5
    finally:
        node.close()


def test_a_node_killed_mid_call_fails_the_call_unavailable(tmp_path):
    (node,) = start_nodes([(GGUF, ["--no-mdns"])], tmp_path / "nodes")
    try:
        with NodeClient(node.address, fingerprint=node.fingerprint) as c:
            c.use_stream(c.info().stream_port)
            c.compute(0, [0], [1], _rows(1))
            node.process.kill()
            node.process.wait(10)
            with pytest.raises(NodeCallError) as e:
                c.compute(0, [0], [1], _rows(1), timeout=10)
        assert e.value.code is grpc.StatusCode.UNAVAILABLE
    finally:
        stop_nodes([node])


class _SlowNode:
    """A compute stream on 127.0.0.1 that answers each call with rows of zeros after `delay` s (None: never),
    the first `answers` calls only (None: every one)."""

    def __init__(self, delay: float | None, answers: int | None = None) -> None:
        self.delay, self.answers = delay, answers
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        try:
            while True:
                conn = self.listener.accept()[0]
                self.conns.append(conn)
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()
        except OSError:
            pass

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                _, body = read_call(conn)
                if self.delay is None or self.answers == 0:
                    continue
                if self.answers is not None:
                    self.answers -= 1
                time.sleep(self.delay)
                rows = decode_tensor(pb.ComputeRequest.FromString(bytes(body)).rows)
                reply = pb.ComputeReply(rows=encode_tensor(torch.zeros_like(rows)))
                send_reply(conn, grpc.StatusCode.OK, reply.SerializeToString())
        except (OSError, EOFError):
            pass

    def close(self) -> None:
        self.listener.close()
        for c in self.conns:
            c.close()


def _resolved_on(call: object) -> list[int]:
    """The id of the thread that will resolve the call's answer (filled in then)."""
    seen: list[int] = []
    call._future.add_done_callback(lambda _: seen.append(threading.get_ident()))  # type: ignore[attr-defined]
    return seen


def test_a_small_calls_answer_is_read_on_the_callers_thread_a_prompts_on_the_streams(nodes):
    node = nodes["open"]
    with NodeClient(node.address, fingerprint=node.fingerprint, stream_port=_stream_port(node.address)) as c:
        c.compute(0, [1], [1], _rows(1))  # the connection is open: later small calls go from this thread
        small = c.compute_async(0, [1, 2], [1, 1], _rows(2))
        on = _resolved_on(small)
        small.result()
        assert on == [threading.get_ident()]  # no hand-off to the stream's thread and back
        big = c.compute_async(0, [1, 2], [200, 200], _rows(400))  # 100 KiB: sent and read by the thread
        on = _resolved_on(big)
        assert big.result().shape == (400, 64)
        assert on and on != [threading.get_ident()]


def test_a_small_calls_answer_is_read_on_the_callers_thread_past_a_thousand_open_files(nodes):
    """A process with a thousand slab files mapped (a descriptor each: a coordinator whose audits have drawn
    that many from a shard directory, or that holds them) has its stream sockets past descriptor 1,023, where
    select() cannot wait: the answer must still be read here."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(2048, hard), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        node = nodes["open"]
        with NodeClient(
            node.address, fingerprint=node.fingerprint, stream_port=_stream_port(node.address)
        ) as c:
            c.compute(0, [1], [1], _rows(1))  # opens the connection: its socket lies past the files
            (conn,) = c._stream._conns  # type: ignore[union-attr]
            assert conn.sock.fileno() > 1024
            small = c.compute_async(0, [1, 2], [1, 1], _rows(2))
            on = _resolved_on(small)
            assert small.result().shape == (2, 64)
            assert on == [threading.get_ident()]
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_late_answer_is_still_the_callers_a_polled_one_the_streams_and_a_dropped_call_frees_its_connection():
    node = _SlowNode(delay=0.3)
    try:
        with NodeClient("127.0.0.1:1", stream_port=node.port, max_in_flight=1) as c:
            c.compute(0, [0], [1], _rows(1), timeout=10)  # opens the one connection
            late = c.compute_async(0, [0], [1], _rows(1), timeout=10)
            on = _resolved_on(late)
            assert not late.wait(0.05)  # not in yet: still ours to read
            assert torch.equal(late.result(), torch.zeros(1, 64))
            assert on == [threading.get_ident()]
            polled = c.compute_async(0, [0], [1], _rows(1), timeout=10)
            on = _resolved_on(polled)
            assert not polled.done()  # a caller that polls leaves the reading to the stream's thread
            assert torch.equal(polled.result(), torch.zeros(1, 64))
            assert on and on != [threading.get_ident()]
            dropped = c.compute_async(0, [0], [1], _rows(1), timeout=10)
            del dropped  # nobody waits for it: its connection must still come free for the next call
            gc.collect()
            after = c.compute_async(0, [0], [1], _rows(1), timeout=10)
            assert after.wait(5) and torch.equal(after.result(), torch.zeros(1, 64))
    finally:
        node.close()


def test_closing_the_client_ends_a_call_whose_answer_was_the_callers_to_read():
    node = _SlowNode(delay=0.0, answers=1)
    try:
        c = NodeClient("127.0.0.1:1", stream_port=node.port)
        c.compute(0, [0], [1], _rows(1), timeout=10)  # the connection opens; the next call goes from here
        pending = c.compute_async(0, [0], [1], _rows(1))  # sent from here: its answer is ours to read
        c.close()
        with pytest.raises(NodeCallError) as e:
            pending.result(timeout=5)
        assert e.value.code is grpc.StatusCode.CANCELLED
    finally:
        node.close()


def test_a_call_whose_answer_is_the_callers_still_ends_at_its_deadline():
    node = _SlowNode(delay=0.0, answers=1)
    try:
        with NodeClient("127.0.0.1:1", stream_port=node.port) as c:
            c.compute(0, [0], [1], _rows(1), timeout=10)  # the connection opens; the next call goes from here
            t0 = time.monotonic()
            call = c.compute_async(0, [0], [1], _rows(1), timeout=0.3)  # sent from here, read here
            on = _resolved_on(call)
            with pytest.raises(NodeCallError) as e:
                call.result()
            assert e.value.code is grpc.StatusCode.DEADLINE_EXCEEDED and on == [threading.get_ident()]
            assert 0.25 < time.monotonic() - t0 < 3
    finally:
        node.close()


def test_an_idle_connection_is_closed_and_a_busy_one_kept():
    """A connection that sends nothing for the idle time is closed (so connections held open by a peer that
    sends nothing cannot use up the node's connection slots); one whose calls come sooner stays open."""
    from swarm.node.stream_pool import StreamPool
    from swarm.node.streams import StreamServer

    server = StreamServer(
        "127.0.0.1", 0, lambda body: (grpc.StatusCode.OK, bytes(body)), idle_seconds=1.0
    ).start()
    try:
        with (
            socket.create_connection(("127.0.0.1", server.port), timeout=10) as idle,
            socket.create_connection(("127.0.0.1", server.port), timeout=10) as busy,
        ):
            t0 = time.monotonic()
            for i in range(8):  # 2.4 s of calls, 0.3 s apart
                busy.sendall(call_frame("", b"call %d" % i))
                assert read_reply(busy) == (grpc.StatusCode.OK, bytearray(b"call %d" % i))
                time.sleep(0.3)
            assert idle.recv(1) == b""  # closed by the node long since
            assert time.monotonic() - t0 < 5
            deadline = time.monotonic() + 5
            while len(server._conns) != 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(server._conns) == 1  # the busy one
    finally:
        server.stop()

    # A client's kept connection that the node closed while it was idle: the next call is made once more on a
    # new connection, still on the stream (the gRPC fallback would fail the test).
    reply = pb.ComputeReply(rows=pb.Tensor(shape=[1, 3])).SerializeToString()
    server = StreamServer("127.0.0.1", 0, lambda body: (grpc.StatusCode.OK, reply), idle_seconds=0.3).start()
    pool = StreamPool("idle-node", "127.0.0.1", server.port, lambda body: "", _no_fallback)
    try:
        for _ in range(3):
            call = pool.submit(b"x", timeout=10)
            call.read_here(10)
            assert list(call.future.result(timeout=10).rows.shape) == [1, 3]
            time.sleep(0.6)
    finally:
        pool.close()
        server.stop()


def _no_fallback(body: bytes, token: str, timeout: float | None) -> pb.ComputeReply:
    raise AssertionError("the call left the stream for gRPC")
