"""The output files of a cut: slab files written, reused and sealed, dense.gguf, the disk's housekeeping
and what a failed write tells the user.

A slab file is written as `<expert>.gguf.pending` under a placeholder fingerprint (or under its final name
when an earlier manifest of the same source already knows the fingerprint); sealing writes the real
header into each pending file and renames it into place. See swarm.sharding.shard for the whole cut.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from swarm.sharding.errors import UserError
from swarm.sharding.ggufwrite import alignment_of, pad
from swarm.sharding.journal import Journal
from swarm.sharding.manifest import DENSE_NAME, FileEntry, Manifest, SlabEntry, slab_relpath
from swarm.sharding.pump import Pump, start_writeback, write_all
from swarm.sharding.slabs import SlabKey, check_slab_file, hash_file_range
from swarm.sharding.source import PLACEHOLDER_FINGERPRINT, SourceModel, pump_slab, slab_header


def _tmp_name(path: Path) -> Path:
    return path.with_name(path.name + f".tmp-{os.getpid()}")


def write_slab(
    src: SourceModel,
    out: Path,
    pump: Pump,
    layer: int,
    expert: int,
    trusted_fp: str | None,
    data_offset: int,
    size: int,
    journal: Journal,
    slab_sha: dict[SlabKey, str],
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
    record = slab_recorder(journal, slab_sha, (layer, expert), hashers[0], written=True)

    def then() -> None:
        done.wait()  # the file is closed and renamed before the journal may name it
        record()

    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, head)
        pump_slab(src, pump, layer, expert, fd, hashers, then)
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


def slab_recorder(
    journal: Journal, slab_sha: dict[SlabKey, str], key: SlabKey, hasher: Any, written: bool
) -> Callable[[], None]:
    def record() -> None:
        slab_sha[key] = hasher.hexdigest()
        journal.append({"slab": list(key), "sha256": slab_sha[key], "written": written})

    return record


def reusable_slab(
    out: Path,
    key: SlabKey,
    size: int,
    data_offset: int,
    journal: Journal,
    old_slabs: dict[SlabKey, SlabEntry],
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


def seal_slabs(
    src: SourceModel,
    out: Path,
    wanted: set[SlabKey],
    slab_sha: dict[SlabKey, str],
    fp: str,
    layer_layout: dict[int, tuple[int, int]],
) -> dict[SlabKey, SlabEntry]:
    """Write the final header (with the fingerprint) into every pending slab, rename it into place."""
    entries: dict[SlabKey, SlabEntry] = {}
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


def cut_dense(
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


def bytes_present(
    out: Path, src: SourceModel, wanted: set[SlabKey], layout: dict[int, tuple[int, int]]
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


def syncfs(directory: Path) -> None:
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


def remove_stale_temps(out: Path) -> None:
    """Temp files of killed runs: never valid, only taking space."""
    for p in out.glob("*.tmp-*"):
        p.unlink(missing_ok=True)
    experts = out / "experts"
    if experts.is_dir():
        for p in experts.glob("*/*.tmp-*"):
            p.unlink(missing_ok=True)


def disk_error(e: OSError, out: Path, needed: int) -> UserError:
    """What a failed write into `out` means to the user, and what to do; `needed`: bytes the cut writes."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        free = shutil.disk_usage(out).free
        return UserError(
            f"{out}: disk full; this cut needs {gb(needed)} more free space there ({gb(free)} free now); "
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


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
