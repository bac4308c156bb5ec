"""GGUF headers built in memory with gguf.GGUFWriter, so that tensor bytes can be streamed after them.

`swarm shard` never holds a tensor in memory: it builds a file's header (magic, metadata, tensor infos,
padding up to the data) here, writes it, then copies each tensor's bytes in chunks, each tensor padded
to the alignment as GGUFWriter itself would pad it.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import GGUF_DEFAULT_ALIGNMENT
from gguf.gguf_writer import WriterState

from swarm.sharding.gguf_io import GGUFError


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: its name, ggml type, torch-order shape and byte count."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    n_bytes: int


@dataclass(frozen=True)
class KV:
    """One metadata value with its exact GGUF type, so a copy keeps the source's types."""

    key: str
    value: Any
    vtype: GGUFValueType
    sub_type: GGUFValueType | None = None


class _MemoryWriter(GGUFWriter):
    """GGUFWriter whose header goes to a BytesIO; also writes empty arrays, which GGUF allows."""

    def _pack_val(
        self, val: Any, vtype: GGUFValueType, add_vtype: bool, sub_type: GGUFValueType | None = None
    ) -> bytes:
        if vtype == GGUFValueType.ARRAY and len(val) == 0:
            head = self._pack("I", vtype) if add_vtype else b""
            return head + self._pack("I", sub_type or GGUFValueType.UINT8) + self._pack("Q", 0)
        return super()._pack_val(val, vtype, add_vtype, sub_type)


def pad(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def build_header(
    arch: str, kvs: Sequence[KV], tensors: Sequence[TensorSpec], alignment: int = GGUF_DEFAULT_ALIGNMENT
) -> bytes:
    """Header bytes of a GGUF with these metadata and tensors, padded up to where tensor data starts.

    `kvs` must contain general.architecture if the file should have it (it is not added here, so a
    copied key order is kept). Tensor i's data then lies at header_len + sum(pad(n_bytes_j)) for j < i.
    """
    w = _MemoryWriter(None, arch)
    w.kv_data[0].clear()  # drop the architecture key the constructor added; `kvs` carries it in order
    w.data_alignment = alignment
    for kv in kvs:
        w.add_key_value(kv.key, kv.value, kv.vtype, kv.sub_type)
    for t in tensors:
        block, type_size = GGML_QUANT_SIZES[t.qtype]
        assert t.shape[-1] % block == 0 and int(np.prod(t.shape)) // block * type_size == t.n_bytes, t
        # raw_dtype given and a non-uint8 dtype: GGUFWriter takes `shape` as the element shape.
        w.add_tensor_info(t.name, list(t.shape), np.dtype(np.float32), t.n_bytes, raw_dtype=t.qtype)
    buf = io.BytesIO()
    # GGUFWriter only opens files by path; handing it an open buffer keeps the header in memory.
    w.fout = [buf]  # type: ignore[list-item]
    w.state = WriterState.EMPTY
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    head = buf.getvalue()
    return head + b"\0" * (pad(len(head), alignment) - len(head))


def copy_kvs(reader: GGUFReader, path: str = "") -> list[KV]:
    """Every metadata key of a file with its exact type; strings as raw bytes (no re-encoding)."""
    out: list[KV] = []
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        vtype = field.types[0]
        if vtype == GGUFValueType.STRING:
            out.append(KV(key, field.parts[field.data[0]].tobytes(), vtype))
        elif vtype == GGUFValueType.ARRAY:
            if len(field.types) > 2:
                raise GGUFError(f"{path}: metadata key {key} is a nested array, which swarm cannot copy yet")
            sub = field.types[1] if len(field.types) > 1 else GGUFValueType.UINT8
            if sub == GGUFValueType.STRING:
                val: Any = [field.parts[i].tobytes() for i in field.data]
            else:
                val = [field.parts[i].tolist()[0] for i in field.data]
            out.append(KV(key, val, vtype, sub))
        else:
            out.append(KV(key, field.parts[field.data[0]].tolist()[0], vtype))
    return out


def alignment_of(reader: GGUFReader) -> int:
    field = reader.fields.get("general.alignment")
    if field is None:
        return GGUF_DEFAULT_ALIGNMENT
    return int(field.parts[field.data[0]][0])


def padding(n_bytes: int, alignment: int) -> bytes:
    return b"\0" * (pad(n_bytes, alignment) - n_bytes)
