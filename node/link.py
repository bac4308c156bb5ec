"""The join link's wire, both ends: how a node that dialed out and the coordinator it dialed prove the swarm
key to each other, and the messages they then exchange.

Every connection of a link is dialed by the node (NAT lets nothing in) to the coordinator's join listener,
TLS with the coordinator as the server, showing the swarm key's certificate. Then, in messages of a u32
length and compact JSON (at most MAX_MESSAGE bytes):

    node         hello  {v, kind, node, conn, nonce, fingerprint, source_sha256, name, timeout}
    coordinator         {nonce, proof}    proof = HMAC(join secret, "coordinator" | node nonce | its nonce | pin)
    node                {proof}           proof = HMAC(join secret, "node" | coordinator nonce | node nonce | pin)
    coordinator         {ok} or {error}

The node checks the certificate against the pin (swarm.node.invite) before it says anything: only a key holder
can show it, so the channel ends at a holder of the key. Both proofs take the two fresh nonces and the pin, so
neither can be replayed or carried to another channel (Python's ssl has no RFC 5705 exporter to bind to; the
pinned certificate is what binds the proofs to this channel: a man in the middle would have to show it).
Either end refuses the other with a message that says what to do.

`kind` says what the connection is for once both are proven: "control" (the link itself: pings both ways, each
end a quarter of the node's link timeout apart, and the coordinator's requests for more connections), "stream" (the node serves Compute frames on it,
swarm.proto.frames, exactly as on its compute stream, the coordinator calling), "grpc" (the bytes of one
gRPC connection to the node's own server, relayed: Info, Stats, health) or "files" (one file of the
coordinator's shard directory for a fetching node, swarm.node.link_files; the node may not know the model's
full fingerprint yet, so its hello names the invite's prefix of it, or nothing when it holds the key).

LINK_VERSION is the handshake's and the existing kinds' messages'. A kind or a control message that is only
added bumps nothing: an older coordinator refuses a kind it does not know with the version's message (one
swarm version on every device), and either end passes over a control message it does not know (the node
tells the coordinator over its control connection that the slabs it serves changed: {"t": "held"}).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import math
import secrets
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from swarm.node.auth import SwarmKey
from swarm.node.invite import join_secret
from swarm.node.streams import CONNECT_SECONDS, set_nodelay

LINK_VERSION = 1
LINK_TIMEOUT = 20.0  # a link that brings nothing (not even a ping) for this long is lost
MAX_MESSAGE = 64 << 10
_LEN = struct.Struct("<I")
KINDS = ("control", "stream", "grpc", "files")
HANDSHAKE_SECONDS = 10.0


class LinkError(ConnectionError):
    """The peer broke the link's protocol (bytes that are not a message), or closed it."""


class LinkRefused(Exception):
    """One end refused the other: wrong key, another model, an impostor. Permanent: dialing again would not
    help, so a node says why and stops."""


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(body)) + body)


def read_message(sock: socket.socket) -> dict[str, Any]:
    from swarm.proto.frames import recv_exact

    try:
        (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
        if n > MAX_MESSAGE:
            raise LinkError(f"a {n}-byte link message (limit {MAX_MESSAGE})")
        message = json.loads(recv_exact(sock, n))
    except EOFError:
        raise LinkError("the link was closed") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise LinkError(f"not a link message ({e})") from None
    if not isinstance(message, dict):
        raise LinkError("not a link message (not an object)")
    return message


def _proof(secret: bytes, who: bytes, first: str, second: str, pin: str) -> str:
    msg = who + b"\0" + bytes.fromhex(first) + bytes.fromhex(second) + bytes.fromhex(pin)
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def _hex(message: dict[str, Any], name: str, digits: int) -> str:
    value = message.get(name)
    if not isinstance(value, str) or len(value) != digits:
        raise LinkError(f"link message without a {digits}-digit {name}")
    try:
        bytes.fromhex(value)
    except ValueError:
        raise LinkError(f"link message whose {name} is not hex") from None
    return value


def peer_pin(sock: ssl.SSLSocket) -> str:
    der = sock.getpeercert(binary_form=True)
    return hashlib.sha256(der).hexdigest() if der else ""


def client_context() -> ssl.SSLContext:
    """The node's side: the certificate is checked against the invite's pin, not a CA (it is self-signed)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def server_context(key: SwarmKey) -> ssl.SSLContext:
    """The coordinator's side: the swarm key's identity; nodes prove themselves by the join secret instead of
    a certificate (an invited node has no key to make one from)."""
    from swarm.node.streams import tls_context

    ctx = tls_context(key, server=True)
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def dial(
    address: str, pin: str, secret: bytes, hello: dict[str, Any], timeout: float = HANDSHAKE_SECONDS
) -> ssl.SSLSocket:
    """A proven connection to the coordinator at "host:port" (the node's side of the handshake). OSError when
    it cannot be reached, LinkRefused when either end refuses the other."""
    host, _, port = address.rpartition(":")
    raw = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    try:
        set_nodelay(raw)
        sock = client_context().wrap_socket(raw)
    except BaseException:
        raw.close()
        raise
    try:
        if peer_pin(sock) != pin:
            raise LinkRefused(
                f"the coordinator at {address} does not show this swarm's certificate: it holds another swarm "
                "key (an invite or --key-file of another swarm) or it is not the coordinator; ask for a new "
                "invite (`swarm invite`)"
            )
        nonce = secrets.token_hex(16)
        send_message(sock, {"v": LINK_VERSION, **hello, "nonce": nonce})
        answer = read_message(sock)
        if "error" in answer:
            raise LinkRefused(f"the coordinator at {address} refused this node: {answer['error']}")
        theirs = _hex(answer, "nonce", 32)
        if not hmac.compare_digest(_hex(answer, "proof", 64), _proof(secret, b"coordinator", nonce, theirs, pin)):
            raise LinkRefused(
                f"the coordinator at {address} cannot prove the swarm key this invite is for; ask for a new "
                "invite (`swarm invite`)"
            )
        send_message(sock, {"proof": _proof(secret, b"node", theirs, nonce, pin)})
        verdict = read_message(sock)
        if "error" in verdict:
            raise LinkRefused(f"the coordinator at {address} refused this node: {verdict['error']}")
        sock.settimeout(None)
        return sock
    except BaseException:
        sock.close()
        raise


def accept(sock: ssl.SSLSocket, key: SwarmKey, pin: str, judge: Any) -> dict[str, Any]:
    """The coordinator's side of the handshake on an accepted TLS connection: the node's hello once both are
    proven. `judge(hello)` says why a proven node is refused ("" to take it). LinkError or LinkRefused
    otherwise (the node has been told why when it was refused)."""
    secret = join_secret(key)
    hello = read_message(sock)
    if hello.get("v") != LINK_VERSION or hello.get("kind") not in KINDS:
        send_message(sock, {"error": "another swarm version; run one swarm version on every device"})
        raise LinkRefused(f"a node of another link version ({hello.get('v')!r}) or kind")
    theirs = _hex(hello, "nonce", 32)
    nonce = secrets.token_hex(16)
    send_message(sock, {"nonce": nonce, "proof": _proof(secret, b"coordinator", theirs, nonce, pin)})
    answer = read_message(sock)
    if not hmac.compare_digest(_hex(answer, "proof", 64), _proof(secret, b"node", nonce, theirs, pin)):
        send_message(
            sock,
            {"error": "this node's invite is of another swarm key; ask this coordinator for an invite (`swarm invite`)"},
        )
        raise LinkRefused("a node that cannot prove the swarm key (an invite of another swarm)")
    why = judge(hello)
    if why:
        send_message(sock, {"error": why})
        raise LinkRefused(why)
    send_message(sock, {"ok": True})
    return hello


def shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


def relay(a: socket.socket, b: socket.socket, name: str) -> None:
    """Copy bytes both ways between a and b until either end closes; then both are closed. Two threads."""

    def copy(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            shut(src)
            shut(dst)

    threading.Thread(target=copy, args=(a, b), name=f"{name}-up", daemon=True).start()
    threading.Thread(target=copy, args=(b, a), name=f"{name}-down", daemon=True).start()


class Control:
    """A link's control connection, either end: messages sent from any thread (one at a time), and read by
    `keep` on one thread that also pings every quarter of the link timeout. Reads and writes never overlap:
    an SSL object is not safe to read and write from two threads at once."""

    def __init__(self, sock: ssl.SSLSocket, timeout: float) -> None:
        self.sock, self.timeout = sock, timeout
        self._lock = threading.Lock()
        sock.settimeout(max(CONNECT_SECONDS, timeout / 2))  # what one message may take once begun (either way)

    def send(self, message: dict[str, Any]) -> None:
        with self._lock:
            send_message(self.sock, message)

    def keep(self, on_message: Callable[[dict[str, Any]], None], stop: Callable[[], bool]) -> str:
        """Read messages into `on_message` until the link is lost (or `stop()`); why it ended."""
        every = self.timeout / 4
        heard = pinged = time.monotonic()
        poll = select.poll()
        poll.register(self.sock, select.POLLIN)
        try:
            while not stop():
                now = time.monotonic()
                if now - pinged >= every:
                    self.send({"t": "ping"})
                    pinged = now
                if now - heard > self.timeout:
                    return f"nothing heard for {self.timeout:g} s"
                ready = self.sock.pending() > 0 or bool(poll.poll(math.ceil(every * 1000 / 2)))
                if ready:
                    with self._lock:
                        message = read_message(self.sock)
                    heard = time.monotonic()
                    on_message(message)
        except (LinkError, OSError, ValueError) as e:
            return str(e) or type(e).__name__
        return "closed"
