"""Nodes that join: the coordinator's listener for nodes that dial out (`swarm node --join`), and the
mDNS browser and it seen as one source of nodes by the backend.

A joined node is a node like any other to the backend: `JoinListener` lists it as a DiscoveredNode whose
address is a loopback port of this process, relayed over the node's link to the node's own gRPC server
(Info, Stats, health, the probes' and audits' addresses and names), and whose compute stream connections are
dialed by asking the node for them (`dial`): the node opens a "stream" connection and answers Compute frames
on it as on its compute stream, so that the decode path's calls pay nothing for the reversed direction (no
relay, no extra hop). Placement, replicas, failover, hedging, answer checks and metrics see an address.

A node that fetches its slabs (`swarm node DIR --fetch --join`) gets them from here too, over "files"
connections (swarm.node.link_files: the manifest and slab files of the shard directory this coordinator runs
on), and tells its link when the slabs it serves change: the node's record is read again (Info), and the
backend takes the slabs in as it takes an mDNS node's new announcement.

A node whose link is lost is gone (the backend's follow_mdns removes it, and its calls in flight fail over:
their connections are closed here); one that dials back under the same node id keeps its address, so the
backend's client, pace and counters carry on.
"""

from __future__ import annotations

import itertools
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarm.node.auth import SwarmKey
from swarm.node.client import NodeClient
from swarm.node.discovery import DiscoveredNode, key_id, wait_for_nodes
from swarm.node.invite import JOIN_PORT, cert_pin
from swarm.node.link import (
    CONNECT_SECONDS,
    LINK_TIMEOUT,
    Control,
    LinkError,
    LinkRefused,
    accept,
    relay,
    server_context,
    set_nodelay,
    shut,
)
from swarm.node.link_files import CoordinatorFiles
from swarm.sharding.errors import UserError
from swarm.sharding.identity import ModelIdentity

log = logging.getLogger(__name__)

HANDSHAKES = 64  # connections proving themselves at once; more are closed unread (a flood takes no threads)
OPEN_SECONDS = 10.0  # how long a requested connection may take to arrive
FORGET_SECONDS = 600.0  # a node whose link has been lost this long is forgotten when another joins


def parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep:
        host, port = listen, str(JOIN_PORT)
    if not port.isdigit():
        raise UserError(f"--listen {listen!r}: give HOST:PORT (e.g. 0.0.0.0:{JOIN_PORT})")
    return host.strip("[]") or "0.0.0.0", int(port)


@dataclass
class _Link:
    control: Control
    remote: str  # the node's address as this end sees it (after NAT)
    socks: set[socket.socket] = field(default_factory=set)
    lost: bool = False
    lost_at: float = 0.0

    def close(self) -> None:
        if not self.lost:
            self.lost_at = time.monotonic()
        self.lost = True
        for s in [self.control.sock, *self.socks]:
            shut(s)


class _Joined:
    """One node (by its node id) across its links: its gateway port and, while linked, its record."""

    def __init__(self, owner: JoinListener, node_id: str, name: str) -> None:
        self.owner, self.node_id, self.name = owner, node_id, name
        self.link: _Link | None = None
        self.record: DiscoveredNode | None = None
        self._counter = itertools.count(1)
        self._waiting: dict[int, tuple[threading.Event, list[socket.socket]]] = {}
        self._lock = threading.Lock()
        self.reading = self.read_again = False  # its record is being read again (Info); and once more after
        self.gateway = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.gateway.getsockname()[1]
        threading.Thread(target=self._gateway, name=f"swarm-join-gw-{node_id}", daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def dial(self, kind: str, timeout: float | None) -> socket.socket:
        """A new connection of `kind` from the node, asked for over its link (OSError when it does not come)."""
        link = self.link
        if link is None or link.lost:
            raise ConnectionRefusedError(f"node {self.name} has no link now (it dials back when it can)")
        conn = next(self._counter)
        slot: tuple[threading.Event, list[socket.socket]] = (threading.Event(), [])
        with self._lock:
            self._waiting[conn] = slot
        try:
            link.control.send({"t": "open", "kind": kind, "conn": conn})
            if not slot[0].wait(OPEN_SECONDS if timeout is None else max(timeout, 1.0)):
                raise TimeoutError(f"node {self.name} did not open a {kind} connection in time")
        finally:
            with self._lock:
                self._waiting.pop(conn, None)
        sock = slot[1][0]
        link.socks.add(sock)
        if link.lost:
            shut(sock)
            raise ConnectionResetError(f"the link to node {self.name} was lost")
        return sock

    def arrived(self, conn: Any, sock: socket.socket) -> bool:
        with self._lock:
            slot = self._waiting.get(conn) if isinstance(conn, int) else None
            if slot is None or slot[1]:
                return False
            slot[1].append(sock)
        slot[0].set()
        return True

    def _gateway(self) -> None:
        """Local connections to the gateway port (the backend's gRPC channel) relayed over the link."""
        while True:
            try:
                local, _ = self.gateway.accept()
            except OSError:
                return
            try:
                remote = self.dial("grpc", OPEN_SECONDS)
            except OSError as e:
                log.debug("node %s: no gRPC connection over its link (%s)", self.name, e)
                shut(local)
                continue
            remote.settimeout(None)
            relay(local, remote, f"swarm-join-relay-{self.node_id}")

    def close(self) -> None:
        shut(self.gateway)
        if self.link is not None:
            self.link.close()


class JoinListener:
    """Takes nodes of `identity` that join on `listen` ("host:port") and prove `key`; follows their links,
    and gives fetching nodes the files of `files` (the shard directory the coordinator runs on; a GGUF or None:
    none). Read by the backend as a browser: `version` (bumped on every join, loss and change of a node's
    slabs), `nodes()`, `wait_for`."""

    def __init__(
        self,
        listen: str,
        key: SwarmKey | None,
        identity: ModelIdentity,
        link_timeout: float = LINK_TIMEOUT,
        files: str | Path | None = None,
    ) -> None:
        if key is None:
            raise UserError(
                "--listen takes nodes that prove the swarm key: give --key-file (`swarm keygen` makes one)"
            )
        self.key, self.identity, self.link_timeout = key, identity, link_timeout
        host, port = parse_listen(listen)
        try:
            self._listener = socket.create_server((host, port), reuse_port=False)
        except OSError as e:
            raise UserError(f"cannot listen on {host}:{port} for joining nodes ({e}); pick another --listen") from e
        self.port: int = self._listener.getsockname()[1]
        self._tls = server_context(key)
        self._files = CoordinatorFiles(files)
        self._pin = cert_pin(key)
        self._cond = threading.Condition()
        self._nodes: dict[str, _Joined] = {}
        self._handshakes = threading.BoundedSemaphore(HANDSHAKES)
        self.version = 0
        self.closed = False
        self.refused = 0  # connections refused or broken before they were proven (for tests and logs)
        threading.Thread(target=self._accept, name="swarm-join-accept", daemon=True).start()

    def nodes(self) -> list[DiscoveredNode]:
        with self._cond:
            return [j.record for j in self._nodes.values() if j.record is not None]

    def wait_for(
        self, predicate: Callable[[list[DiscoveredNode]], bool], timeout: float
    ) -> list[DiscoveredNode] | None:
        return wait_for_nodes(self._cond, self.nodes, predicate, timeout)

    def close(self) -> None:
        self.closed = True
        shut(self._listener)
        with self._cond:
            joined, self._nodes = list(self._nodes.values()), {}
            self.version += 1
        for j in joined:
            j.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, where = self._listener.accept()
            except OSError:
                return
            if not self._handshakes.acquire(blocking=False):
                shut(conn)
                self.refused += 1
                continue
            threading.Thread(target=self._prove, args=(conn, where[0]), daemon=True).start()

    def _judge(self, hello: dict[str, Any]) -> str:
        node = hello.get("node")
        if not isinstance(node, str) or len(node) != 16:
            return "a hello without a node id; run one swarm version on every device"
        theirs = ModelIdentity(str(hello.get("fingerprint", "")), str(hello.get("source_sha256", "")))
        if hello.get("kind") == "files":
            return self._judge_fetch(theirs)
        if self.identity.match(theirs) is None:
            return (
                f"this coordinator runs model {self.identity.fingerprint[:16]}..., the node holds "
                f"{theirs.fingerprint[:16]}...; start the node on the coordinator's model"
            )
        return ""

    def _judge_fetch(self, theirs: ModelIdentity) -> str:
        """A fetching node names its model by what it knows before it has a manifest: the invite's prefixes
        of the fingerprint and the source GGUF's header hash, a directory's manifest, or nothing (a holder of
        the key that takes this coordinator's model)."""
        ours, fp, src = self.identity, theirs.fingerprint, theirs.source_sha256
        if (not fp and not src) or (fp and ours.fingerprint.startswith(fp)):
            return ""
        if src and ours.source_sha256.startswith(src):
            return ""
        return (
            f"this coordinator runs model {ours.fingerprint[:16]}..., the node fetches {fp[:16]}... (an invite "
            "or a directory of another model); ask for a new invite, or give --fetch an empty directory"
        )

    def _prove(self, conn: socket.socket, remote: str) -> None:
        try:
            set_nodelay(conn)
            conn.settimeout(CONNECT_SECONDS)
            sock = self._tls.wrap_socket(conn, server_side=True)
            hello = accept(sock, self.key, self._pin, self._judge)
        except (OSError, LinkError, LinkRefused, ValueError) as e:
            self.refused += 1
            log.debug("a joining connection from %s was refused: %s", remote, e)
            shut(conn)
            return
        finally:
            self._handshakes.release()
        if hello["kind"] == "control":
            self._linked(sock, hello, remote)
            return
        if hello["kind"] == "files":
            self._files.serve(sock)
            return
        with self._cond:
            joined = self._nodes.get(hello["node"])
        if joined is None or not joined.arrived(hello.get("conn"), sock):
            shut(sock)  # nobody asked for it (late, or a node's stale connection)

    def _linked(self, control: ssl.SSLSocket, hello: dict[str, Any], remote: str) -> None:
        """A node's new control connection: its link (an older one dropped), its record once it answers Info,
        and the link kept until it is lost."""
        node_id, name = hello["node"], str(hello.get("name") or hello["node"])[:64]
        with self._cond:
            self._forget(time.monotonic() - FORGET_SECONDS)
            joined = self._nodes.get(node_id)
            if joined is None:
                joined = self._nodes[node_id] = _Joined(self, node_id, name)
            timeout = hello.get("timeout")
            timeout = min(self.link_timeout, max(1.0, timeout)) if isinstance(timeout, (int, float)) else self.link_timeout
            old, joined.link = joined.link, _Link(Control(control, timeout), remote)
            link = joined.link
        if old is not None:
            old.close()  # the calls on it fail over; the new link takes the next ones
        log.info("node %s joined from %s (as %s)", name, remote, joined.address)
        try:
            record = self._record(joined)
        except Exception as e:  # noqa: BLE001 - a node whose Info fails is not taken; it may dial again
            log.warning("node %s joined but does not answer Info (%s); dropping its link", name, e)
            link.close()
            return
        with self._cond:
            if joined.link is link and not link.lost:
                joined.record = record
                self.version += 1
                self._cond.notify_all()
        self._keep(joined, link)

    def _forget(self, before: float) -> None:
        """Drop the nodes whose link was lost before `before` (a node process that ended gives no goodbye): a
        gateway port and a thread each otherwise. One that dials back later is a new node."""
        for node_id, j in list(self._nodes.items()):
            if j.link is not None and j.link.lost and j.link.lost_at < before:
                del self._nodes[node_id]
                j.close()

    def _record(self, joined: _Joined) -> DiscoveredNode:
        client = NodeClient(joined.address, key=self.key)
        try:
            info = client.info(timeout=OPEN_SECONDS)
        finally:
            client.close()
        return DiscoveredNode(
            name=info.name or joined.name,
            host="127.0.0.1",
            port=joined.port,
            fingerprint=info.fingerprint,
            protocol_version=info.protocol_version,
            held=info.held,
            hidden_size=info.hidden_size,
            memory_budget_bytes=info.memory_budget_bytes,
            workers=info.workers,
            device=info.device,
            source_sha256=info.source_sha256,
            key_id=key_id(self.key),
            serves_files=info.serves_files,
            numerics_class=info.numerics_class,
            dial=lambda timeout: joined.dial("stream", timeout),
        )

    def _keep(self, joined: _Joined, link: _Link) -> None:
        """Read the control connection until the link is lost; then the node is gone until it dials back."""

        def on_message(message: dict[str, Any]) -> None:
            if message.get("t") == "held":
                self._read_again(joined, link)
            # pings say only that the link is alive

        why = link.control.keep(on_message, lambda: link.lost)
        with self._cond:
            current = joined.link is link
            if current:
                joined.record = None
                self.version += 1
                self._cond.notify_all()
        link.close()
        if current and not self.closed:
            log.warning(
                "node %s: its link was lost (%s); its calls go to other holders until it dials back",
                joined.name,
                why,
            )

    def _read_again(self, joined: _Joined, link: _Link) -> None:
        """The node's slabs changed: its record read again (Info, over the link) on a thread of its own, not
        on the one reading the link (which must go on answering pings); one read a node at a time, and one
        more after it when the node said so again meanwhile."""
        with joined._lock:
            if joined.reading:
                joined.read_again = True
                return
            joined.reading = True

        def run() -> None:
            while True:
                try:
                    record = self._record(joined)
                except Exception as e:  # noqa: BLE001 - the old record stands; the node says so again later
                    log.warning("node %s: reading its slabs again failed (%s)", joined.name, e)
                    record = None
                with self._cond:
                    if record is not None and joined.link is link and not link.lost:
                        joined.record = record
                        self.version += 1
                        self._cond.notify_all()
                with joined._lock:
                    if not joined.read_again:
                        joined.reading = False
                        return
                    joined.read_again = False

        threading.Thread(target=run, name=f"swarm-join-read-{joined.node_id}", daemon=True).start()


class Sources:
    """The mDNS browser and the join listener read as one browser (either may be None)."""

    def __init__(self, *browsers: Any) -> None:
        self.browsers = [b for b in browsers if b is not None]

    @property
    def version(self) -> int:
        return sum(b.version for b in self.browsers)

    def nodes(self) -> list[DiscoveredNode]:
        return [n for b in self.browsers for n in b.nodes()]

    def wait_for(
        self, predicate: Callable[[list[DiscoveredNode]], bool], timeout: float
    ) -> list[DiscoveredNode] | None:
        deadline = time.monotonic() + timeout
        while True:
            nodes = self.nodes()
            if predicate(nodes):
                return nodes
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def close(self) -> None:
        for b in self.browsers:
            b.close()
