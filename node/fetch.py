"""`swarm node DIR --fetch`: a node that starts empty and fetches its slabs from the swarm.

    sources = Sources(key, peers=["10.0.0.5:7000"], interfaces=["10.0.0.7"])  # static peers and/or mDNS
    sources.discover(wait=3.0)
    manifest = ensure_manifest(directory, sources, fingerprint=None)  # manifest.json first, atomically
    job = plan_fetch(directory, manifest, wanted)  # what is here and verifies, what is to fetch
    result = Fetcher(directory, sources, stop, parallel=4).run(job.to_fetch, on_verified=...)

Sources are the nodes that give out their shard files (Fetch: the manifest and the slabs they hold, see
swarm.node.files): the --peer addresses (asked by Info) and the nodes mDNS finds, browsed for as long as the
fetch lasts, so that a node joining (or growing, as another fetching node does) is used from then on.

Each slab is streamed into `<slab>.gguf.part`, appended chunk by chunk, so an interrupted fetch (Ctrl-C, a
crash, a reboot) resumes from the partial file's length next time. A source that fails mid-file is left for
another holder, which continues from the same byte. A complete file is hashed against the manifest (header
and data, every byte) and only then renamed into place and handed to `on_verified`, so a file under its
final name always verifies; a file that does not is discarded and fetched again from a holder that did not
send it. A few downloads run at once, spread over the holders by how busy each is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from swarm.node.auth import SwarmKey
from swarm.node.client import FileStream, NodeCallError, NodeClient, ask_peer
from swarm.proto.channel import PROTOCOL_VERSION
from swarm.proto.codec import SlabKey
from swarm.sharding.errors import UserError
from swarm.sharding.manifest import (
    MANIFEST_NAME,
    Manifest,
    SlabEntry,
    atomic_write_bytes,
    fsync_dir,
    manifest_from_dict,
    read_manifest,
)
from swarm.sharding.ranges import format_slabs
from swarm.sharding.slabs import check_slab_file

log = logging.getLogger(__name__)

PART_SUFFIX = ".part"
# One Fetch call's deadline. A file that takes longer goes on in a new call from where it stopped: a slow
# link is no failure, and a source that went quiet (a phone asleep) is found out within this time.
STREAM_SECONDS = 30.0
MAX_STRIKES = 3  # a source that failed this many times in a row without sending a byte is dropped
MDNS_SETTLE_SECONDS = 0.5  # other sources answer the same mDNS query within a few hundred ms

# Codes after which a source will not give this slab (it does not hold it, or holds another model's).
_NOT_THERE = (
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
)


@dataclass
class Source:
    """A node that gives out shard files, and how it has fared in this fetch."""

    address: str
    fingerprint: str
    held: frozenset[SlabKey]
    tls: bool | None = None  # None: NodeClient's default (TLS off loopback when there is a key)
    order: int = 0  # the order it was found in: --peer order first, ties are broken by it
    busy: int = 0  # downloads from it now
    strikes: int = 0  # failures in a row
    client: NodeClient | None = None


class Sources:
    """The sources a fetch may use: static peers (their Info) and, unless `interfaces` is False, the nodes
    that mDNS finds on those interfaces (None: all), of this swarm key. Thread-safe."""

    def __init__(
        self,
        key: SwarmKey | None,
        peers: Sequence[str] = (),
        interfaces: Sequence[str] | None | bool = None,
    ) -> None:
        self.key = key
        self.peers = list(dict.fromkeys(peers))
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
        """Ask the peers, start browsing mDNS, and wait up to `wait` s for a first source there."""
        for address in self.peers:
            self._add_peer(address)
        if self._mdns:
            from swarm.node.discovery import browse

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

    def client(self, s: Source) -> NodeClient:
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


# ---- the shard directory and its manifest ----


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Hold the directory for one fetching node (a second one would write the same partial files)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise UserError(f"{directory}: another `swarm node --fetch` is fetching into it") from None
        yield
    finally:
        os.close(fd)


def local_manifest(directory: Path) -> Manifest | None:
    """The manifest already in `directory` (an earlier fetch, or a copy); None for an empty directory."""
    if directory.exists() and not directory.is_dir():
        raise UserError(f"{directory}: not a directory; --fetch fills a directory (give an empty one)")
    if (directory / MANIFEST_NAME).exists():
        return read_manifest(directory)
    # a manifest.json.tmp-PID is what an interrupted atomic write of the manifest leaves: not the user's
    if directory.exists() and any(
        not p.name.startswith(MANIFEST_NAME + ".tmp-") for p in directory.iterdir()
    ):
        raise UserError(
            f"{directory}: is not empty and holds no {MANIFEST_NAME}; give --fetch an empty directory "
            "(or the one an earlier --fetch filled)"
        )
    return None


def choose_model(sources: Sources, have: Manifest | None, fingerprint: str | None) -> str:
    """The fingerprint to fetch: the directory's model, else the one asked for (a prefix will do), else the
    only model the sources serve; a UserError when that is not clear or nobody serves it (with none found,
    a directory's own model stands: what it still lacks is refused later, slab by slab)."""
    found = sources.all()
    served = sorted({s.fingerprint for s in found})
    where = ", ".join(
        f"{fp[:12]} at {next(s.address for s in found if s.fingerprint == fp)}" for fp in served
    )
    if not found and have is not None and not fingerprint:
        sources.fingerprint = have.fingerprint  # nothing may be left to fetch: the job decides
        return have.fingerprint
    if not found:
        raise UserError(
            "no source found to fetch from: start `swarm node` on a shard directory (any node that holds the "
            "slabs) and give it with --peer HOST:PORT, or let mDNS find it (same swarm key, same network)"
        )
    if have is not None:
        if fingerprint and not have.fingerprint.startswith(fingerprint):
            raise UserError(
                f"the directory holds model {have.fingerprint[:12]}, not {fingerprint[:12]}; give --fetch an "
                "empty directory for another model"
            )
        want = have.fingerprint
    elif fingerprint:
        matches = [fp for fp in served if fp.startswith(fingerprint)]
        if len(matches) != 1:
            raise UserError(f"no single source model matches {fingerprint[:12]} (sources serve {where})")
        want = matches[0]
    elif len(served) > 1:
        raise UserError(
            f"the sources serve {len(served)} models ({where}); say which with --fingerprint or a --plan of it"
        )
    else:
        want = served[0]
    if want not in served:
        what = "the directory's model" if have is not None else "model"
        raise UserError(f"no source serves {what} {want[:12]} (sources serve {where})")
    sources.fingerprint = want
    return want


def ensure_manifest(directory: Path, sources: Sources, have: Manifest | None) -> Manifest:
    """The directory's manifest, fetched first (whole, checked, written atomically) when it has none."""
    if have is not None:
        return have
    candidates = sorted(sources.all(), key=lambda s: -len(s.held))  # a full shard directory's first
    errors = []
    for s in candidates:
        try:
            data = bytearray()
            for offset, chunk, size in sources.client(s).fetch(MANIFEST_NAME, timeout=STREAM_SECONDS):
                if offset != len(data) or offset + len(chunk) > size:
                    raise ValueError(f"sent bytes at {offset} when {len(data)} were expected")
                data += chunk
            manifest = _parse_manifest(bytes(data), s.address)
        except (NodeCallError, ValueError, UserError) as e:
            errors.append(f"{s.address}: {e}")
            continue
        if manifest.fingerprint != sources.fingerprint:
            errors.append(f"{s.address}: its manifest is of model {manifest.fingerprint[:12]}")
            continue
        atomic_write_bytes(directory / MANIFEST_NAME, bytes(data))
        log.info("fetched %s (%d bytes) from %s", MANIFEST_NAME, len(data), s.address)
        return manifest
    raise UserError(f"could not fetch {MANIFEST_NAME} from any source: {'; '.join(errors)}")


def _parse_manifest(data: bytes, where: str) -> Manifest:
    import json

    try:
        d = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"sent a damaged {MANIFEST_NAME} ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"sent a {MANIFEST_NAME} that is not a swarm manifest")
    return manifest_from_dict(d, f"{MANIFEST_NAME} from {where}")


@dataclass
class FetchJob:
    """What a fetch is to do in its directory: slabs here and verified, slab files to fetch, and requested
    slabs the model (or the manifest) does not have."""

    present: list[SlabEntry]
    to_fetch: list[SlabEntry]
    problems: list[str] = field(default_factory=list)


def plan_fetch(directory: Path, manifest: Manifest, wanted: Iterable[SlabKey]) -> FetchJob:
    """Sort the requested slabs into those already here (their file verifies), those to fetch, and problems."""
    job = FetchJob([], [])
    moe = set(manifest.moe_layers)
    for layer, expert in sorted(set(wanted)):
        if layer not in moe:
            job.problems.append(f"layer {layer} expert {expert}: the model has no experts in layer {layer}")
        elif expert >= manifest.n_expert:
            job.problems.append(
                f"layer {layer} expert {expert}: the model has only {manifest.n_expert} experts per layer"
            )
        elif (entry := manifest.slab(layer, expert)) is None:
            job.problems.append(
                f"layer {layer} expert {expert}: not in the manifest the sources gave (their shard directory "
                "was cut with --layers/--experts)"
            )
        elif (directory / entry.path).exists() and check_slab_file(directory, entry) is None:
            job.present.append(entry)
        else:
            job.to_fetch.append(entry)
    return job


def missing_holders(sources: Sources, entries: Iterable[SlabEntry]) -> list[SlabKey]:
    return [(e.layer, e.expert) for e in entries if not sources.holders((e.layer, e.expert))]


def wait_for_holders(sources: Sources, entries: Sequence[SlabEntry], wait: float) -> None:
    """Return once every slab to fetch has a holder among the sources; a UserError naming those without one
    after `wait` s."""
    sources.wait_for(lambda _: not missing_holders(sources, entries), wait)
    missing = missing_holders(sources, entries)
    if missing:
        raise UserError(
            f"no source holds {len(missing)} of the slabs to fetch ({format_slabs(missing)}); start a node that "
            "holds them (or give it with --peer), or ask for fewer slabs"
        )


# ---- fetching the slabs ----


class BadStream(Exception):
    """A source sent bytes that cannot be this file's (wrong size, out of order, too many)."""


@dataclass
class FetchResult:
    fetched: list[SlabKey] = field(default_factory=list)
    failed: dict[SlabKey, str] = field(default_factory=dict)
    downloaded: int = 0  # bytes received in this run
    resumed: int = 0  # bytes of partial files kept from an earlier run
    sources: set[str] = field(default_factory=set)  # the sources bytes came from
    interrupted: bool = False
    seconds: float = 0.0


class Fetcher:
    """Fetches slab files into `directory` (see the module docstring); `stop` ends it at the next chunk."""

    def __init__(
        self,
        directory: Path,
        sources: Sources,
        stop: threading.Event,
        parallel: int,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.directory = directory
        self.sources = sources
        self.stop = stop
        self.parallel = max(1, parallel)
        self.progress = progress or (lambda n: None)
        self.result = FetchResult()
        self._lock = threading.Lock()
        self._streams: set[FileStream] = set()
        self._done = threading.Event()

    def run(self, entries: Sequence[SlabEntry], on_verified: Callable[[SlabEntry], None]) -> FetchResult:
        """Fetch every entry; each is given to `on_verified` as soon as it is in place (verified)."""
        t0 = time.monotonic()
        threading.Thread(target=self._cancel_on_stop, daemon=True, name="swarm-fetch-stop").start()

        def task(entry: SlabEntry) -> None:
            key = (entry.layer, entry.expert)
            failure = self._one(entry)
            if failure is None:
                try:
                    on_verified(entry)
                except Exception as e:  # verified but cannot be opened: this slab's failure, not the fetch's
                    log.exception("slab %d:%d verified but cannot be served", *key)
                    failure = f"verified but cannot be served ({e})"
            with self._lock:
                if failure is None:
                    self.result.fetched.append(key)
                elif not self.stop.is_set():
                    self.result.failed[key] = failure

        with ThreadPoolExecutor(min(self.parallel, max(1, len(entries))), "swarm-fetch") as pool:
            list(pool.map(task, entries))
        self.result.interrupted = self.stop.is_set() and len(self.result.fetched) < len(entries)
        self.result.seconds = time.monotonic() - t0
        self._done.set()
        return self.result

    def _cancel_on_stop(self) -> None:
        """Cancel the streams in flight once `stop` is set (a stream may otherwise wait long on a slow link)."""
        while not self.stop.wait(0.2):
            if self._done.is_set():
                return
        with self._lock:
            for stream in list(self._streams):
                stream.cancel()

    def _one(self, entry: SlabEntry) -> str | None:
        """Fetch one slab file; None once it is in place and verified, else why not (one line)."""
        key = (entry.layer, entry.expert)
        final = self.directory / entry.path
        part = final.with_name(final.name + PART_SUFFIX)
        part.parent.mkdir(parents=True, exist_ok=True)
        have = part.stat().st_size if part.exists() else 0
        if have > entry.size:  # not a prefix of this file: start again
            part.unlink()
            have = 0
        with self._lock:
            self.result.resumed += have
        self.progress(have)
        sent_by: set[str] = set()  # the sources whose bytes are in the partial file (this run)
        refused: dict[str, str] = {}  # source -> why it will not do for this slab
        while not self.stop.is_set():
            if have == entry.size:
                bad = check_slab_file(
                    self.directory, dataclasses.replace(entry, path=entry.path + PART_SUFFIX)
                )
                if bad is None:
                    _install(part, final)
                    return None
                who = ", ".join(sorted(sent_by)) or "an earlier run"
                log.warning("slab %d:%d from %s does not verify (%s); fetching it again", *key, who, bad)
                refused.update({a: "sent bytes that do not verify" for a in sent_by})
                part.unlink()
                self.progress(-have)
                have, sent_by = 0, set()
                continue
            source = self.sources.pick(key, avoid=refused)
            if source is None:
                tried = "; ".join(f"{a}: {why}" for a, why in refused.items())
                return f"no source left that holds it{f' ({tried})' if tried else ''}"
            start, failed = have, False
            try:
                have = self._stream(source, entry, part, have)
            except NodeCallError as e:
                have = part.stat().st_size
                if e.code == grpc.StatusCode.CANCELLED and self.stop.is_set():
                    break
                if e.code in _NOT_THERE:
                    refused[source.address] = f"{e.code.name}: {e.details}"
                elif e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self.stop.wait(0.2)  # busy giving out files: another holder, or this one shortly
                elif not (e.code == grpc.StatusCode.DEADLINE_EXCEEDED and have > start):  # slow is no failure
                    failed = True
                    log.warning(
                        "slab %d:%d: %s failed at byte %d of %d (%s: %s); continuing from another holder",
                        *key, source.address, have, entry.size, e.code.name, e.details,
                    )  # fmt: skip
            except BadStream as e:
                have = part.stat().st_size
                refused[source.address] = str(e)
                log.warning("slab %d:%d: %s %s; fetching it from another holder", *key, source.address, e)
            finally:
                if have > start:
                    sent_by.add(source.address)
                    with self._lock:
                        self.result.sources.add(source.address)
                self.sources.release(source, failed)
            if failed:
                self.stop.wait(0.1 * source.strikes)
        return "interrupted"

    def _stream(self, source: Source, entry: SlabEntry, part: Path, have: int) -> int:
        """Append what `source` sends of the file from byte `have` to `part`; the new length."""
        stream = self.sources.client(source).fetch(entry.path, have, timeout=STREAM_SECONDS)
        with self._lock:
            self._streams.add(stream)
        if self.stop.is_set():
            stream.cancel()
        try:
            with open(part, "ab") as f:
                for offset, data, size in stream:
                    if size != entry.size:
                        raise BadStream(f"gives its file as {size} bytes, the manifest says {entry.size}")
                    if offset != have or have + len(data) > size:
                        raise BadStream(f"sent bytes at {offset}+{len(data)} when byte {have} was next")
                    f.write(data)
                    have += len(data)
                    with self._lock:
                        self.result.downloaded += len(data)
                    self.progress(len(data))
                    if self.stop.is_set():
                        stream.cancel()
                        break
                f.flush()
                os.fsync(f.fileno())
        finally:
            with self._lock:
                self._streams.discard(stream)
        return have


def _install(part: Path, final: Path) -> None:
    """The verified partial file under its final name (a file under that name always verifies)."""
    os.replace(part, final)
    fsync_dir(final.parent)
