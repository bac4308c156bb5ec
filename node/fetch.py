"""`swarm node DIR --fetch`: a node that starts empty and fetches its slabs from the swarm.

    sources = Sources(key, peers=["10.0.0.5:7000"], interfaces=["10.0.0.7"], link=None)  # peers, mDNS, --join
    sources.discover(wait=3.0)
    manifest = ensure_manifest(directory, sources, have=None)  # manifest.json first, atomically
    job = plan_fetch(directory, manifest, wanted)  # what is here and verifies, what is to fetch
    result = Fetcher(directory, sources, stop, parallel=4).run(job.to_fetch, on_verified=...)

The sources are in swarm.node.fetch_sources, the job (directory, manifest, what to fetch) in
swarm.node.fetch_job; this module fetches the slab files.

Each slab is streamed into `<slab>.gguf.part`, appended chunk by chunk, so an interrupted fetch (Ctrl-C, a
crash, a reboot) resumes from the partial file's length next time. A source that fails mid-file is left for
another holder, which continues from the same byte. A complete file is hashed against the manifest (header
and data, every byte) and only then renamed into place and handed to `on_verified`, so a file under its
final name always verifies; a file that does not is discarded and fetched again from a holder that did not
send it. A few downloads run at once, spread over the holders by how busy each is.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from swarm.node.errors import NodeCallError
from swarm.node.fetch_sources import STREAM_SECONDS, FileChunks, Source, Sources
from swarm.sharding.manifest import SlabEntry, fsync_dir
from swarm.sharding.slabs import SlabKey, check_slab_file

log = logging.getLogger(__name__)

PART_SUFFIX = ".part"

# Codes after which a source will not give this slab (it does not hold it, or holds another model's).
_NOT_THERE = (
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
)


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
        self._streams: set[FileChunks] = set()
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
