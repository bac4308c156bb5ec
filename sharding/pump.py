"""Streaming copy with hashing on other threads: the byte mover of `swarm shard` (and of its verify pass).

Each byte is copied once inside the kernel (copy_file_range, like `cp`) and hashed once, on other threads,
through a read-only memory map whose pages are dropped from the process as soon as they are hashed: memory
stays flat whatever the model size, and hashing overlaps the copy.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarm.sharding.gguf_io import GGUFError

CHUNK = 8 << 20  # bytes per copy/hash step
MAX_AHEAD = 16  # chunks copied but not yet hashed (they stay in the page cache until hashed)
N_LANES = max(1, min(2, os.cpu_count() or 1))  # hashing threads
PAGE = mmap.PAGESIZE


class Pump:
    """Copies byte ranges of the source into output files, hashing them on other threads.

    The copy stays in the kernel (copy_file_range: one page-cache copy, like `cp`); the hashing threads
    read the same bytes through a read-only memory map and drop those pages from this process's map
    once hashed (MADV_DONTNEED), so resident memory stays flat. Each group of hashers (one output file)
    is fed in order on one lane; lanes run in parallel (hashlib releases the GIL).
    """

    def __init__(self, source: Path, progress: Callable[[int], None] | None = None) -> None:
        self.source = source
        self.fd = os.open(source, os.O_RDONLY)
        size = os.fstat(self.fd).st_size
        self.map = mmap.mmap(self.fd, size, access=mmap.ACCESS_READ) if size else None
        self.view = memoryview(self.map) if self.map is not None else memoryview(b"")
        # Slabs are copied expert by expert, so the reads hop between a layer's gate/up/down tensors;
        # one descriptor per tensor keeps each stream sequential for the kernel's readahead.
        self.local = threading.local()  # per copying thread: {stream: fd}
        self.all_fds: list[int] = []
        self.lock = threading.Lock()  # lane assignment and all_fds, shared by the copying threads
        self.progress = progress
        self.ahead = threading.BoundedSemaphore(MAX_AHEAD)  # chunks copied but not yet hashed
        self.error: BaseException | None = None
        self.lanes: list[queue.Queue[_Job | None]] = [queue.Queue() for _ in range(N_LANES)]
        self.lane_of: dict[int, int] = {}
        self.next_lane = 0
        self.threads = [
            threading.Thread(target=self._hash_loop, args=(q,), name=f"shard-hash-{i}", daemon=True)
            for i, q in enumerate(self.lanes)
        ]
        for t in self.threads:
            t.start()

    def _lane(self, hashers: list[Any]) -> queue.Queue[_Job | None]:
        key = id(hashers[0])
        with self.lock:
            if key not in self.lane_of:
                self.lane_of[key] = self.next_lane
                self.next_lane = (self.next_lane + 1) % len(self.lanes)
            return self.lanes[self.lane_of[key]]

    def _hash_loop(self, jobs: queue.Queue[_Job | None]) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            try:
                if job.data is not None:
                    for h in job.hashers:
                        h.update(job.data)
                if job.span is not None:
                    start, end = job.span
                    for h in job.hashers:
                        h.update(self.view[start:end])
                    self._forget(start, end)
                for part in job.parts or ():
                    if isinstance(part, bytes):
                        for h in job.hashers:
                            h.update(part)
                    else:
                        for h in job.hashers:
                            h.update(self.view[part[0] : part[1]])
                        self._forget(*part)
                if job.then is not None:
                    job.then()
            except BaseException as e:  # handed to the copying thread at the next drain()
                self.error = e
            finally:
                if job.span is not None or job.parts is not None:
                    self.ahead.release()
                jobs.task_done()

    def _forget(self, start: int, end: int) -> None:
        """Unmap hashed pages from this process (they stay in the page cache): RSS stays flat."""
        assert self.map is not None
        first = -(-start // PAGE) * PAGE
        last = end // PAGE * PAGE
        if last > first and hasattr(mmap, "MADV_DONTNEED"):
            self.map.madvise(mmap.MADV_DONTNEED, first, last - first)

    def hash_bytes(self, hashers: list[Any], data: bytes) -> None:
        if data:
            self._lane(hashers).put(_Job(hashers, data=data))

    def then(self, hashers: list[Any], fn: Callable[[], None]) -> None:
        """Call `fn` on the hashing lane of `hashers` once everything queued for them is hashed.

        The copying thread never waits for a digest, so copying the next slab overlaps hashing the last."""
        self._lane(hashers).put(_Job(hashers, then=fn))
        with self.lock:
            self.lane_of.pop(id(hashers[0]), None)

    def copy(
        self, offset: int, length: int, out_fd: int | None, hashers: list[Any], stream: int = -1
    ) -> None:
        """Source bytes [offset, offset+length) to `out_fd` (None: only hash them), fed to `hashers`.

        `stream` >= 0 reads through a descriptor of its own (see __init__)."""
        if offset + length > len(self.view):
            raise GGUFError(f"{self.source}: ends before byte {offset + length}; the file is truncated")
        fd = self._stream_fd(stream)
        lane = self._lane(hashers)
        end = offset + length
        while offset < end:
            n = min(CHUNK, end - offset)
            if out_fd is not None:
                copy_range(fd, offset, n, out_fd, self.source)
            self.ahead.acquire()
            lane.put(_Job(hashers, span=(offset, offset + n)))
            offset += n
            if self.progress is not None:
                self.progress(n)

    def copy_small(
        self,
        ranges: list[tuple[int, int, int, bytes]],
        out_fd: int | None,
        hashers: list[Any],
        then: Callable[[], None] | None,
    ) -> None:
        """(offset, length, stream, padding) ranges, copied then padded, hashed as one job, then `then`.

        For small files (one slab): one queue round trip per file instead of one per tensor."""
        parts: list[tuple[int, int] | bytes] = []
        for offset, length, stream, padding in ranges:
            if offset + length > len(self.view):
                raise GGUFError(f"{self.source}: ends before byte {offset + length}; the file is truncated")
            if out_fd is not None:
                copy_range(self._stream_fd(stream), offset, length, out_fd, self.source)
            parts.append((offset, offset + length))
            if padding:
                if out_fd is not None:
                    write_all(out_fd, padding)
                parts.append(padding)
            if self.progress is not None:
                self.progress(length)
        self.ahead.acquire()
        with self.lock:
            lane = self.lanes[self.next_lane]
            self.next_lane = (self.next_lane + 1) % len(self.lanes)
        lane.put(_Job(hashers, parts=parts, then=then))

    def _stream_fd(self, stream: int) -> int:
        if stream < 0:
            return self.fd
        fds: dict[int, int] = self.local.__dict__.setdefault("fds", {})
        if stream not in fds:
            fds[stream] = os.open(self.source, os.O_RDONLY)
            with self.lock:
                self.all_fds.append(fds[stream])
        return fds[stream]

    def drain(self) -> None:
        """Wait until everything queued is hashed (before reading a digest)."""
        for q in self.lanes:
            q.join()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        for q in self.lanes:
            q.put(None)
        for t in self.threads:
            t.join()
        self.view.release()
        if self.map is not None:
            self.map.close()
        os.close(self.fd)
        for fd in self.all_fds:
            os.close(fd)


@dataclass(frozen=True)
class _Job:
    hashers: list[Any]
    span: tuple[int, int] | None = None  # source bytes to hash through the memory map
    data: bytes | None = None  # or these bytes
    parts: list[tuple[int, int] | bytes] | None = None  # or these source spans and literal bytes, in order
    then: Callable[[], None] | None = None  # then call this


def copy_range(src_fd: int, offset: int, length: int, out_fd: int, source: Path) -> None:
    """Append source bytes [offset, offset+length) to out_fd, inside the kernel."""
    while length > 0:
        try:
            if not hasattr(os, "copy_file_range"):  # not Linux
                raise OSError(errno.ENOSYS, "copy_file_range")
            n = os.copy_file_range(src_fd, out_fd, length, offset)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            n = _copy_by_hand(src_fd, offset, min(length, CHUNK), out_fd)
        if n == 0:
            raise GGUFError(f"{source}: ends before byte {offset + length}; the file is truncated")
        offset += n
        length -= n


def _copy_by_hand(src_fd: int, offset: int, length: int, out_fd: int) -> int:
    """Where copy_file_range is not supported (other kernels, some file systems)."""
    data = os.pread(src_fd, length, offset)
    write_all(out_fd, data)
    return len(data)


def write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


_libc: Any = None


def start_writeback(fd: int) -> None:
    """Start writing a finished file to disk now (sync_file_range, Linux), so that the flush before the
    manifest finds little left to do; elsewhere a no-op (the final flush does it all)."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.sync_file_range(fd, 0, 0, 2)  # SYNC_FILE_RANGE_WRITE: start, do not wait
