"""The sources a fetch draws from: nodes that give out their shard files (Fetch: the manifest and the slabs
they hold, see swarm.node.files), the --peer addresses (asked by Info), the coordinator a --join link
reaches (its shard directory's files over the link, swarm.node.link_files) and the nodes mDNS finds, browsed
for as long as the fetch lasts, so that a node joining (or growing, as another fetching node does) is used
from then on. Each download goes to the least busy holder; one that keeps failing is dropped."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from swarm.node.auth import SwarmKey
from swarm.node.client import NodeClient, ask_peer
from swarm.node.errors import NodeCallError
from swarm.proto.channel import PROTOCOL_VERSION
from swarm.sharding.errors import UserError
from swarm.sharding.manifest import MANIFEST_NAME, Manifest, manifest_from_dict
from swarm.sharding.slabs import SlabKey

log = logging.getLogger(__name__)

# One Fetch call's deadline. A file that takes longer goes on in a new call from where it stopped: a slow
# link is no failure, and a source that went quiet (a phone asleep) is found out within this time.
STREAM_SECONDS = 30.0
MAX_STRIKES = 3  # a source that failed this many times in a row without sending a byte is dropped


class FileChunks(Protocol):
    """One file from a source: (offset, bytes, file size) pieces; `cancel()` from another thread. A failure
    is a NodeCallError with a Fetch status code, raised while iterating."""

    def __iter__(self) -> Iterator[tuple[int, bytes, int]]: ...

    def cancel(self) -> None: ...


class FileClient(Protocol):
    """What a fetch asks of a source: NodeClient (Fetch calls) or the coordinator's link (LinkFiles)."""

    address: str

    def fetch(self, path: str, offset: int = 0, timeout: float | None = None) -> FileChunks: ...

    def close(self) -> None: ...


@dataclass
class Source:
    """A node (or the coordinator of a --join link) that gives out shard files, and how it has fared in this
    fetch."""

    address: str
    fingerprint: str
    held: frozenset[SlabKey]
    tls: bool | None = None  # None: NodeClient's default (TLS off loopback when there is a key)
    order: int = 0  # the order it was found in: --peer order first, ties are broken by it
    busy: int = 0  # downloads from it now
    strikes: int = 0  # failures in a row
    client: FileClient | None = None
    manifest: bytes | None = None  # its manifest.json, when it was read to find what the source holds


class Sources:
    """The sources a fetch may use: static peers (their Info), the coordinator of a --join `link`, and, unless
    `interfaces` is False, the nodes that mDNS finds on those interfaces (None: all), of this swarm key.
    Thread-safe."""

    def __init__(
        self,
        key: SwarmKey | None,
        peers: Sequence[str] = (),
        interfaces: Sequence[str] | None | bool = None,
        link: FileClient | None = None,
    ) -> None:
        self.key = key
        self.peers = list(dict.fromkeys(peers))
        self.link = link  # the coordinator a --join link reaches (swarm.node.link_files)
        self.link_error = ""  # why the link gives no files, when it gives none
        self.fingerprint = ""  # once set, sources of other models are left out
        self._mdns = interfaces is not False
        self._interfaces = None if interfaces is None or isinstance(interfaces, bool) else list(interfaces)
        self._sources: dict[str, Source] = {}
        self._lock = threading.Lock()
        self._browser = None
        self._browser_version = -1
        self._exclude: set[str] = set()

    # ---- finding them ----

    def discover(self, wait: float) -> None:
        """Ask the peers and the link's coordinator, start browsing mDNS, and wait up to `wait` s for a first
        source there."""
        for address in self.peers:
            self._add_peer(address)
        if self.link is not None:
            self._add_link(self.link)
        if self._mdns:
            from swarm.node.discovery import MDNS_SETTLE_SECONDS, browse

            self._browser = browse(interfaces=self._interfaces, key=self.key)
            if not self.all() and self.wait_for(lambda found: bool(found), wait):
                time.sleep(min(MDNS_SETTLE_SECONDS, wait))
            self._refresh()

    def _add_peer(self, address: str) -> None:
        try:
            client, info = ask_peer(address, self.key)
        except NodeCallError as e:
            log.warning("peer %s does not answer (%s); fetching from the other sources", address, e.code.name)
            return
        why = self._unusable(info.serves_files, info.protocol_version)
        if why:
            client.close()
            log.warning("passing over peer %s: %s", address, why)
            return
        client.fingerprint = info.fingerprint
        with self._lock:
            self._sources[address] = Source(
                address, info.fingerprint, info.held, order=len(self._sources), client=client
            )

    def _add_link(self, link: FileClient) -> None:
        """The coordinator as a source: it holds every slab of its manifest (read whole here, and kept for the
        directory: a node that dialed out may reach nothing else)."""
        address = link.address
        try:
            data = read_whole(link, MANIFEST_NAME)
            manifest = parse_manifest(data, address)
        except (NodeCallError, ValueError, UserError) as e:
            why = e.details if isinstance(e, NodeCallError) else str(e)
            self.link_error = f"--fetch: no files from the {address}: {why}"  # the fetch says it
            return
        held = frozenset((e.layer, e.expert) for e in manifest.slabs)
        with self._lock:
            self._sources[address] = Source(
                address, manifest.fingerprint, held, order=len(self._sources), client=link, manifest=data
            )

    @staticmethod
    def _unusable(serves_files: bool, protocol_version: int) -> str:
        if protocol_version != PROTOCOL_VERSION:
            return (
                f"it speaks protocol {protocol_version}, this node {PROTOCOL_VERSION}; run one swarm version"
            )
        if not serves_files:
            return "it serves a whole GGUF or unverified slabs, and gives out no files"
        return ""

    def _refresh(self) -> None:
        """Take in what mDNS has found since the last look (new sources, grown slab sets)."""
        b = self._browser
        if b is None or b.version == self._browser_version:
            return
        with self._lock:
            self._browser_version = b.version
            for n in b.nodes():
                if n.address in self._exclude or self._unusable(n.serves_files, n.protocol_version):
                    continue
                s = self._sources.get(n.address)
                if s is None:
                    self._sources[n.address] = Source(
                        n.address, n.fingerprint, n.held, tls=n.tls, order=len(self._sources)
                    )
                    log.info("fetch source found: %s (%d slabs)", n.address, len(n.held))
                elif n.fingerprint == s.fingerprint:
                    s.held = n.held

    def exclude(self, address: str) -> None:
        """Never fetch from this address (the node's own)."""
        with self._lock:
            self._exclude.add(address)
            self._sources.pop(address, None)

    def all(self) -> list[Source]:
        """The usable sources now (of `fingerprint`, once it is set), in the order they were found."""
        self._refresh()
        with self._lock:
            found = [
                s
                for s in self._sources.values()
                if s.strikes < MAX_STRIKES and (not self.fingerprint or s.fingerprint == self.fingerprint)
            ]
        return sorted(found, key=lambda s: s.order)

    def wait_for(self, predicate: Callable[[list[Source]], bool], timeout: float) -> bool:
        """Whether predicate(all()) came to hold within `timeout` s (mDNS may still be finding sources)."""
        deadline = time.monotonic() + timeout
        while not predicate(self.all()):
            if self._browser is None or time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        return True

    def holders(self, key: SlabKey) -> list[Source]:
        return [s for s in self.all() if key in s.held]

    # ---- using them ----

    def client(self, s: Source) -> FileClient:
        with self._lock:
            if s.client is None:
                s.client = NodeClient(s.address, fingerprint=s.fingerprint, key=self.key, tls=s.tls)
            return s.client

    def pick(self, key: SlabKey, avoid: Iterable[str]) -> Source | None:
        """The least busy usable holder of `key` not in `avoid` (marked busy: give it back with `release`)."""
        avoid = set(avoid)
        candidates = [s for s in self.holders(key) if s.address not in avoid]
        if not candidates:
            return None
        with self._lock:
            s = min(candidates, key=lambda s: (s.busy, s.strikes, s.order))
            s.busy += 1
            return s

    def release(self, s: Source, failed: bool) -> None:
        with self._lock:
            s.busy -= 1
            s.strikes = s.strikes + 1 if failed else 0

    def close(self) -> None:
        if self._browser is not None:
            self._browser.close()
        with self._lock:
            for s in self._sources.values():
                if s.client is not None:
                    s.client.close()


def read_whole(client: FileClient, path: str) -> bytes:
    """A whole (small) file from a source: the manifest. NodeCallError or ValueError when it cannot be had."""
    data = bytearray()
    for offset, chunk, size in client.fetch(path, timeout=STREAM_SECONDS):
        if offset != len(data) or offset + len(chunk) > size:
            raise ValueError(f"sent bytes at {offset} when {len(data)} were expected")
        data += chunk
    return bytes(data)


def parse_manifest(data: bytes, where: str) -> Manifest:
    """A manifest.json a source sent; ValueError or UserError when it is not one."""
    try:
        d = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"sent a damaged {MANIFEST_NAME} ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"sent a {MANIFEST_NAME} that is not a swarm manifest")
    return manifest_from_dict(d, f"{MANIFEST_NAME} from {where}")
