"""`swarm shard`: cut a MoE GGUF into one mini-GGUF per (layer, expert), a dense.gguf and a manifest.

The cut's orchestration; its parts, in the order they are used: swarm.sharding.pump (each byte copied
once in the kernel and hashed once on other threads, memory flat), swarm.sharding.source (which bytes make
each file, the fingerprint), swarm.sharding.journal (what a killed run finished), swarm.sharding.shard_files
(each output file written, reused or sealed), swarm.sharding.verify.

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

import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from gguf import Keys

from swarm.sharding.errors import UserError
from swarm.sharding.ggufwrite import alignment_of, pad
from swarm.sharding.journal import JOURNAL_NAME, Journal
from swarm.sharding.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    ExpertTensorInfo,
    FileEntry,
    Manifest,
    SlabEntry,
    SourceInfo,
    read_manifest,
    write_manifest,
)
from swarm.sharding.pump import Pump
from swarm.sharding.shard_files import (
    bytes_present,
    cut_dense,
    disk_error,
    gb,
    remove_stale_temps,
    reusable_slab,
    seal_slabs,
    slab_recorder,
    syncfs,
    write_slab,
)
from swarm.sharding.slabs import SlabKey, hash_file_range
from swarm.sharding.source import (
    SourceModel,
    arch_int,
    dense_header,
    load_source,
    model_fingerprint,
    pump_slab,
    slab_file_size,
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
    wanted = _wanted_slabs(src, layers, experts)
    _make_out_dir(out)
    header_sha = hash_file_range(src.path, 0, src.data_start)
    old, journal, trusted_fp = _earlier_run(out, src, header_sha)
    remove_stale_temps(out)

    layer_layout = {lay: slab_file_size(src, lay) for lay in src.moe_layers}
    dense_head = dense_header(src)
    dense_size = len(dense_head) + sum(pad(t.n_bytes, alignment_of(src.reader)) for t in src.dense)
    needed = dense_size + sum(layer_layout[k[0]][1] for k in wanted)
    _check_free_space(out, src, wanted, layer_layout, needed)

    t_start = time.monotonic()
    bar = _progress_bar(src.size - src.data_start, progress)
    sink = _progress_sink(bar)
    pump = Pump(src.path, sink)
    try:
        old_slabs = {(s.layer, s.expert): s for s in (old.slabs if old is not None else ())}
        cutter = _LayerCutter(src, out, pump, journal, wanted, layer_layout, old_slabs, trusted_fp, sink)
        copied = cutter.copy_and_hash(old, dense_head, dense_size)
    except OSError as e:
        raise disk_error(e, out, needed) from e
    finally:
        pump.close()
        journal.close()
        if bar is not None:
            bar.close()
    log.info("copied and hashed in %.1f s", time.monotonic() - t_start)

    fp = model_fingerprint(header_sha, copied.dense_data_sha, copied.slab_sha)
    if trusted_fp is not None and fp != trusted_fp:
        raise UserError(f"{out}: the source changed while it was being cut; run `swarm shard` again")
    entries = _sealed_entries(src, out, wanted, copied.slab_sha, fp, layer_layout, old, needed)
    manifest = _manifest_of(src, header_sha, fp, copied.dense_entry, copied.dense_data_sha, entries)
    _commit(out, manifest, needed)
    return ShardResult(manifest, copied.written, copied.skipped, src.size - src.data_start)


# --- before the copy: what to cut, what an earlier run left, room on disk --------------------------------


def _wanted_slabs(
    src: SourceModel, layers: Iterable[int] | None, experts: Iterable[int] | None
) -> set[SlabKey]:
    """The slabs --layers/--experts ask for (every one by default), checked against the model."""
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
    return {k for k in cut if k[0] in want_layers and k[1] in want_experts}


def _make_out_dir(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise disk_error(e, out, 0) from e
    if not os.access(out, os.W_OK):
        raise UserError(f"{out}: cannot write there (permission denied); choose a writable directory with -o")


def _earlier_run(out: Path, src: SourceModel, header_sha: str) -> tuple[Manifest | None, Journal, str | None]:
    """What an earlier run left: its finished manifest (or None), this run's journal (an unfinished run's,
    continued, or a fresh one), and the fingerprint new slabs may carry at once (or None)."""
    identity = _identity(src, header_sha)
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
    return old, journal, trusted_fp


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


def _check_free_space(
    out: Path,
    src: SourceModel,
    wanted: set[SlabKey],
    layer_layout: dict[int, tuple[int, int]],
    needed: int,
) -> None:
    try:
        already = bytes_present(out, src, wanted, layer_layout)
        free = shutil.disk_usage(out).free
    except OSError as e:
        raise disk_error(e, out, needed) from e
    if needed - already > free:
        raise UserError(
            f"{out}: not enough free space: this cut needs {gb(needed - already)} more, {gb(free)} free; "
            "free some space, shard to another directory with -o, or cut a part with --layers/--experts"
        )


# --- the copy: dense.gguf, then every layer's slabs ------------------------------------------------------


class _Copied(NamedTuple):
    dense_entry: FileEntry
    dense_data_sha: str  # SHA-256 of the source's dense tensor bytes
    slab_sha: dict[SlabKey, str]  # data hash of every slab of the model, cut or only hashed
    written: int
    skipped: int


@dataclass
class _LayerCutter:
    """What the copying threads share; each cuts whole layers."""

    src: SourceModel
    out: Path
    pump: Pump
    journal: Journal
    wanted: set[SlabKey]
    layer_layout: dict[int, tuple[int, int]]  # layer -> (data offset, size) of its slab files
    old_slabs: dict[SlabKey, SlabEntry]
    trusted_fp: str | None
    progress: Callable[[int], None]
    slab_sha: dict[SlabKey, str] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def copy_and_hash(self, old: Manifest | None, dense_head: bytes, dense_size: int) -> _Copied:
        # dense.gguf: whole-file hash for the manifest, hash of the source tensor bytes for the fingerprint.
        dense_entry, dense_data_sha, did = cut_dense(
            self.src, self.out, self.pump, self.journal, old, dense_head, dense_size
        )
        written, skipped = did, 1 - did
        # Layers are cut N_COPIERS at a time: each copier keeps its own sequential read streams, and the
        # copy (system calls, file creation) runs beside the hashing instead of behind it.
        with ThreadPoolExecutor(N_COPIERS, thread_name_prefix="shard-copy") as pool:
            futures = [pool.submit(self.cut_layer, layer) for layer in self.src.moe_layers]
            try:
                for f in futures:
                    w, k = f.result()
                    written += w
                    skipped += k
            except BaseException:
                self.stop.set()
                raise
        self.pump.drain()
        return _Copied(dense_entry, dense_data_sha, self.slab_sha, written, skipped)

    def cut_layer(self, layer: int) -> tuple[int, int]:
        """Every slab of one layer, in expert order (one sequential stream per tensor): (written, kept)."""
        n_written = n_skipped = 0
        data_offset, size = self.layer_layout[layer]
        for expert in range(self.src.n_expert):
            if self.stop.is_set():
                break
            key = (layer, expert)
            if key not in self.wanted:
                self._hash_only(key)
                continue
            reuse = reusable_slab(
                self.out, key, size, data_offset, self.journal, self.old_slabs, self.trusted_fp
            )
            if reuse is not None:
                self.slab_sha[key] = reuse
                n_skipped += 1
                self.progress(slab_source_bytes(self.src, layer))
                continue
            write_slab(self.src, self.out, self.pump, layer, expert, self.trusted_fp, data_offset, size,
                       self.journal, self.slab_sha)  # fmt: skip
            n_written += 1
        return n_written, n_skipped

    def _hash_only(self, key: SlabKey) -> None:
        """A slab this run does not cut, hashed for the fingerprint; a journal or the old manifest may
        already know it."""
        layer, expert = key
        known = self.journal.slabs.get(key) or (
            {"sha256": self.old_slabs[key].sha256} if key in self.old_slabs and self.trusted_fp else None
        )
        if known is not None:
            self.slab_sha[key] = known["sha256"]
            self.progress(slab_source_bytes(self.src, layer))
            return
        hashers = [hashlib.sha256()]
        rec = slab_recorder(self.journal, self.slab_sha, key, hashers[0], written=False)
        pump_slab(self.src, self.pump, layer, expert, None, hashers, rec)


# --- after the copy: sealed slabs, the manifest ----------------------------------------------------------


def _sealed_entries(
    src: SourceModel,
    out: Path,
    wanted: set[SlabKey],
    slab_sha: dict[SlabKey, str],
    fp: str,
    layer_layout: dict[int, tuple[int, int]],
    old: Manifest | None,
    needed: int,
) -> dict[SlabKey, SlabEntry]:
    """The manifest's slabs: this run's, sealed now, and those of an earlier manifest of the same
    fingerprint whose files are still there."""
    try:
        t0 = time.monotonic()
        entries = seal_slabs(src, out, wanted, slab_sha, fp, layer_layout)
        log.info("sealed %d slab files in %.1f s", len(entries), time.monotonic() - t0)
    except OSError as e:
        raise disk_error(e, out, needed) from e
    if old is not None and old.fingerprint == fp:
        keep = {(s.layer, s.expert): s for s in old.slabs if (s.layer, s.expert) not in entries}
        for k, s in keep.items():
            if (out / s.path).exists():
                entries[k] = s
    return entries


def _manifest_of(
    src: SourceModel,
    header_sha: str,
    fp: str,
    dense_entry: FileEntry,
    dense_data_sha: str,
    entries: dict[SlabKey, SlabEntry],
) -> Manifest:
    return Manifest(
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


def _ff_from_tensors(src: SourceModel) -> int:
    for et in src.experts:
        if et.kind in ("ffn_up_exps", "ffn_gate_exps") and et.name.endswith(".weight"):
            return et.slab_shape[0]
    return 0


def _commit(out: Path, manifest: Manifest, needed: int) -> None:
    """Flush, then write the manifest (which makes the cut valid) and drop the journal."""
    try:
        # One flush of the whole file system instead of an fsync per file (thousands of slabs): until the
        # manifest exists nothing verifies, and the manifest is written only once every file is durable.
        t0 = time.monotonic()
        syncfs(out)
        log.info("flushed %s to disk in %.1f s", out, time.monotonic() - t0)
        write_manifest(out, manifest)
        (out / JOURNAL_NAME).unlink(missing_ok=True)
    except OSError as e:
        raise disk_error(e, out, needed) from e


# --- progress -----------------------------------------------------------------------------------------------


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="shard", file=sys.stderr)


def _progress_sink(bar: Any) -> Callable[[int], None]:
    """Advances `bar` (if any) by n bytes; called from the copying threads."""
    lock = threading.Lock()

    def progress(n: int) -> None:
        if bar is not None:
            with lock:
                bar.update(n)

    return progress
