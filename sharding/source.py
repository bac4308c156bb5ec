"""The source GGUF as `swarm shard` sees it: its expert and dense tensors, the bytes of each slab file
(header, then each tensor's byte range of one expert, padded), and the model fingerprint over them all."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGUFReader, GGUFValueType, Keys

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
from swarm.sharding.manifest import FORMAT_VERSION, KEY_EXPERT, KEY_FINGERPRINT, KEY_FORMAT, KEY_LAYER
from swarm.sharding.pump import Pump, write_all

SMALL_FILE = 64 << 20  # slabs up to this size are hashed as one job
ZEROS = bytes(64)
PLACEHOLDER_FINGERPRINT = "0" * 64
FINGERPRINT_DOMAIN = b"swarm-fingerprint-v1\0"


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


def model_fingerprint(header_sha: str, dense_data_sha: str, slab_sha: dict[tuple[int, int], str]) -> str:
    """What names the model everywhere (slab headers, manifest, mDNS, every call): SHA-256 of a domain tag,
    the source header's hash, the dense data's and every slab's data hash in (layer, expert) order."""
    h = hashlib.sha256(FINGERPRINT_DOMAIN)
    h.update(bytes.fromhex(header_sha))
    h.update(bytes.fromhex(dense_data_sha))
    for key in sorted(slab_sha):
        h.update(bytes.fromhex(slab_sha[key]))
    return h.hexdigest()


def slab_source_bytes(src: SourceModel, layer: int) -> int:
    """Bytes of one expert of `layer` in the source (each slab file's data, before padding)."""
    return sum(et.slab_bytes for et in src.layer_tensors(layer))


def pump_slab(
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
    if slab_source_bytes(src, layer) <= SMALL_FILE:
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
