"""`swarm shard`: cut a MoE GGUF into one mini-GGUF per (layer, expert), a dense.gguf and a manifest.

The cut's orchestration; its parts, in the order they are used: swarm.sharding.pump (each byte copied
once in the kernel and hashed once on other threads, memory flat), swarm.sharding.source (which bytes make
each file, the fingerprint), swarm.sharding.journal (what a killed run finished), swarm.sharding.verify.

One pass over the source. A cut of a part (--layers/--experts) still reads (hashes, without writing) the rest: the fingerprint
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
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import Keys

from swarm.sharding.errors import UserError
from swarm.sharding.ggufwrite import alignment_of, pad
from swarm.sharding.journal import JOURNAL_NAME, Journal
from swarm.sharding.manifest import (
    DENSE_NAME,
    FORMAT_VERSION,
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
from swarm.sharding.pump import Pump, start_writeback, write_all
from swarm.sharding.slabs import check_slab_file, hash_file_range
from swarm.sharding.source import (
    PLACEHOLDER_FINGERPRINT,
    SourceModel,
    arch_int,
    dense_header,
    load_source,
    model_fingerprint,
    pump_slab,
    slab_file_size,
    slab_header,
    slab_kind,
    slab_source_bytes,
)

log = logging.getLogger(__name__)

N_COPIERS = 2  # threads copying slabs, one layer each at a time


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
                        progress(slab_source_bytes(src, layer))
                        continue
                    hashers = [hashlib.sha256()]
                    rec = _recorder(journal, slab_sha, key, hashers[0], written=False)
                    pump_slab(src, pump, layer, expert, None, hashers, rec)
                    continue
                reuse = _reusable_slab(out, key, size, data_offset, journal, old_slabs, trusted_fp)
                if reuse is not None:
                    slab_sha[key] = reuse
                    n_skipped += 1
                    progress(slab_source_bytes(src, layer))
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
    fp = model_fingerprint(header_sha, dense_data_sha, slab_sha)
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
