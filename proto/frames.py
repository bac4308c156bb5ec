"""The compute stream's framing: Compute calls on one kept TCP (or TLS) connection, one call at a time.

A gRPC call from Python costs a fraction of a millisecond of CPU on each side on top of its compute
(HTTP/2 stream set-up, metadata, a thread hand-off on each side), and a decode step makes one call per node
and MoE layer. A frame on a kept connection costs a third of that (bench/transport.py). The bytes inside are the gRPC path's:

    request  = MAGIC_CALL  token length (u32)  body length (u32)  token (ASCII)  body (a ComputeRequest)
    reply    = MAGIC_REPLY status (u32)        payload length (u32)             payload

`token` is the swarm-auth tag of the gRPC path (swarm.node.auth, made for the Compute method over exactly
`body`; empty without a key); `status` is a grpc.StatusCode's number, the payload a serialized ComputeReply
when it is OK and the node's message (UTF-8) otherwise. Integers are little-endian. A frame that breaks these
rules ends the connection (FrameError).
"""

from __future__ import annotations

import socket
import ssl
import struct

import grpc

from swarm.proto.channel import MAX_MESSAGE_BYTES, SERVICE_NAME

MAGIC_CALL = b"SWc1"
MAGIC_REPLY = b"SWr1"
_HEADER = struct.Struct("<4sII")
MAX_TOKEN_BYTES = 256
# The method a stream call's swarm-auth tag is made for: the gRPC Compute method's path, so that a tag and its
# (session, counter) are good for one call on either transport, never both.
COMPUTE_METHOD = f"/{SERVICE_NAME}/Compute"

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class FrameError(ConnectionError):
    """The peer sent bytes that are not a frame (or closed the connection in the middle of one)."""


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Exactly n bytes from sock; FrameError when the connection ends first (EOFError at a frame boundary)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                raise EOFError("connection closed")
            raise FrameError(f"connection closed {got} bytes into a {n}-byte read")
        got += k
    return buf


def _header(sock: socket.socket, magic: bytes) -> tuple[int, int]:
    raw = recv_exact(sock, _HEADER.size)
    got, a, b = _HEADER.unpack(raw)
    if got != magic:
        raise FrameError(f"not a swarm compute-stream frame (starts {bytes(raw[:4])!r}, expected {magic!r})")
    return a, b


def _send(sock: socket.socket, parts: list[bytes]) -> None:
    """Send the parts back to back without joining them (a prompt's rows are megabytes) where the socket can
    gather; a TLS socket cannot: joined there."""
    if isinstance(sock, ssl.SSLSocket):
        sock.sendall(b"".join(parts))
        return
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


def _call_parts(token: str, body: bytes) -> list[bytes]:
    t = token.encode("ascii")
    return [_HEADER.pack(MAGIC_CALL, len(t), len(body)), t, body]


def call_frame(token: str, body: bytes) -> bytes:
    return b"".join(_call_parts(token, body))


def send_call(sock: socket.socket, token: str, body: bytes) -> None:
    _send(sock, _call_parts(token, body))


def read_call(sock: socket.socket) -> tuple[str, bytearray]:
    """(token, body) of the next call; EOFError when the peer closed between calls."""
    n_token, n_body = _header(sock, MAGIC_CALL)
    if n_token > MAX_TOKEN_BYTES or n_body > MAX_MESSAGE_BYTES:
        raise FrameError(f"a {n_body}-byte call (limit {MAX_MESSAGE_BYTES}) with a {n_token}-byte token")
    token = recv_exact(sock, n_token).decode("ascii", "replace") if n_token else ""
    return token, recv_exact(sock, n_body)


def send_reply(sock: socket.socket, code: grpc.StatusCode, payload: bytes) -> None:
    _send(sock, [_HEADER.pack(MAGIC_REPLY, code.value[0], len(payload)), payload])


def read_reply(sock: socket.socket) -> tuple[grpc.StatusCode, bytearray]:
    status, n = _header(sock, MAGIC_REPLY)
    code = _CODES.get(status)
    if code is None or n > MAX_MESSAGE_BYTES:
        raise FrameError(f"a reply with status {status} and {n} bytes")
    return code, recv_exact(sock, n)
