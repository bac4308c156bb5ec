"""Finding nodes by mDNS / DNS-SD (zeroconf): the node's advertiser and the coordinator's browser.

A node registers one service of type SERVICE_TYPE whose TXT record carries what a coordinator needs to
place work before it ever connects: model fingerprint, source GGUF header hash (key "src", see
swarm.sharding.identity; absent from older nodes), protocol version, width D, capacity (memory budget,
workers), device and the held slabs. The slab set is packed as msgpack groups of
(layer ranges, expert ranges), base64url-encoded and split over TXT keys s0, s1, ... (a TXT string is
at most 255 bytes); "experts 0-63 of layers 0-39" is a dozen bytes.

    with browse(identity=identity_of("model.swarm"), interfaces=["127.0.0.1"]) as browser:
        browser.wait_for(lambda nodes: len(nodes) >= 3, timeout=5)
        for node in browser.nodes(): ...  # DiscoveredNode(address="127.0.0.1:50051", held=..., ...)

Where multicast does not reach, a coordinator uses a static host:port list instead (NodeClient works
with any address).
"""

from __future__ import annotations

import base64
import ipaddress
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import msgpack
from zeroconf import IPVersion, ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf

from swarm.node.auth import SwarmKey, is_loopback_host
from swarm.proto.channel import PROTOCOL_VERSION
from swarm.proto.codec import group_slabs, ungroup_slabs
from swarm.sharding.identity import ModelIdentity
from swarm.sharding.slabs import SlabKey

log = logging.getLogger(__name__)

SERVICE_TYPE = "_swarm-moe._tcp.local."
TXT_CHUNK = 200  # characters of packed slab set per TXT key; keeps key=value under 255 bytes
MAX_TXT_CHUNKS = 200  # refuse silly-large slab sets rather than send a huge record
# Once a browser has its first answers, how long to keep listening for the other nodes' answers to the same
# query (mDNS responders wait 20-120 ms at random, and a busy device answers later): the replicas a
# coordinator's failover needs, the further sources a fetch can draw from.
MDNS_SETTLE_SECONDS = 0.5


def _flat(ranges: Iterable[tuple[int, int]]) -> list[int]:
    return [x for r in ranges for x in r]


def _pairs(flat: Sequence[int]) -> list[tuple[int, int]]:
    if len(flat) % 2:
        raise ValueError("odd-length range list")
    return [(int(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2)]


def pack_slabs(keys: Iterable[SlabKey]) -> list[str]:
    """A slab set as TXT-sized chunks of base64url(msgpack([[layer ranges], [expert ranges]], ...))."""
    groups = [[_flat(layers), _flat(experts)] for layers, experts in group_slabs(keys)]
    text = base64.urlsafe_b64encode(msgpack.packb(groups)).decode("ascii").rstrip("=")
    chunks = [text[i : i + TXT_CHUNK] for i in range(0, len(text), TXT_CHUNK)] or [""]
    if len(chunks) > MAX_TXT_CHUNKS:
        raise ValueError(f"slab set too scattered to advertise ({len(text)} bytes packed)")
    return chunks


def unpack_slabs(chunks: Sequence[str]) -> set[SlabKey]:
    text = "".join(chunks)
    if not text:
        return set()
    raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    groups = msgpack.unpackb(raw)
    return ungroup_slabs((_pairs(g[0]), _pairs(g[1])) for g in groups)


@dataclass(frozen=True)
class DiscoveredNode:
    """A node as its mDNS record describes it. `address` is "host:port", ready for NodeClient."""

    name: str
    host: str
    port: int
    fingerprint: str
    protocol_version: int
    held: frozenset[SlabKey]
    hidden_size: int
    memory_budget_bytes: int
    workers: int
    device: str
    source_sha256: str = ""
    key_id: str = ""  # key_id() of the node's swarm key; "" when it has none
    tls: bool = False  # the node serves TLS (with its swarm key's identity)
    serves_files: bool = False  # it gives out manifest.json and its held slabs' files (Fetch)
    stream_port: int = 0  # its compute stream's port (swarm.node.streams); 0: none
    numerics_class: str = ""  # its ggml build's numerics class (swarm.compute.numclass); "": not said
    # A joined node's compute stream connections, asked of it over its link (swarm.node.join): dial(timeout)
    # gives a connected socket; None: the stream is reached at host:stream_port
    dial: Callable[[float | None], socket.socket] | None = field(default=None, compare=False, repr=False)

    @property
    def identity(self) -> ModelIdentity:
        return ModelIdentity(self.fingerprint, self.source_sha256)

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def wait_for_nodes(
    cond: threading.Condition,
    nodes: Callable[[], list[DiscoveredNode]],
    predicate: Callable[[list[DiscoveredNode]], bool],
    timeout: float,
) -> list[DiscoveredNode] | None:
    """Block until predicate(nodes()) holds, woken through `cond` (notified on every change); the nodes
    then, or None after `timeout` seconds. A browser's wait, and the join listener's."""
    deadline = time.monotonic() + timeout
    with cond:
        while True:
            found = nodes()
            if predicate(found):
                return found
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            cond.wait(left)


class AnySwarm:
    """The type of ANY_SWARM: a browser that lists the nodes of every swarm key."""


ANY_SWARM = AnySwarm()


def key_id(key: SwarmKey | None) -> str:
    """What a node's record says about its swarm: the key's public id ("" for no key).

    Two swarms of one model can share a network (two households, two teams); the coordinator takes only the
    nodes of its own key instead of calling the others and being refused."""
    return key.id if key is not None else ""


def node_properties(
    fingerprint: str,
    held: Iterable[SlabKey],
    hidden_size: int,
    memory_budget_bytes: int,
    workers: int,
    device: str,
    source_sha256: str = "",
    key: SwarmKey | None = None,
    tls: bool = False,
    serves_files: bool = False,
    stream_port: int = 0,
    numerics_class: str = "",
) -> dict[str, str]:
    chunks = pack_slabs(held)
    props = {
        "fp": fingerprint,
        "pv": str(PROTOCOL_VERSION),
        "d": str(hidden_size),
        "mem": str(memory_budget_bytes),
        "w": str(workers),
        "dev": device,
        "sn": str(len(chunks)),
    }
    if source_sha256:
        props["src"] = source_sha256
    if key is not None:
        props["kid"] = key_id(key)
    if tls:
        props["tls"] = "1"
    if serves_files:
        props["fs"] = "1"  # gives out manifest.json and its held slabs' files (Fetch)
    if stream_port:
        props["cs"] = str(stream_port)  # its compute stream
    if numerics_class:
        props["nc"] = numerics_class
    props.update({f"s{i}": c for i, c in enumerate(chunks)})
    return props


def _text(props: dict[bytes, bytes | None], key: str, default: str = "") -> str:
    v = props.get(key.encode())
    return v.decode("utf-8", "replace") if v is not None else default


def parse_service(info: ServiceInfo) -> DiscoveredNode:
    """A resolved service record -> DiscoveredNode (ValueError when it is not one of ours)."""
    props = info.properties or {}
    n = int(_text(props, "sn", "0"))
    held = unpack_slabs([_text(props, f"s{i}") for i in range(n)])
    addresses = info.parsed_scoped_addresses(IPVersion.V4Only) or info.parsed_scoped_addresses()
    if not addresses or not info.port:
        raise ValueError(f"{info.name}: no address or port")
    return DiscoveredNode(
        name=info.name,
        host=addresses[0],
        port=int(info.port),
        fingerprint=_text(props, "fp"),
        protocol_version=int(_text(props, "pv", "0")),
        held=frozenset(held),
        hidden_size=int(_text(props, "d", "0")),
        memory_budget_bytes=int(_text(props, "mem", "0")),
        workers=int(_text(props, "w", "0")),
        device=_text(props, "dev"),
        source_sha256=_text(props, "src"),
        key_id=_text(props, "kid"),
        tls=_text(props, "tls") == "1",
        serves_files=_text(props, "fs") == "1",
        stream_port=int(_text(props, "cs", "0")),
        numerics_class=_text(props, "nc"),
    )


def _is_wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::", "[::]")


def default_mdns_interfaces(host: str) -> list[str] | None:
    """Where to advertise for a node listening on `host`: loopback stays on loopback, a specific address on
    its own interface, a wildcard everywhere (None = all interfaces)."""
    if _is_wildcard(host):
        return None
    if is_loopback_host(host):
        return ["127.0.0.1"]
    try:
        return [str(ipaddress.ip_address(host.strip("[]")))]
    except ValueError:  # a host name: resolve it once
        return [socket.gethostbyname(host)]


def _local_ipv4_addresses() -> list[str]:
    import ifaddr  # a zeroconf dependency

    out = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str) and not ipaddress.ip_address(ip.ip).is_loopback:
                out.append(ip.ip)
    return out or ["127.0.0.1"]


def _zeroconf(interfaces: Sequence[str] | None) -> Zeroconf:
    if interfaces is None:
        return Zeroconf()
    return Zeroconf(interfaces=list(interfaces))


class Advertiser:
    """A node's mDNS registration; `close()` sends the goodbye (TTL 0) so browsers drop it at once."""

    def __init__(
        self,
        port: int,
        host: str,
        properties: dict[str, str],
        interfaces: Sequence[str] | None = None,
        name: str | None = None,
    ) -> None:
        self.interfaces = list(interfaces) if interfaces is not None else None
        if _is_wildcard(host):
            addresses = (
                _local_ipv4_addresses()
                if self.interfaces is None
                else [a for a in self.interfaces if ":" not in a]
            )
        else:
            addresses = [socket.gethostbyname(host.strip("[]")) if not is_loopback_host(host) else "127.0.0.1"]
        # A generated name carries a random suffix, so the ~1 s uniqueness probe can be skipped; a name the user
        # chose is probed and renamed ("name-2") if another node already has it.
        self._generated_name = name is None
        instance = name or f"swarm-node-{socket.gethostname().split('.')[0]}-{port}-{uuid.uuid4().hex[:6]}"
        instance = instance.replace(".", "-")[:63]
        self.info = ServiceInfo(
            SERVICE_TYPE,
            f"{instance}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(a) for a in addresses],
            port=port,
            properties=properties,
            server=f"{instance}.local.",
        )
        self._zc: Zeroconf | None = None

    def start(self) -> Advertiser:
        self._zc = _zeroconf(self.interfaces)
        if self._generated_name:
            self._zc.register_service(self.info, cooperating_responders=True)
        else:
            self._zc.register_service(self.info, allow_name_change=True)
        log.info("advertised %s on %s", self.info.name, self.interfaces or "all interfaces")
        return self

    def update(self, properties: dict[str, str]) -> None:
        """Announce new properties (a node that fetched more slabs holds more now); browsers update the node."""
        self.info = ServiceInfo(
            self.info.type,
            self.info.name,
            addresses=self.info.addresses,
            port=self.info.port,
            properties=properties,
            server=self.info.server,
        )
        if self._zc is not None:
            self._zc.update_service(self.info)

    def close(self) -> None:
        zc, self._zc = self._zc, None
        if zc is None:
            return
        try:
            zc.unregister_service(self.info)
        finally:
            zc.close()


class NodeBrowser:
    """A live view of the nodes advertised on the chosen interfaces (None = all).

    `identity` keeps the nodes of that model (whether started on its GGUF or its shard directory);
    `fingerprint` keeps only the nodes reporting exactly that fingerprint; `key` keeps the nodes of that swarm
    (None: the nodes without a key; ANY_SWARM, the default: every node).
    """

    def __init__(
        self,
        fingerprint: str | None = None,
        interfaces: Sequence[str] | None = None,
        identity: ModelIdentity | None = None,
        key: SwarmKey | None | AnySwarm = ANY_SWARM,
    ) -> None:
        self.fingerprint = fingerprint
        self.identity = identity
        self.key_id = None if isinstance(key, AnySwarm) else key_id(key)
        self._nodes: dict[str, DiscoveredNode] = {}
        self._cond = threading.Condition()
        self.version = 0  # bumped on every node found or gone: a cheap "anything new?" for pollers
        self._zc = _zeroconf(interfaces)
        self._browser = ServiceBrowser(self._zc, SERVICE_TYPE, handlers=[self._on_change])

    def _on_change(
        self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        if state_change is ServiceStateChange.Removed:
            with self._cond:
                if self._nodes.pop(name, None) is not None:
                    log.info("node left: %s", name)
                    self.version += 1
                self._cond.notify_all()
            return
        info = zeroconf.get_service_info(service_type, name, timeout=3000)
        if info is None:
            return
        try:
            node = parse_service(info)
        except (ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
            log.warning("ignoring malformed swarm node record %s: %s", name, e)
            return
        other = self._passed_over(node)
        if other:
            log.warning("passing over node %s at %s: %s", name, node.address, other)
        with self._cond:
            self._nodes[name] = node
            self.version += 1
            self._cond.notify_all()
        if not other:
            log.info("node found: %s at %s (%d slabs)", name, node.address, len(node.held))

    def _passed_over(self, node: DiscoveredNode) -> str:
        """Why `nodes()` leaves this node out ("" when it keeps it)."""
        if self.fingerprint and node.fingerprint != self.fingerprint:
            return f"it serves another model (fingerprint {node.fingerprint[:12]})"
        if self.identity is not None and self.identity.match(node.identity) is None:
            return (
                f"it serves another model (fingerprint {node.fingerprint[:12]}, "
                f"this swarm's is {self.identity.fingerprint[:12]})"
            )
        if self.key_id is not None and node.key_id != self.key_id:
            return "it belongs to another swarm (its swarm key differs)"
        return ""

    def nodes(self) -> list[DiscoveredNode]:
        """The nodes seen now (of this browser's model when it has one), sorted by address."""
        with self._cond:
            found = [n for n in self._nodes.values() if not self._passed_over(n)]
        return sorted(found, key=lambda n: (n.host, n.port))

    def wait_for(
        self, predicate: Callable[[list[DiscoveredNode]], bool], timeout: float
    ) -> list[DiscoveredNode] | None:
        """Block until predicate(nodes()) holds; the nodes then, or None after `timeout` seconds."""
        return wait_for_nodes(self._cond, self.nodes, predicate, timeout)

    def close(self) -> None:
        self._browser.cancel()
        self._zc.close()

    def __enter__(self) -> NodeBrowser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def browse(
    fingerprint: str | None = None,
    interfaces: Sequence[str] | None = None,
    identity: ModelIdentity | None = None,
    key: SwarmKey | None | AnySwarm = ANY_SWARM,
) -> NodeBrowser:
    """Start browsing for swarm nodes; interfaces=["127.0.0.1"] keeps it on loopback."""
    return NodeBrowser(fingerprint, interfaces, identity, key)
