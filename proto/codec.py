"""The one place tensors and slab sets cross the wire: arrays (numpy; the coordinator's torch tensors too)
<-> expert_pb2 messages.

Tensors travel as raw little-endian row-major bytes with shape and dtype (f32, f16, bf16); rows may also go
as 8-bit blocks (swarm.proto.q8) and answers as float32 packed in byte planes (swarm.proto.planes).
A set of held slabs {(layer, expert)} travels compactly as groups of layer ranges that hold the same
expert ranges, which is what real nodes hold ("experts 0-63 of every layer" is one group).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from swarm.proto import expert_pb2 as pb
from swarm.proto.arrays import BF16, F16, F32, row_dtype, to_numpy, to_torch
from swarm.proto.numerics import Numerics
from swarm.proto.planes import PLANES, PlanesError, pack_planes, unpack_planes
from swarm.proto.q8 import BLOCK, NAMES, Q8_0, Q8_K, Q8Rows, float_rows, wire_row_bytes

_TO_NUMPY = {pb.F32: F32, pb.F16: F16, pb.BF16: BF16}
MAX_DIMS = 8  # rows are 2-D; a shape is refused before any memory is sized by it
MAX_DIM = 1 << 31
_TO_PROTO = {v: k for k, v in _TO_NUMPY.items()}
_Q8_TO_PROTO = {Q8_0: pb.Q8_0, Q8_K: pb.Q8_K}
_Q8_FROM_PROTO = {v: k for k, v in _Q8_TO_PROTO.items()}


class CodecError(ValueError):
    """A message that does not decode: the text says which field is wrong and how."""


def dtype_to_proto(dtype: object) -> int:
    """The wire code of a row type: a numpy dtype (uint16: bfloat16 bits), a torch dtype or f32/f16/bf16."""
    try:
        return _TO_PROTO[row_dtype(dtype)]
    except ValueError:
        raise CodecError(f"dtype {dtype} cannot cross the wire; use float32, float16 or bfloat16") from None


def dtype_from_proto(value: int) -> np.dtype:
    """The numpy dtype rows of this wire code live in (bfloat16: uint16 bit patterns)."""
    try:
        return _TO_NUMPY[value]
    except KeyError:
        raise CodecError(
            f"tensor dtype {pb.DType.Name(value) if value in pb.DType.values() else value} is not "
            "supported; send F32, F16 or BF16"
        ) from None


def encode_tensor(t: Any) -> pb.Tensor:
    """Rows as a wire message: a numpy array, or a torch tensor (copied to host memory if it lives on a
    device), or Q8Rows (8-bit blocks, sent as they are)."""
    if isinstance(t, Q8Rows):
        if sys.byteorder != "little":
            raise CodecError("8-bit rows are sent from little-endian machines only; use --wire f32")
        data = np.ascontiguousarray(to_numpy(t.data))
        return pb.Tensor(dtype=_Q8_TO_PROTO[t.qtype], shape=list(t.shape), data=data.tobytes())
    a = to_numpy(t)
    code = dtype_to_proto(a.dtype)
    a = np.ascontiguousarray(a)
    if sys.byteorder != "little":
        a = a.byteswap()
    return pb.Tensor(dtype=code, shape=list(a.shape), data=a.tobytes())


def encode_planes(values: Any) -> pb.Tensor:
    """float32 answers packed as F32_PLANES (swarm.proto.planes): the same bits, fewer bytes."""
    a = to_numpy(values)
    return pb.Tensor(dtype=pb.F32_PLANES, shape=list(a.shape), data=pack_planes(a))


def decode_array(msg: pb.Tensor, what: str = "tensor") -> np.ndarray:
    """A wire tensor as a numpy array (its own writable copy of the bytes; bfloat16 as uint16 bits;
    F32_PLANES as the float32 values it packs)."""
    planes = msg.dtype == pb.F32_PLANES
    dtype = np.dtype(F32) if planes else dtype_from_proto(msg.dtype)
    shape = tuple(int(d) for d in msg.shape)
    if len(shape) > MAX_DIMS or any(not 0 <= d < MAX_DIM for d in shape):
        shown = ", ".join(str(d) for d in shape[:MAX_DIMS + 1]) + (", ..." if len(shape) > MAX_DIMS + 1 else "")
        raise CodecError(
            f"{what} has shape [{shown}]; send at most {MAX_DIMS} dimensions, each from 0 to {MAX_DIM - 1}"
        )
    n = 1
    for d in shape:
        n *= d
    if planes:
        try:
            return unpack_planes(msg.data, n).reshape(shape)
        except PlanesError as e:
            raise CodecError(
                f"{what} of shape {list(shape)} in F32_PLANES: {e}; send what swarm.proto.planes packs"
            ) from None
    itemsize = dtype.itemsize
    if len(msg.data) != n * itemsize:
        raise CodecError(
            f"{what} has shape {list(shape)} {pb.DType.Name(msg.dtype)} = {n * itemsize} bytes but carries "
            f"{len(msg.data)} bytes; send exactly prod(shape) * itemsize little-endian bytes"
        )
    a = np.frombuffer(bytearray(msg.data), dtype=dtype.newbyteorder("<")).astype(dtype, copy=False)
    try:
        return a.reshape(shape)
    except ValueError as e:  # an empty shape whose other dimensions multiply past what numpy can size
        raise CodecError(f"{what} has shape {list(shape)}, which no array can have ({e}); send its real shape") from None


def decode_rows(msg: pb.Tensor, what: str = "rows") -> np.ndarray:
    """A call's rows as a numpy array: float rows as decode_array gives them, 8-bit rows as the float32 rows
    a kernel quantizes back to exactly the blocks sent (swarm.proto.q8)."""
    qtype = _Q8_FROM_PROTO.get(msg.dtype)
    if qtype is None:
        return decode_array(msg, what)
    shape = tuple(int(d) for d in msg.shape)
    if len(shape) != 2 or any(not 0 <= d < MAX_DIM for d in shape) or shape[1] % BLOCK[qtype]:
        raise CodecError(
            f"{what} has shape {list(shape)[: MAX_DIMS + 1]} in {NAMES[qtype]}; send [N, D] with D a multiple of "
            f"{BLOCK[qtype]}"
        )
    n, d = shape
    row_bytes = wire_row_bytes(qtype, d)
    if len(msg.data) != n * row_bytes:
        raise CodecError(
            f"{what} of shape {list(shape)} in {NAMES[qtype]} are {n * row_bytes} bytes but {len(msg.data)} came; "
            f"send {row_bytes} bytes a row"
        )
    data = np.frombuffer(msg.data, np.uint8).reshape(n, row_bytes)
    return float_rows(Q8Rows(qtype, data, d))


def is_q8(code: int) -> bool:
    """Whether a wire dtype is one of the 8-bit block types (rows only, never an answer)."""
    return code in _Q8_FROM_PROTO


def decode_tensor(msg: pb.Tensor, what: str = "tensor") -> Any:
    """A wire tensor as a CPU torch tensor (the coordinator's side: a node decodes with decode_array)."""
    return to_torch(decode_array(msg, what))


def compute_request(
    layer: int,
    expert_ids: Sequence[int],
    counts: Sequence[int],
    rows: Any,
    fingerprint: str = "",
    out_dtype: object | None = None,
    protocol_version: int = 0,
    numerics: Numerics = Numerics.NATIVE,
    inner: bool = False,
) -> pb.ComputeRequest:
    """The one place a Compute request is built: rows [sum(counts), D] packed expert-major; answers in
    `out_dtype` (a row type, or PLANES: float32 packed as swarm.proto.planes), else in the rows' own type;
    `inner`: each row's gate and up products asked for too."""
    if out_dtype is None:
        out = pb.DTYPE_UNSPECIFIED
    else:
        out = pb.F32_PLANES if isinstance(out_dtype, str) and out_dtype == PLANES else dtype_to_proto(out_dtype)
    return pb.ComputeRequest(
        fingerprint=fingerprint or "",
        protocol_version=protocol_version,
        layer=int(layer),
        expert_ids=[int(e) for e in expert_ids],
        counts=[int(c) for c in counts],
        rows=encode_tensor(rows),
        out_dtype=out,
        numerics=numerics_to_proto(numerics),
        inner=bool(inner),
    )


_NUMERICS = {Numerics.NATIVE: pb.NATIVE, Numerics.EXACT: pb.EXACT}


def numerics_to_proto(numerics: Numerics) -> int:
    if numerics not in _NUMERICS:
        raise CodecError(f"unknown numerics {numerics!r}; use native or exact")
    return _NUMERICS[Numerics(numerics)]


def numerics_from_proto(value: int) -> Numerics:
    """The numerics a call asks for; unspecified means native (the default)."""
    if value == pb.NUMERICS_UNSPECIFIED:
        return Numerics.NATIVE
    for numerics, code in _NUMERICS.items():
        if code == value:
            return numerics
    raise CodecError(f"unknown numerics {value}; this node knows native (1) and exact (2)")


# ---- held slab sets ------------------------------------------------------------------------------


def to_ranges(ids: Iterable[int]) -> list[tuple[int, int]]:
    """[0, 1, 2, 5] -> [(0, 2), (5, 5)] (inclusive)."""
    out: list[tuple[int, int]] = []
    for i in sorted(set(ids)):
        if out and i == out[-1][1] + 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out


def from_ranges(ranges: Iterable[tuple[int, int]]) -> list[int]:
    return [i for a, b in ranges for i in range(a, b + 1)]


def group_slabs(keys: Iterable[tuple[int, int]]) -> list[tuple[list[tuple[int, int]], list[tuple[int, int]]]]:
    """Slabs as (layer ranges, expert ranges) groups: layers holding the same experts share a group."""
    by_layer: dict[int, set[int]] = {}
    for layer, expert in keys:
        by_layer.setdefault(int(layer), set()).add(int(expert))
    by_experts: dict[tuple[tuple[int, int], ...], list[int]] = {}
    for layer, experts in sorted(by_layer.items()):
        by_experts.setdefault(tuple(to_ranges(experts)), []).append(layer)
    return [(to_ranges(layers), list(ranges)) for ranges, layers in by_experts.items()]


def ungroup_slabs(
    groups: Iterable[tuple[Iterable[tuple[int, int]], Iterable[tuple[int, int]]]],
) -> set[tuple[int, int]]:
    experts_of = [(from_ranges(ls), from_ranges(es)) for ls, es in groups]
    return {(layer, e) for layers, experts in experts_of for layer in layers for e in experts}


def held_to_proto(keys: Iterable[tuple[int, int]]) -> list[pb.SlabGroup]:
    return [
        pb.SlabGroup(
            layers=[pb.IdRange(first=a, last=b) for a, b in layers],
            experts=[pb.IdRange(first=a, last=b) for a, b in experts],
        )
        for layers, experts in group_slabs(keys)
    ]


def held_from_proto(groups: Iterable[pb.SlabGroup]) -> set[tuple[int, int]]:
    return ungroup_slabs(
        ([(r.first, r.last) for r in g.layers], [(r.first, r.last) for r in g.experts]) for g in groups
    )
