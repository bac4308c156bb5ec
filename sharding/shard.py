"""`swarm shard`: cut a MoE GGUF into one mini-GGUF per (layer, expert), a dense.gguf and a manifest.

One pass over the source: each byte is copied once inside the kernel (copy_file_range, like `cp`) and
hashed once, on other threads, through a read-only memory map whose pages are dropped from the process
as soon as they are hashed; so memory stays flat whatever the model size, and hashing overlaps the copy.
A cut of a part (--layers/--experts) still reads (hashes, without writing) the rest: the fingerprint
covers the whole model, so every partial cut of one model carries the same fingerprint.

Atomicity and resume. Every file is written under a `.tmp-PID` name and renamed. A slab file's header
carries the model fingerprint, which is known only once the whole model has been read; so slab files
are first completed as `<expert>.gguf.pending` with a placeholder fingerprint of the same length, and
recorded in a journal (`.shard-journal.jsonl`: the source's identity, then one line per finished file
with its data hash). Once every byte is hashed, the real header is written into each pending file,
which is renamed to `<expert>.gguf`; the file system is flushed (syncfs) and the manifest comes last.
No file verifies before the manifest names it, and a rerun skips every journaled or manifest-listed
file whose bytes still hash right.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import logging
import mmap
import os
import queue
import shutil
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGUFReader, GGUFValueType, Keys

from swarm.sharding.errors import UserError
from swarm.sharding.gguf_io import (
    ExpertTensor,
    GGUFError,
    architecture,
    expert_tensors,
    open_gguf,
    read_metadata,
    torch_shape,
)
from swarm.sharding.ggufwrite import KV, TensorSpec, alignment_of, build_header, copy_kvs, pad
from swarm.sharding.manifest import (
    DENSE_NAME,
    FORMAT_VERSION,
    KEY_EXPERT,
    KEY_FINGERPRINT,
    KEY_FORMAT,
    KEY_LAYER,
    MANIFEST_NAME,
    ExpertTensorInfo,
    FileEntry,
    Manifest,
    SlabEntry,
    SourceInfo,
    read_manifest,
    slab_relpath,
    write_manifest,
)
from swarm.sharding.slabs import check_slab_file, hash_file_range

log = logging.getLogger(__name__)

JOURNAL_NAME = ".shard-journal.jsonl"
CHUNK = 8 << 20  # bytes per copy/hash step
MAX_AHEAD = 16  # chunks copied but not yet hashed (they stay in the page cache until hashed)
N_LANES = max(1, min(2, os.cpu_count() or 1))  # hashing threads
N_COPIERS = 2  # threads copying slabs, one layer each at a time
SMALL_FILE = 64 << 20  # slabs up to this size are hashed as one job
ZEROS = bytes(64)
PAGE = mmap.PAGESIZE
PLACEHOLDER_FINGERPRINT = "0" * 64
FINGERPRINT_DOMAIN = b"swarm-fingerprint-v1\0"


# ---- the source model, as the cut sees it ----


@dataclass(frozen=True)
class SourceModel:
    path: Path
    reader: GGUFReader
    meta: dict[str, Any]
    arch: str
    size: int
    mtime_ns: int
    data_start: int  # where tensor data begins: [0, data_start) is magic, metadata and tensor infos
    experts: tuple[ExpertTensor, ...]  # in file order
    dense: tuple[TensorSpec, ...]  # in file order
    dense_offsets: tuple[int, ...]  # absolute source offsets of `dense`
    n_expert: int
    moe_layers: tuple[int, ...]
    # layer -> (header template, offset of the expert id, offset of the fingerprint) or None (see slab_header)
    header_templates: dict[int, tuple[bytes, int, int] | None] = field(default_factory=dict, compare=False)

    def layer_tensors(self, layer: int) -> list[ExpertTensor]:
        return [t for t in self.experts if t.layer == layer]


def slab_kind(et: ExpertTensor) -> str:
    return et.kind if et.name.endswith(".weight") else et.kind + ".bias"


def load_source(path: str | Path) -> SourceModel:
    """Open and validate a GGUF for cutting; every problem is a one-line GGUFError."""
    path = Path(path)
    reader = open_gguf(path)
    meta = read_metadata(reader)
    arch = architecture(meta, path)
    st = path.stat()
    for t in reader.tensors:
        if int(t.data_offset) + int(t.n_bytes) > st.st_size:
            raise GGUFError(
                f"{path}: truncated: tensor {t.name} ends at byte {int(t.data_offset) + int(t.n_bytes)} "
                f"but the file has {st.st_size}; download or convert it again"
            )
    experts = expert_tensors(reader, path)
    if not experts:
        raise GGUFError(
            f"{path}: has no stacked expert tensors (blk.N.ffn_*_exps); swarm shards mixture-of-experts "
            "models only"
        )
    counts = {et.n_expert for et in experts}
    if len(counts) != 1:
        raise GGUFError(f"{path}: expert tensors disagree on the number of experts ({sorted(counts)})")
    names = {et.name for et in experts}
    dense = tuple(
        TensorSpec(t.name, t.tensor_type, torch_shape(t), int(t.n_bytes))
        for t in reader.tensors
        if t.name not in names
    )
    offsets = tuple(int(t.data_offset) for t in reader.tensors if t.name not in names)
    return SourceModel(
        path=path,
        reader=reader,
        meta=meta,
        arch=arch,
        size=st.st_size,
        mtime_ns=st.st_mtime_ns,
        data_start=int(reader.data_offset),
        experts=tuple(experts),
        dense=dense,
        dense_offsets=offsets,
        n_expert=counts.pop(),
        moe_layers=tuple(sorted({et.layer for et in experts})),
    )


def arch_int(src: SourceModel, key: str, default: int = 0) -> int:
    v = src.meta.get(key.format(arch=src.arch))
    return int(v) if isinstance(v, (int, float)) else default


def slab_tensor_specs(src: SourceModel, layer: int) -> list[TensorSpec]:
    return [TensorSpec(et.name, et.qtype, et.slab_shape, et.slab_bytes) for et in src.layer_tensors(layer)]


def build_slab_header(src: SourceModel, layer: int, expert: int, fingerprint: str) -> bytes:
    """The header bytes (up to the tensor data) of slab file (layer, expert), built with GGUFWriter."""
    kvs = [
        KV(Keys.General.ARCHITECTURE, src.arch, GGUFValueType.STRING),
        KV(KEY_FORMAT, FORMAT_VERSION, GGUFValueType.UINT32),
        KV(KEY_LAYER, layer, GGUFValueType.UINT32),
        KV(KEY_EXPERT, expert, GGUFValueType.UINT32),
        KV(KEY_FINGERPRINT, fingerprint, GGUFValueType.STRING),
    ]
    return build_header(src.arch, kvs, slab_tensor_specs(src, layer))


_EXPERT_SENTINEL = 0xA5C3E1F7
_FP_SENTINEL = "Z" * 64  # never hex


def slab_header(src: SourceModel, layer: int, expert: int, fingerprint: str) -> bytes:
    """build_slab_header, from a per-layer template: thousands of slabs, one GGUFWriter run per layer.

    The expert id is a fixed-width uint32 and the fingerprint a fixed-length string, so only those bytes
    differ between the headers of one layer."""
    templates = src.header_templates
    if layer not in templates:
        t = build_slab_header(src, layer, _EXPERT_SENTINEL, _FP_SENTINEL)
        e_at, f_at = t.find(struct.pack("<I", _EXPERT_SENTINEL)), t.find(_FP_SENTINEL.encode())
        unique = t.count(struct.pack("<I", _EXPERT_SENTINEL)) == 1 and t.count(_FP_SENTINEL.encode()) == 1
        templates[layer] = (t, e_at, f_at) if unique else None
    tpl = templates[layer]
    if tpl is None or len(fingerprint) != 64:
        return build_slab_header(src, layer, expert, fingerprint)
    t, e_at, f_at = tpl
    b = bytearray(t)
    b[e_at : e_at + 4] = struct.pack("<I", expert)
    b[f_at : f_at + 64] = fingerprint.encode()
    return bytes(b)


def slab_file_size(src: SourceModel, layer: int) -> tuple[int, int]:
    """(data_offset, size) of every slab file of `layer` (all its experts have the same layout)."""
    head = len(slab_header(src, layer, 0, PLACEHOLDER_FINGERPRINT))
    return head, head + sum(pad(et.slab_bytes, 32) for et in src.layer_tensors(layer))


def dense_header(src: SourceModel) -> bytes:
    return build_header(src.arch, copy_kvs(src.reader, str(src.path)), src.dense, alignment_of(src.reader))


# ---- streaming copy with hashing on a second thread ----


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


# ---- the cut ----


@dataclass
class Journal:
    """Append-only record of finished files of an unfinished run, keyed by the source's identity."""

    path: Path
    identity: dict[str, Any]
    dense: dict[str, Any] | None = None
    slabs: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)  # lines come from the hashing lanes
    fd: int | None = None

    @staticmethod
    def load(path: Path) -> tuple[dict[str, Any] | None, Journal | None]:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return None, None
        except (OSError, UnicodeDecodeError):
            return None, None
        recs = []
        for line in lines:
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                break  # the line a killed run was writing
        if not recs or "identity" not in recs[0]:
            return None, None
        j = Journal(path, recs[0]["identity"])
        for r in recs[1:]:
            if "dense" in r:
                j.dense = r["dense"]
            elif "slab" in r:
                j.slabs[(int(r["slab"][0]), int(r["slab"][1]))] = r
        return recs[0]["identity"], j

    def start(self) -> None:
        with open(self.path, "w", encoding="utf-8") as f:
            f.write(json.dumps({"identity": self.identity}) + "\n")

    def append(self, rec: dict[str, Any]) -> None:
        line = (json.dumps(rec) + "\n").encode()
        with self.lock:
            if self.fd is None:
                self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            write_all(self.fd, line)

    def close(self) -> None:
        with self.lock:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None


@dataclass(frozen=True)
class ShardResult:
    manifest: Manifest
    written: int  # files written in this run
    skipped: int  # files that verified and were kept
    bytes_read: int


def _identity(src: SourceModel, header_sha: str) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "name": src.path.name,
        "size": src.size,
        "mtime_ns": src.mtime_ns,
        "header_sha256": header_sha,
    }


def _same_model(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same source as far as a cheap look can tell (the hashes decide later)."""
    return a.get("size") == b.get("size") and a.get("header_sha256") == b.get("header_sha256")


def _disk_error(e: OSError, out: Path, needed: int) -> UserError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        free = shutil.disk_usage(out).free
        return UserError(
            f"{out}: disk full; this cut needs {_gb(needed)} more free space there ({_gb(free)} free now); "
            "free some space or shard to another directory with -o"
        )
    if e.errno == errno.EFBIG:
        return UserError(
            f"{out}: file too large for this system's limits ({e.strerror}); raise the file size limit "
            "(ulimit -f) or shard to another file system"
        )
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return UserError(f"{out}: cannot write there ({e.strerror}); choose a writable directory with -o")
    return UserError(f"{out}: cannot write {e.filename or 'a file'} ({e.strerror})")


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def shard_model(
    model: str | Path,
    out_dir: str | Path,
    layers: Iterable[int] | None = None,
    experts: Iterable[int] | None = None,
    progress: bool = False,
) -> ShardResult:
    """Cut `model` into `out_dir` (see the module docstring). Raises UserError for every bad input."""
    src = load_source(model)
    out = Path(out_dir)
    want_layers = set(src.moe_layers if layers is None else layers)
    bad = sorted(want_layers - set(src.moe_layers))
    if bad:
        raise UserError(
            f"--layers {bad}: not layers with experts in {src.path.name} (it has {len(src.moe_layers)}: "
            f"{src.moe_layers[0]}-{src.moe_layers[-1]})"
        )
    want_experts = set(range(src.n_expert) if experts is None else experts)
    if want_experts and max(want_experts) >= src.n_expert:
        raise UserError(f"--experts: {src.path.name} has experts 0-{src.n_expert - 1} per layer")
    cut = [(lay, e) for lay in src.moe_layers for e in range(src.n_expert)]
    wanted = {k for k in cut if k[0] in want_layers and k[1] in want_experts}

    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _disk_error(e, out, 0) from e
    if not os.access(out, os.W_OK):
        raise UserError(f"{out}: cannot write there (permission denied); choose a writable directory with -o")

    header_sha = hash_file_range(src.path, 0, src.data_start)
    identity = _identity(src, header_sha)

    # What an earlier run left: a finished manifest, or a journal of an unfinished run.
    old: Manifest | None = None
    if (out / MANIFEST_NAME).exists():
        old = read_manifest(out)
        if old.source.size != src.size or old.source.header_sha256 != header_sha:
            raise UserError(
                f"{out}: holds the shards of another model ({old.source.name}, fingerprint "
                f"{old.fingerprint[:12]}); shard into an empty directory or delete {out} first"
            )
    j_ident, journal = Journal.load(out / JOURNAL_NAME)
    if j_ident is not None and not _same_model(j_ident, identity):
        raise UserError(
            f"{out}: holds an unfinished cut of another model ({j_ident.get('name')}); "
            f"shard into an empty directory or delete {out} first"
        )
    if journal is None or journal.identity != identity:
        journal = Journal(out / JOURNAL_NAME, identity)
        journal.start()
    # A manifest of this very file (same identity) knows the fingerprint: new slabs get their final header.
    trusted_fp = (
        old.fingerprint
        if old is not None
        and old.extra.get("source_mtime_ns") == src.mtime_ns
        and old.source.name == src.path.name
        else None
    )
    _remove_stale_temps(out)

    layer_layout = {lay: slab_file_size(src, lay) for lay in src.moe_layers}
    dense_head = dense_header(src)
    dense_size = len(dense_head) + sum(pad(t.n_bytes, alignment_of(src.reader)) for t in src.dense)
    needed = dense_size + sum(layer_layout[k[0]][1] for k in wanted)
    try:
        already = _bytes_present(out, src, wanted, layer_layout)
        free = shutil.disk_usage(out).free
    except OSError as e:
        raise _disk_error(e, out, needed) from e
    if needed - already > free:
        raise UserError(
            f"{out}: not enough free space: this cut needs {_gb(needed - already)} more, {_gb(free)} free; "
            "free some space, shard to another directory with -o, or cut a part with --layers/--experts"
        )

    t_start = time.monotonic()
    bar = _progress_bar(src.size - src.data_start, progress)
    bar_lock = threading.Lock()

    def progress(n: int) -> None:  # called from the copying threads
        if bar is not None:
            with bar_lock:
                bar.update(n)

    pump = Pump(src.path, progress)
    written = skipped = 0
    try:
        # dense.gguf: whole-file hash for the manifest, hash of the source tensor bytes for the fingerprint.
        dense_entry, dense_data_sha, did = _do_dense(src, out, pump, journal, old, dense_head, dense_size)
        written += did
        skipped += 1 - did
        slab_sha: dict[tuple[int, int], str] = {}
        old_slabs = {(s.layer, s.expert): s for s in (old.slabs if old is not None else ())}
        stop = threading.Event()

        def cut_layer(layer: int) -> tuple[int, int]:
            """Every slab of one layer, in expert order (one sequential stream per tensor)."""
            n_written = n_skipped = 0
            data_offset, size = layer_layout[layer]
            for expert in range(src.n_expert):
                if stop.is_set():
                    break
                key = (layer, expert)
                if key not in wanted:
                    # Only hashed, for the fingerprint; a journal or the old manifest may already know it.
                    known = journal.slabs.get(key) or (
                        {"sha256": old_slabs[key].sha256} if key in old_slabs and trusted_fp else None
                    )
                    if known is not None:
                        slab_sha[key] = known["sha256"]
                        progress(_slab_source_bytes(src, layer))
                        continue
                    hashers = [hashlib.sha256()]
                    rec = _recorder(journal, slab_sha, key, hashers[0], written=False)
                    _pump_slab(src, pump, layer, expert, None, hashers, rec)
                    continue
                reuse = _reusable_slab(out, key, size, data_offset, journal, old_slabs, trusted_fp)
                if reuse is not None:
                    slab_sha[key] = reuse
                    n_skipped += 1
                    progress(_slab_source_bytes(src, layer))
                    continue
                _write_slab(src, out, pump, layer, expert, trusted_fp, data_offset, size, journal, slab_sha)
                n_written += 1
            return n_written, n_skipped

        # Layers are cut N_COPIERS at a time: each copier keeps its own sequential read streams, and the
        # copy (system calls, file creation) runs beside the hashing instead of behind it.
        with ThreadPoolExecutor(N_COPIERS, thread_name_prefix="shard-copy") as pool:
            futures = [pool.submit(cut_layer, layer) for layer in src.moe_layers]
            try:
                for f in futures:
                    w, k = f.result()
                    written += w
                    skipped += k
            except BaseException:
                stop.set()
                raise
        pump.drain()
    except OSError as e:
        raise _disk_error(e, out, needed) from e
    finally:
        pump.close()
        journal.close()
        if bar is not None:
            bar.close()

    log.info("copied and hashed in %.1f s", time.monotonic() - t_start)
    fp = _fingerprint(header_sha, dense_data_sha, slab_sha)
    if trusted_fp is not None and fp != trusted_fp:
        raise UserError(f"{out}: the source changed while it was being cut; run `swarm shard` again")
    try:
        t0 = time.monotonic()
        entries = _seal_slabs(src, out, wanted, slab_sha, fp, layer_layout)
        log.info("sealed %d slab files in %.1f s", len(entries), time.monotonic() - t0)
    except OSError as e:
        raise _disk_error(e, out, needed) from e
    if old is not None and old.fingerprint == fp:
        keep = {(s.layer, s.expert): s for s in old.slabs if (s.layer, s.expert) not in entries}
        for k, s in keep.items():
            if (out / s.path).exists():
                entries[k] = s
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        fingerprint=fp,
        arch=src.arch,
        n_layer=arch_int(src, Keys.LLM.BLOCK_COUNT),
        n_expert=src.n_expert,
        n_expert_used=arch_int(src, Keys.LLM.EXPERT_USED_COUNT),
        n_embd=arch_int(src, Keys.LLM.EMBEDDING_LENGTH),
        n_ff_exp=arch_int(src, Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, _ff_from_tensors(src)),
        moe_layers=src.moe_layers,
        source=SourceInfo(name=src.path.name, size=src.size, header_sha256=header_sha),
        dense=dense_entry,
        expert_tensors=tuple(
            ExpertTensorInfo(
                name=et.name,
                layer=et.layer,
                kind=slab_kind(et),
                qtype=et.qtype.name,
                shape=(et.n_expert, *et.slab_shape),
                slab_bytes=et.slab_bytes,
                source_offset=et.data_offset,
            )
            for et in src.experts
        ),
        slabs=tuple(entries[k] for k in sorted(entries)),
        extra={"source_mtime_ns": src.mtime_ns, "dense_data_sha256": dense_data_sha},
    )
    try:
        # One flush of the whole file system instead of an fsync per file (thousands of slabs): until the
        # manifest exists nothing verifies, and the manifest is written only once every file is durable.
        t0 = time.monotonic()
        _syncfs(out)
        log.info("flushed %s to disk in %.1f s", out, time.monotonic() - t0)
        write_manifest(out, manifest)
        (out / JOURNAL_NAME).unlink(missing_ok=True)
    except OSError as e:
        raise _disk_error(e, out, needed) from e
    return ShardResult(manifest, written, skipped, src.size - src.data_start)


def _ff_from_tensors(src: SourceModel) -> int:
    for et in src.experts:
        if et.kind in ("ffn_up_exps", "ffn_gate_exps") and et.name.endswith(".weight"):
            return et.slab_shape[0]
    return 0


def _fingerprint(header_sha: str, dense_data_sha: str, slab_sha: dict[tuple[int, int], str]) -> str:
    h = hashlib.sha256(FINGERPRINT_DOMAIN)
    h.update(bytes.fromhex(header_sha))
    h.update(bytes.fromhex(dense_data_sha))
    for key in sorted(slab_sha):
        h.update(bytes.fromhex(slab_sha[key]))
    return h.hexdigest()


def _slab_source_bytes(src: SourceModel, layer: int) -> int:
    return sum(et.slab_bytes for et in src.layer_tensors(layer))


def _pump_slab(
    src: SourceModel,
    pump: Pump,
    layer: int,
    expert: int,
    out_fd: int | None,
    hashers: list[Any],
    then: Callable[[], None] | None = None,
) -> None:
    """The data section of slab file (layer, expert): each tensor's source range, padded to 32 bytes.

    `then` runs on the hashing lane once the section is hashed."""
    tensors = src.layer_tensors(layer)
    if _slab_source_bytes(src, layer) <= SMALL_FILE:
        ranges = [
            (
                et.data_offset + expert * et.slab_bytes,
                et.slab_bytes,
                i,
                ZEROS[: pad(et.slab_bytes, 32) - et.slab_bytes],
            )
            for i, et in enumerate(tensors)
        ]
        pump.copy_small(ranges, out_fd, hashers, then)
        return
    for i, et in enumerate(tensors):
        pump.copy(et.data_offset + expert * et.slab_bytes, et.slab_bytes, out_fd, hashers, stream=i)
        zeros = b"\0" * (pad(et.slab_bytes, 32) - et.slab_bytes)
        if zeros:
            if out_fd is not None:
                write_all(out_fd, zeros)
            pump.hash_bytes(hashers, zeros)
    if then is not None:
        pump.then(hashers, then)


def _tmp_name(path: Path) -> Path:
    return path.with_name(path.name + f".tmp-{os.getpid()}")


def _write_slab(
    src: SourceModel,
    out: Path,
    pump: Pump,
    layer: int,
    expert: int,
    trusted_fp: str | None,
    data_offset: int,
    size: int,
    journal: Journal,
    slab_sha: dict[tuple[int, int], str],
) -> None:
    """Write one slab file (pending, or final when the fingerprint is already known).

    Its data hash lands in `slab_sha` and the journal once the hashing lane has caught up (after the
    file is complete: the journal only vouches for whole files)."""
    final = out / slab_relpath(layer, expert)
    final.parent.mkdir(parents=True, exist_ok=True)
    target = final if trusted_fp is not None else final.with_name(final.name + ".pending")
    # A final name must only ever hold a whole file: write it under a temp name. A pending file is not
    # trusted before the journal vouches for its hash (after it is complete), so it is written in place.
    tmp = _tmp_name(target) if target == final else target
    head = slab_header(src, layer, expert, trusted_fp or PLACEHOLDER_FINGERPRINT)
    assert len(head) == data_offset
    hashers = [hashlib.sha256()]
    done = threading.Event()
    record = _recorder(journal, slab_sha, (layer, expert), hashers[0], written=True)

    def then() -> None:
        done.wait()  # the file is closed and renamed before the journal may name it
        record()

    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, head)
        _pump_slab(src, pump, layer, expert, fd, hashers, then)
    except BaseException:
        done.set()  # let the lane go on; its journal line is harmless, the hash check decides
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    try:
        start_writeback(fd)
        os.close(fd)
        if tmp != target:
            os.replace(tmp, target)
    finally:
        done.set()  # never leave the hashing lane waiting (a journal line for a missing file is harmless)


def _recorder(
    journal: Journal, slab_sha: dict[tuple[int, int], str], key: tuple[int, int], hasher: Any, written: bool
) -> Callable[[], None]:
    def record() -> None:
        slab_sha[key] = hasher.hexdigest()
        journal.append({"slab": list(key), "sha256": slab_sha[key], "written": written})

    return record


def _reusable_slab(
    out: Path,
    key: tuple[int, int],
    size: int,
    data_offset: int,
    journal: Journal,
    old_slabs: dict[tuple[int, int], SlabEntry],
    trusted_fp: str | None,
) -> str | None:
    """The data hash of an already written slab that still verifies, else None."""
    layer, expert = key
    final = out / slab_relpath(layer, expert)
    if key in old_slabs and trusted_fp is not None:
        entry = old_slabs[key]
        if check_slab_file(out, entry) is None:
            return entry.sha256
    rec = journal.slabs.get(key)
    if rec is None or not rec.get("written"):
        return None
    for path in (final.with_name(final.name + ".pending"), final):
        try:
            if path.stat().st_size != size:
                continue
        except FileNotFoundError:
            continue
        if hash_file_range(path, data_offset, size) == rec["sha256"]:
            if path == final:
                # Its header may hold a fingerprint of an earlier run: sealing rewrites it.
                os.replace(final, final.with_name(final.name + ".pending"))
            return str(rec["sha256"])
    return None


def _seal_slabs(
    src: SourceModel,
    out: Path,
    wanted: set[tuple[int, int]],
    slab_sha: dict[tuple[int, int], str],
    fp: str,
    layer_layout: dict[int, tuple[int, int]],
) -> dict[tuple[int, int], SlabEntry]:
    """Write the final header (with the fingerprint) into every pending slab, rename it into place."""
    entries: dict[tuple[int, int], SlabEntry] = {}
    dirs: set[Path] = set()
    for key in sorted(wanted):
        layer, expert = key
        data_offset, size = layer_layout[layer]
        final = out / slab_relpath(layer, expert)
        pending = final.with_name(final.name + ".pending")
        head = slab_header(src, layer, expert, fp)
        if pending.exists():
            fd = os.open(pending, os.O_WRONLY)
            try:
                os.pwrite(fd, head, 0)
            finally:
                os.close(fd)
            os.replace(pending, final)
            dirs.add(final.parent)
        entries[key] = SlabEntry(
            layer=layer,
            expert=expert,
            path=slab_relpath(layer, expert),
            size=size,
            data_offset=data_offset,
            header_sha256=hashlib.sha256(head).hexdigest(),
            sha256=slab_sha[key],
        )
    return entries


def _do_dense(
    src: SourceModel,
    out: Path,
    pump: Pump,
    journal: Journal,
    old: Manifest | None,
    head: bytes,
    size: int,
) -> tuple[FileEntry, str, int]:
    """dense.gguf: (manifest entry, SHA-256 of the source's dense tensor bytes, 1 if written now)."""
    path = out / DENSE_NAME
    known: dict[str, Any] | None = journal.dense
    if known is None and old is not None and "dense_data_sha256" in old.extra:
        known = {"sha256": old.dense.sha256, "data_sha256": old.extra["dense_data_sha256"]}
    if known is not None:
        try:
            ok = path.stat().st_size == size and hash_file_range(path) == known["sha256"]
        except FileNotFoundError:
            ok = False
        if ok:
            if pump.progress is not None:
                pump.progress(sum(t.n_bytes for t in src.dense))
            return FileEntry(DENSE_NAME, size, known["sha256"]), known["data_sha256"], 0
    align = alignment_of(src.reader)
    file_h, data_h = hashlib.sha256(), hashlib.sha256()
    tmp = _tmp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, head)
        pump.hash_bytes([file_h], head)
        for spec, off in zip(src.dense, src.dense_offsets, strict=True):
            pump.copy(off, spec.n_bytes, fd, [file_h, data_h])
            zeros = b"\0" * (pad(spec.n_bytes, align) - spec.n_bytes)
            if zeros:
                write_all(fd, zeros)
                pump.hash_bytes([file_h], zeros)
        pump.drain()
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    entry = FileEntry(DENSE_NAME, size, file_h.hexdigest())
    journal.append({"dense": {"sha256": entry.sha256, "data_sha256": data_h.hexdigest()}})
    return entry, data_h.hexdigest(), 1


def _bytes_present(
    out: Path, src: SourceModel, wanted: set[tuple[int, int]], layout: dict[int, tuple[int, int]]
) -> int:
    """Bytes of output files already there at their final size (a resumed run need not find room again)."""
    n = 0
    for layer, expert in wanted:
        final = out / slab_relpath(layer, expert)
        for p in (final, final.with_name(final.name + ".pending")):
            try:
                if p.stat().st_size == layout[layer][1]:
                    n += layout[layer][1]
                    break
            except FileNotFoundError:
                pass
    try:
        n += (out / DENSE_NAME).stat().st_size
    except FileNotFoundError:
        pass
    return n


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


def _syncfs(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(directory))
    except AttributeError:  # no syncfs (not Linux): flush everything
        os.sync()
    finally:
        os.close(fd)


def _remove_stale_temps(out: Path) -> None:
    """Temp files of killed runs: never valid, only taking space."""
    for p in out.glob("*.tmp-*"):
        p.unlink(missing_ok=True)
    experts = out / "experts"
    if experts.is_dir():
        for p in experts.glob("*/*.tmp-*"):
            p.unlink(missing_ok=True)


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="shard", file=sys.stderr)


# ---- verification ----


def verify_shard(directory: str | Path, model: str | Path | None = None) -> list[str]:
    """Every mismatch between a shard directory and its manifest (and the source model, if given)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    problems: list[str] = []
    dense = directory / manifest.dense.path
    try:
        if dense.stat().st_size != manifest.dense.size:
            problems.append(
                f"{manifest.dense.path}: size {dense.stat().st_size}, manifest says {manifest.dense.size}"
            )
        elif hash_file_range(dense) != manifest.dense.sha256:
            problems.append(f"{manifest.dense.path}: differs from the manifest (SHA-256 mismatch)")
    except FileNotFoundError:
        problems.append(f"{manifest.dense.path}: missing")
    for entry in manifest.slabs:
        bad = check_slab_file(directory, entry)
        if bad is not None:
            problems.append(bad)
    if model is not None:
        problems += _verify_against_source(manifest, Path(model))
    return problems


def _verify_against_source(manifest: Manifest, model: Path) -> list[str]:
    """Re-derive every hash from the source (one read of it) and name each manifest entry that differs."""
    src = load_source(model)
    header_sha = hash_file_range(src.path, 0, src.data_start)
    if header_sha != manifest.source.header_sha256 or src.size != manifest.source.size:
        return [f"{model}: is not the model this directory was cut from (its header or size differ)"]
    problems: list[str] = []
    by_key = {(s.layer, s.expert): s for s in manifest.slabs}
    align = alignment_of(src.reader)
    pump = Pump(src.path)
    try:
        head = dense_header(src)
        file_h, data_h = hashlib.sha256(), hashlib.sha256()
        pump.hash_bytes([file_h], head)
        for spec, off in zip(src.dense, src.dense_offsets, strict=True):
            pump.copy(off, spec.n_bytes, None, [file_h, data_h])
            pump.hash_bytes([file_h], b"\0" * (pad(spec.n_bytes, align) - spec.n_bytes))
        slab_sha: dict[tuple[int, int], str] = {}
        for layer in src.moe_layers:
            for expert in range(src.n_expert):
                hs = [hashlib.sha256()]
                _pump_slab(src, pump, layer, expert, None, hs)
                pump.drain()
                slab_sha[(layer, expert)] = hs[0].hexdigest()
                entry = by_key.get((layer, expert))
                if entry is None:
                    continue
                if entry.sha256 != slab_sha[(layer, expert)]:
                    problems.append(f"{entry.path}: the manifest's data hash differs from the source's bytes")
                want_head = hashlib.sha256(slab_header(src, layer, expert, manifest.fingerprint)).hexdigest()
                if entry.header_sha256 != want_head:
                    problems.append(
                        f"{entry.path}: the manifest's header hash differs from what the source gives"
                    )
        pump.drain()
    finally:
        pump.close()
    if file_h.hexdigest() != manifest.dense.sha256:
        problems.append(f"{manifest.dense.path}: the manifest's hash differs from what the source gives")
    fp = _fingerprint(header_sha, data_h.hexdigest(), slab_sha)
    if fp != manifest.fingerprint:
        problems.append(
            f"fingerprint: the source gives {fp[:16]}..., the manifest says {manifest.fingerprint[:16]}..."
        )
    return problems
