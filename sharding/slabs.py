"""Expert slabs: one expert's bytes of each stacked expert tensor of one layer.

A slab is the same bytes wherever it comes from: a view of the whole model's memory map, or a
mini-GGUF written by `swarm shard`. In memory it is one ExpertSlab record (its parts as SlabTensors).
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from swarm.sharding.errors import UserError
from swarm.sharding.gguf_io import (
    EXPERT_TENSOR_RE,
    TOO_MANY_FILES,
    GGUFError,
    expert_tensors,
    open_gguf,
    read_metadata,
    too_many_open_files,
    torch_shape,
)
from swarm.sharding.manifest import Manifest, SlabEntry, read_manifest

log = logging.getLogger(__name__)

__all__ = [
    "ExpertSlab",
    "LazySlabs",
    "Manifest",
    "SlabKey",
    "SlabTensor",
    "check_slab_file",
    "hash_file_range",
    "open_dense",
    "read_manifest",
    "read_slab_file",
    "slabs_from_gguf",
    "slabs_from_shard",
]

SlabKey = tuple[int, int]  # (layer, expert)


@dataclass(frozen=True)
class SlabTensor:
    """One expert's part of one stacked tensor: raw bytes in the source quant type."""

    kind: str  # ffn_gate_exps | ffn_up_exps | ffn_down_exps | ffn_gate_up_exps (+ ".bias" for biases)
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order
    data: np.ndarray  # uint8 bytes (a view of a memory map)


# The ExpertSlab field of each tensor kind, as GGUF names the stacked tensors (blk.N.<kind>.weight and
# blk.N.<kind>.bias, see swarm.sharding.gguf_io.EXPERT_TENSOR_RE).
_MATRIX_FIELDS = {
    "ffn_gate_exps": "gate",
    "ffn_up_exps": "up",
    "ffn_gate_up_exps": "gate_up",
    "ffn_down_exps": "down",
}
_FIELD_OF_KIND = {
    **_MATRIX_FIELDS,
    **{kind + ".bias": name + "_bias" for kind, name in _MATRIX_FIELDS.items()},
}


@dataclass(frozen=True, eq=False)
class ExpertSlab(Mapping[str, SlabTensor]):
    """One expert's slab: its part of each stacked expert tensor of one layer, gate and up stored apart or
    fused (gate_up, gate rows first), each matrix with an optional bias. A part the model lacks is None; a
    slab missing a part it needs is refused where its shapes are checked, before it is served.

    It also reads as a mapping from tensor kind ("ffn_up_exps", "ffn_up_exps.bias": the names the GGUF
    files give the tensors) to the parts present: the view of the files, for code that goes by those names.
    """

    gate: SlabTensor | None = None  # [F, D]
    up: SlabTensor | None = None  # [F, D]
    gate_up: SlabTensor | None = None  # [2F, D]
    down: SlabTensor | None = None  # [D, F]
    gate_bias: SlabTensor | None = None
    up_bias: SlabTensor | None = None
    gate_up_bias: SlabTensor | None = None
    down_bias: SlabTensor | None = None

    @classmethod
    def of(cls, tensors: Iterable[SlabTensor]) -> ExpertSlab:
        """The slab of these parts, each in the field its kind names (a later part of a kind replaces an
        earlier one)."""
        fields: dict[str, SlabTensor] = {}
        for t in tensors:
            name = _FIELD_OF_KIND.get(t.kind)
            if name is None:
                raise ValueError(f"a tensor of kind {t.kind!r} is not part of an expert slab")
            fields[name] = t
        return cls(**fields)

    @property
    def has_bias(self) -> bool:
        return any(b is not None for b in (self.gate_bias, self.up_bias, self.gate_up_bias, self.down_bias))

    def matrices(self) -> dict[str, SlabTensor]:
        """The matrices present, by field name (gate, up, gate_up, down)."""
        found = {name: getattr(self, name) for name in _MATRIX_FIELDS.values()}
        return {name: t for name, t in found.items() if t is not None}

    def __getitem__(self, kind: str) -> SlabTensor:
        t = getattr(self, _FIELD_OF_KIND[kind]) if kind in _FIELD_OF_KIND else None
        if t is None:
            raise KeyError(kind)
        return t

    def __iter__(self) -> Iterator[str]:
        return (kind for kind, name in _FIELD_OF_KIND.items() if getattr(self, name) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def slabs_from_gguf(
    path: str | Path, layers: Iterable[int] | None = None, experts: Iterable[int] | None = None
) -> dict[SlabKey, ExpertSlab]:
    """The expert slabs of a whole (unsharded) GGUF, as zero-copy views of its stacked tensors."""
    reader = open_gguf(path)
    want_layers = set(layers) if layers is not None else None
    want_experts = set(experts) if experts is not None else None
    parts: dict[SlabKey, list[SlabTensor]] = {}
    for et in expert_tensors(reader, path):
        if want_layers is not None and et.layer not in want_layers:
            continue
        kind = et.kind if et.name.endswith(".weight") else et.kind + ".bias"
        for e in range(et.n_expert):
            if want_experts is not None and e not in want_experts:
                continue
            parts.setdefault((et.layer, e), []).append(SlabTensor(kind, et.qtype, et.slab_shape, et.slab(e)))
    return {key: ExpertSlab.of(ts) for key, ts in parts.items()}


# ---- shard directories (written by `swarm shard`, see swarm.sharding.manifest) ----

HASH_CHUNK = 8 << 20  # bytes read per step when hashing a file: memory stays flat


def hash_file_range(
    path: str | Path,
    start: int = 0,
    end: int | None = None,
    chunk: int = HASH_CHUNK,
    between: Callable[[], None] | None = None,
) -> str:
    """SHA-256 (hex) of bytes [start, end) of a file, read in `chunk`-byte pieces into one reused buffer;
    `between()` after each piece (a background check paces itself there, or stops by raising)."""
    h = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        left = None if end is None else end - start
        while left is None or left > 0:
            want = chunk if left is None else min(chunk, left)
            n = f.readinto(view[:want])
            if not n:
                break
            h.update(view[:n])
            if left is not None:
                left -= n
            if between is not None:
                between()
    return h.hexdigest()


def check_slab_file(
    directory: str | Path,
    entry: SlabEntry,
    chunk: int = HASH_CHUNK,
    between: Callable[[], None] | None = None,
) -> str | None:
    """None if the slab file matches its manifest entry byte for byte; else what is wrong (one line).
    `chunk` and `between` as hash_file_range takes them."""
    path = Path(directory) / entry.path
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{entry.path}: missing"
    except OSError as e:
        return f"{entry.path}: cannot be read ({e.strerror})"
    if size != entry.size:
        return f"{entry.path}: size {size} bytes, manifest says {entry.size}"
    try:
        if hash_file_range(path, 0, entry.data_offset, chunk, between) != entry.header_sha256:
            return f"{entry.path}: header differs from the manifest (SHA-256 mismatch)"
        if hash_file_range(path, entry.data_offset, entry.size, chunk, between) != entry.sha256:
            return f"{entry.path}: tensor data differs from the manifest (SHA-256 mismatch)"
    except OSError as e:
        return f"{entry.path}: cannot be read ({e.strerror})"
    return None


def read_slab_file(path: str | Path) -> ExpertSlab:
    """The slab of one mini-GGUF written by `swarm shard`, memory-mapped."""
    return ExpertSlab.of(SlabTensor(kind, t.tensor_type, torch_shape(t), t.data.reshape(-1).view(np.uint8))
                         for kind, t in _slab_tensors(open_gguf(path), path))  # fmt: skip


def _slab_tensors(reader: GGUFReader, path: str | Path) -> Iterator[tuple[str, Any]]:
    """(kind, tensor) of each tensor of a slab file."""
    for t in reader.tensors:
        m = EXPERT_TENSOR_RE.match(t.name)
        if m is None:
            raise GGUFError(f"{path}: tensor {t.name} is not an expert slab; this is not a swarm slab file")
        yield (m.group("kind") if m.group("part") == "weight" else m.group("kind") + ".bias"), t


def slab_file_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata of a slab file (general.architecture, swarm.layer, swarm.expert, swarm.fingerprint)."""
    return read_metadata(open_gguf(path))


def slabs_from_shard(
    directory: str | Path,
    layers: Iterable[int] | None = None,
    experts: Iterable[int] | None = None,
    verify: bool = True,
    progress: Callable[[int, int], None] | None = None,
    map_only: bool = False,
) -> tuple[dict[SlabKey, ExpertSlab], list[str]]:
    """Load the requested slabs of a shard directory, memory-mapped; `progress(done, total)` after each.

    With `verify`, each slab file is hashed against the manifest first (header and data, every byte); a
    slab that does not verify, is missing, or is not part of this (partial) shard is left out and named in
    the returned `problems`. Requested ids outside the model (layer without experts, expert >= n_expert)
    are problems too. `map_only` (no `verify`): each file is mapped where its layer's first file has its
    tensors, its size checked and nothing of it read (LazySlabs): tens of microseconds a slab rather than a
    header parse, for a caller that hashes each slab before its first use.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    mapper = LazySlabs(directory, manifest) if map_only and not verify else None
    want_layers = sorted(set(layers)) if layers is not None else list(manifest.moe_layers)
    want_experts = sorted(set(experts)) if experts is not None else list(range(manifest.n_expert))
    moe = set(manifest.moe_layers)
    problems: list[str] = []
    out: dict[SlabKey, ExpertSlab] = {}
    total = len(want_experts) * sum(1 for layer in want_layers if layer in moe)
    done = 0
    for layer in want_layers:
        if layer not in moe:
            problems.append(f"layer {layer}: the model has no experts in this layer")
            continue
        for expert in want_experts:
            try:
                out[(layer, expert)] = _shard_slab(directory, manifest, layer, expert, verify, mapper)
            except _Refused as e:
                problems.append(f"layer {layer} expert {expert}: {e}")
            done += 1
            if progress is not None:
                progress(done, total)
    return out, problems


class LazySlabs(Mapping[SlabKey, ExpertSlab]):
    """Every slab a shard directory's manifest lists, each slab file memory-mapped on its first use rather
    than all at once: a coordinator checks the few slabs its audits draw, and reading 10,240 slab headers
    (~1 ms of Python each) would hold up its start. The first file of a layer is read whole (gguf's
    reader); `swarm shard` writes every slab of a layer with the same tensors in the same places after the
    data offset the manifest records, so the others are mapped there without parsing their headers again
    (tens of microseconds: an audit thread parsing headers holds the interpreter lock the model's thread
    needs between its kernels). Unverified: a slab whose bytes an audit finds different is hashed against
    the manifest before it counts (coordinator.audit). A slab whose file cannot be read is not in the
    mapping (`in` maps it), said once."""

    def __init__(
        self,
        directory: str | Path,
        manifest: Manifest | None = None,
        dims: Callable[[SlabKey, ExpertSlab], tuple[int, int]] | None = None,
    ) -> None:
        """`dims`: a slab's (D, F), raising ValueError when its parts are incomplete or disagree; a slab it
        refuses, or whose D is not the manifest's, is not used."""
        self.directory = Path(directory)
        self.manifest = manifest if manifest is not None else read_manifest(self.directory)
        self.dims = dims
        self._entries = {(s.layer, s.expert): s for s in self.manifest.slabs}
        self._read: dict[SlabKey, ExpertSlab | None] = {}  # None: its file cannot be read
        # per layer: each kind's (offset in the data region, type, shape, bytes), from its first file read
        self._layouts: dict[int, dict[str, tuple[int, GGMLQuantizationType, tuple[int, ...], int]]] = {}
        self._lock = threading.Lock()
        self._warned = False
        self.errors: dict[SlabKey, Exception] = {}  # why a slab's file cannot be read

    def __getitem__(self, key: SlabKey) -> ExpertSlab:
        parts = self._read.get(key, _UNREAD)
        if parts is _UNREAD:
            entry = self._entries[key]  # KeyError: not in this shard
            with self._lock:
                parts = self._read.get(key, _UNREAD)
                if parts is _UNREAD:
                    parts = self._read[key] = self._read_file(key, entry)
        if parts is None:
            raise KeyError(key)
        return parts  # type: ignore[return-value]

    def _read_file(self, key: SlabKey, entry: SlabEntry) -> ExpertSlab | None:
        path = os.path.join(self.directory, entry.path)  # a str: pathlib costs more than the mapping
        try:
            layout = self._layouts.get(key[0])
            first = layout is None
            if layout is None:
                layout = _slab_layout(Path(path), entry)
            size, region_bytes = os.stat(path).st_size, entry.size - entry.data_offset
            if size != entry.size or any(at + n > region_bytes for at, _, _, n in layout.values()):
                raise ValueError(f"{entry.path} is {size} bytes, not the manifest's {entry.size}")
            region = _map_region(path, entry.data_offset, region_bytes)
            parts = ExpertSlab.of(SlabTensor(kind, qtype, shape, region[at : at + n])
                                  for kind, (at, qtype, shape, n) in layout.items())  # fmt: skip
            if first:
                if self.dims is not None and (d := self.dims(key, parts)[0]) != self.manifest.n_embd:
                    raise ValueError(f"{entry.path} is {d} wide, the model {self.manifest.n_embd}")
                self._layouts[key[0]] = layout
            return parts
        except (OSError, UserError, ValueError) as e:
            self.errors[key] = e
            if not self._warned:
                self._warned = True
                log.warning("%s: %s; slabs whose file cannot be read here are not used", self.directory, e)
            else:
                log.debug("%s: %s", self.directory, e)
            return None

    def __iter__(self) -> Iterator[SlabKey]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


_UNREAD: Any = object()


def _map_region(path: str, offset: int, size: int) -> np.ndarray:
    """`size` bytes of a file from `offset`, memory-mapped read-only (what np.memmap does, without its
    resolving the path: a node maps thousands of slab files as it starts)."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    try:
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), offset - start + size, access=mmap.ACCESS_READ, offset=start)
    except OSError as e:
        if e.errno in TOO_MANY_FILES:
            raise too_many_open_files(Path(path)) from None
        raise
    return np.frombuffer(mapped, dtype=np.uint8, count=size, offset=offset - start)


def _slab_layout(
    path: Path, entry: SlabEntry
) -> dict[str, tuple[int, GGMLQuantizationType, tuple[int, ...], int]]:
    """Each kind's (offset after the data offset, type, shape, bytes) in one slab file, read with gguf's
    reader; its data offset must be the manifest's."""
    reader = open_gguf(path)
    if reader.data_offset != entry.data_offset:
        raise ValueError(
            f"{entry.path}: its data starts at {reader.data_offset}, not at the manifest's {entry.data_offset}"
        )
    return {kind: (int(t.data_offset) - entry.data_offset, t.tensor_type, torch_shape(t), int(t.n_bytes))
            for kind, t in _slab_tensors(reader, path)}  # fmt: skip


class _Refused(Exception):
    """A slab a shard directory cannot serve; the text says why."""


def _shard_slab(
    directory: Path, manifest: Manifest, layer: int, expert: int, verify: bool, mapper: LazySlabs | None
) -> ExpertSlab:
    if expert >= manifest.n_expert:
        raise _Refused(f"the model has only {manifest.n_expert} experts per layer")
    entry = manifest.slab(layer, expert)
    if entry is None:
        raise _Refused(
            "not in this shard directory (it was cut with --layers/--experts); "
            "shard it with `swarm shard MODEL.gguf -o DIR --layers/--experts`"
        )
    if verify:
        bad = check_slab_file(directory, entry)
        if bad is not None:
            raise _Refused(bad)
    if mapper is not None:
        parts = mapper.get((layer, expert))
        if parts is None:
            why = mapper.errors.get((layer, expert))
            # not this file's fault but the process's own limit (open files): no other slab would load either
            if isinstance(why, UserError) and not isinstance(why, GGUFError):
                raise why
            raise _Refused(str(why or "cannot be read"))
        return parts
    try:
        return read_slab_file(directory / entry.path)
    except GGUFError as e:
        raise _Refused(str(e)) from None


def open_dense(directory: str | Path, verify: bool = False) -> GGUFReader:
    """The memory-mapped dense.gguf of a shard directory (optionally hashed against the manifest first)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    path = directory / manifest.dense.path
    if verify:
        if not path.exists():
            raise UserError(f"{path}: missing; re-run `swarm shard` into {directory}")
        if path.stat().st_size != manifest.dense.size or hash_file_range(path) != manifest.dense.sha256:
            raise UserError(f"{path}: differs from the manifest; re-run `swarm shard` into {directory}")
    return open_gguf(path)
