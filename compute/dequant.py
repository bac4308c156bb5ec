"""GGUF tensor bytes to float32 torch tensors, bit-identical to gguf-py's numpy `gguf.quants.dequantize`.

A node dequantizes each expert slab on first use and again after every eviction, and the coordinator
dequantizes the whole dense GGUF at startup, so this is on the hot path of both. Each quant type is
decoded over all its blocks at once with torch tensor ops: each per-block field copied out once into a
contiguous tensor, bit fields extracted 8 bytes at a time from int64 words (shift and per-byte mask),
the integer values cast to float32 once, then scaled in place.

Bit-identity with gguf-py is the contract (the tests compare float32 bit patterns): every float32 value
is computed by the same sequence of float32 operations as gguf-py's code, e.g. (d * sc) * q - (dmin * m),
one rounding per operation and no fused multiply-add. Integer steps (nibble extraction, offsets) are
exact, so their order is free. Types without a torch decoder here fall back to gguf-py's numpy code.
Like GGUF itself, the word tricks assume a little-endian host (byte k of an int64 is byte k in memory).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from swarm.sharding import gguf_io

log = logging.getLogger(__name__)

Q = GGMLQuantizationType

# Values decoded per step. Every torch op costs microseconds of dispatch whatever its size, and a block's
# scales take a dozen small ops, so steps are large; the bound only keeps the uint8 temporaries of a huge
# tensor (a 151k-vocab token_embd) at a few MiB.
CHUNK_ELEMENTS = 1 << 20

_readonly_lock = threading.Lock()


def _as_tensor(arr: np.ndarray) -> torch.Tensor:
    """A zero-copy torch view of a numpy array, also of a read-only memory map.

    torch warns (once per process) that it cannot mark a tensor read-only. This module only ever reads
    these views, so the warning is silenced for this call alone; the lock keeps concurrent callers from
    interleaving their catch_warnings save/restore of the global filter list.
    """
    if arr.flags.writeable:
        return torch.from_numpy(arr)
    with _readonly_lock, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(arr)


def _field(b: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Bytes [start, stop) of every block [n, type_size] as a new contiguous [n, stop - start] tensor.

    Always a fresh tensor (not .contiguous(), which returns a one-block slice as it is): the dtype views
    taken of it need aligned storage.
    """
    return torch.empty((b.shape[0], stop - start), dtype=torch.uint8).copy_(b[:, start:stop])


def _f16(b: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 field at byte `offset` of every block, as float32 [n, 1]."""
    return _field(b, offset, offset + 2).view(torch.float16).to(torch.float32)


def _words(b: torch.Tensor, start: int, stop: int, groups: int = 1) -> torch.Tensor:
    """Bytes [start, stop) of every block as int64 words [n, groups, (stop - start) / 8 / groups].

    One contiguous copy first: torch's elementwise ops are several times slower on the strided per-block
    fields than on a contiguous tensor, and 8 packed bytes per int64 let one shift-and-mask extract a
    field from 8 bytes at a time.
    """
    n = b.shape[0]
    return _field(b, start, stop).view(torch.int64).view(n, groups, -1)


# Per-byte masks of the low 1, 2 and 4 bits of 8 packed bytes. int64 shifts are arithmetic, but the sign
# bits they smear into the top byte lie above each byte's mask for every shift used here (< 8).
_BYTE_MASK = {1: 0x0101010101010101, 2: 0x0303030303030303, 4: 0x0F0F0F0F0F0F0F0F}


def _unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Words [n, G, W] -> bytes [n, G * (8 / bits) * W * 8] uint8: the lowest `bits` bits of every byte of
    each group, then the next `bits`, ... (ggml's layout: group g's bit-field i is one run of W * 8 values).
    """
    mask = _BYTE_MASK[bits]
    fields = [words & mask] + [(words >> shift) & mask for shift in range(bits, 8, bits)]
    return torch.stack(fields, dim=2).view(torch.uint8).view(words.shape[0], -1)


_BIT_SPREAD = torch.tensor(
    [sum(((v >> k) & 1) << (8 * k) for k in range(8)) for v in range(256)], dtype=torch.int64
)  # byte v -> 8 packed bytes, byte k = bit k of v


def _spread_bits(b: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Bytes [start, stop) of every block -> [n, 8 * (stop - start)] uint8 of their bits, bit i of byte j at
    8 * j + i (the bit order of a little-endian integer), by table lookup.
    """
    idx = b[:, start:stop].to(torch.int32).view(-1)
    return torch.index_select(_BIT_SPREAD, 0, idx).view(torch.uint8).view(b.shape[0], -1)


# Each decoder fills out [n, block_size] float32 from blocks b [n, type_size] uint8: the integer values
# are built exactly in uint8/int8, then _scale casts and scales them.


def _scale(
    out: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    minus: torch.Tensor | None = None,
    plus: torch.Tensor | None = None,
) -> None:
    """out = q * scale - minus (or + plus), q integer [n, G, L], scale/minus/plus float32 [n, G, 1].

    gguf-py's order, one rounding per step: it computes scale * q, and float multiplication is
    commutative bit for bit, so q is cast into `out` once and scaled in place.
    """
    o = out.view(q.shape)
    o.copy_(q)
    o.mul_(scale)
    if minus is not None:
        o.sub_(minus)
    if plus is not None:
        o.add_(plus)


def _q8_0(b: torch.Tensor, out: torch.Tensor) -> None:
    _scale(out, _field(b, 2, 34).view(torch.int8), _f16(b, 0))


def _q4_0(b: torch.Tensor, out: torch.Tensor) -> None:
    _scale(out, _unpack(_words(b, 2, 18), 4).view(torch.int8).sub_(8), _f16(b, 0))


def _q4_1(b: torch.Tensor, out: torch.Tensor) -> None:
    _scale(out, _unpack(_words(b, 4, 20), 4), _f16(b, 0), plus=_f16(b, 2))


def _q5(b: torch.Tensor, qh_at: int) -> torch.Tensor:
    """The 5-bit values of Q5_0 / Q5_1 blocks, [n, 32] uint8: 32 high bits (a little-endian u32), then nibbles."""
    q = _unpack(_words(b, qh_at + 4, qh_at + 20), 4)
    return q.bitwise_or_(_spread_bits(b, qh_at, qh_at + 4).bitwise_left_shift_(4))


def _q5_0(b: torch.Tensor, out: torch.Tensor) -> None:
    _scale(out, _q5(b, 2).view(torch.int8).sub_(16), _f16(b, 0))


def _q5_1(b: torch.Tensor, out: torch.Tensor) -> None:
    _scale(out, _q5(b, 4), _f16(b, 0), plus=_f16(b, 2))


def _q2_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    scales = _field(b, 0, 16)
    dl = (_f16(b, 80) * (scales & 0x0F).to(torch.float32)).view(n, 16, 1)
    ml = (_f16(b, 82) * (scales >> 4).to(torch.float32)).view(n, 16, 1)
    _scale(out, _unpack(_words(b, 16, 80, groups=2), 2).view(n, 16, 16), dl, minus=ml)


def _q3_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    lo = _unpack(_words(b, 96, 104), 4)  # [n, 16]: low 4 bits of the 16 scales
    hi = _field(b, 104, 108)  # top 2 bits, 4 scales a byte
    hi = torch.stack([hi & 3] + [(hi >> s) & 3 for s in (2, 4, 6)], dim=1).view(n, 16)
    sc = lo.bitwise_or_(hi.bitwise_left_shift_(4)).view(torch.int8).sub_(32).to(torch.float32)
    dl = (_f16(b, 108) * sc).view(n, 16, 1)
    q = _unpack(_words(b, 32, 96, groups=2), 2).view(torch.int8)
    # A clear hmask bit subtracts 4 (gguf-py: "the offset is zero when the bitmask is 1").
    q.sub_(_unpack(_words(b, 0, 32), 1).bitwise_xor_(1).bitwise_left_shift_(2).view(torch.int8))
    _scale(out, q.view(n, 16, 16), dl)


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K per-sub-block (d * scale, dmin * min), each [n, 8, 1] float32.

    Bytes 4-15 pack 8 six-bit scales and 8 six-bit mins: scale i < 4 is the low 6 bits of byte 4 + i, scale
    i >= 4 the low nibble of byte 8 + i plus the top 2 bits of byte i as bits 4-5; the mins likewise from
    bytes 8 + i (i < 4), the high nibbles of bytes 8 + i and the top bits of bytes 4 + i. Worked on as three
    int32 words of 4 bytes each (a, m, md), so each step handles 4 scales at once.
    """
    n = b.shape[0]
    w = _field(b, 0, 16).view(torch.int32)  # [n, 4]: d and dmin, then a, m, md
    a, m, md = w[:, 1], w[:, 2], w[:, 3]
    six = torch.stack(
        (
            a & 0x3F3F3F3F,
            (md & 0x0F0F0F0F) | ((a >> 2) & 0x30303030),
            m & 0x3F3F3F3F,
            ((md >> 4) & 0x0F0F0F0F) | ((m >> 2) & 0x30303030),
        ),
        dim=1,
    )  # int32 shifts are arithmetic; the smeared sign bits fall outside each byte's mask
    six = six.view(torch.uint8).to(torch.float32).view(n, 2, 8)  # [n, (scales, mins), 8]
    d = w[:, :1].view(torch.float16).to(torch.float32).view(n, 2, 1)  # [n, (d, dmin), 1]
    prod = d * six
    return prod[:, 0].view(n, 8, 1), prod[:, 1].view(n, 8, 1)


def _q4_k(b: torch.Tensor, out: torch.Tensor) -> None:
    ds, dm = _k_scales(b)
    _scale(out, _unpack(_words(b, 16, 144, groups=4), 4).view(-1, 8, 32), ds, minus=dm)


def _q5_k(b: torch.Tensor, out: torch.Tensor) -> None:
    ds, dm = _k_scales(b)
    q = _unpack(_words(b, 48, 176, groups=4), 4)
    q.bitwise_or_(_unpack(_words(b, 16, 48), 1).bitwise_left_shift_(4))
    _scale(out, q.view(-1, 8, 32), ds, minus=dm)


def _q6_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    ds = (_f16(b, 208) * _field(b, 192, 208).view(torch.int8).to(torch.float32)).view(n, 16, 1)
    q = _unpack(_words(b, 0, 128, groups=2), 4)
    q.bitwise_or_(_unpack(_words(b, 128, 192, groups=2), 2).bitwise_left_shift_(4))
    _scale(out, q.view(torch.int8).sub_(32).view(n, 16, 16), ds)


def _bf16(b: torch.Tensor, out: torch.Tensor) -> None:
    # torch widens bfloat16 by a 16-bit shift, as gguf-py does, for every bit pattern NaNs included.
    out.copy_(b.view(torch.bfloat16))


# ggml type -> decoder of blocks [n, type_size] uint8 into [n, block_size] float32.
_DECODERS: dict[GGMLQuantizationType, Callable[[torch.Tensor, torch.Tensor], None]] = {
    Q.BF16: _bf16,
    Q.Q8_0: _q8_0,
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q2_K: _q2_k,
    Q.Q3_K: _q3_k,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
}

TORCH_TYPES: frozenset[GGMLQuantizationType] = frozenset({Q.F32, Q.F16, *_DECODERS})


def _n_elements(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _check_bytes(nbytes: int, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> None:
    block, size = GGML_QUANT_SIZES[qtype]
    last = int(shape[-1]) if shape else 1
    if last % block != 0:
        raise ValueError(
            f"{qtype.name} rows of {last} elements are not whole blocks of {block} (shape {list(shape)})"
        )
    want = _n_elements(shape) // block * size
    if nbytes != want:
        raise ValueError(
            f"{nbytes} bytes of {qtype.name} do not hold shape {list(shape)} ({want} bytes expected)"
        )


def _typed(data: np.ndarray, dtype: type[np.generic], shape: tuple[int, ...]) -> np.ndarray:
    """F32 / F16 data given as raw bytes or as typed values, flat, checked against `shape`."""
    arr = np.asarray(data)
    if arr.dtype == np.uint8:
        arr = arr.reshape(-1)
        if arr.size % np.dtype(dtype).itemsize != 0:
            raise ValueError(f"{arr.size} bytes are not whole {np.dtype(dtype).name} values")
        arr = arr.view(dtype)
    arr = arr.reshape(-1)
    if arr.size != _n_elements(shape):
        raise ValueError(f"{arr.size} values do not fill shape {list(shape)}")
    return arr


def dequantize(
    data: np.ndarray,
    qtype: GGMLQuantizationType,
    shape: tuple[int, ...],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Raw tensor bytes (or typed values, for F32 / F16) of ggml type `qtype` -> float32 tensor of torch shape `shape`.

    The same contract as `swarm.sharding.gguf_io.dequantize` (which returns numpy): `data` may be a view of a
    read-only memory map, the result never aliases it, and a byte count that does not match `shape` is a
    ValueError. Values are bit-identical to gguf-py's numpy dequantizer (F16 signalling NaNs come out quiet).
    `out`: a contiguous float32 CPU tensor of as many elements to fill (e.g. one half of a fused gate_up)
    instead of a new one; it is returned viewed as `shape`.
    """
    shape = tuple(int(s) for s in shape)
    if out is not None:
        _check_out(out, shape)
    if qtype in (Q.F32, Q.F16):
        src = _as_tensor(_typed(data, np.float32 if qtype == Q.F32 else np.float16, shape))
        if out is None:
            # A copy even for F32: the working copy must not alias the memory map.
            return src.to(torch.float32, copy=True).view(shape)
        return out.view(-1).copy_(src).view(shape)
    decode = _DECODERS.get(qtype)
    if decode is None:
        values = _fallback(data, qtype, shape)
        return values if out is None else out.view(shape).copy_(values)
    raw = np.asarray(data).reshape(-1).view(np.uint8)
    _check_bytes(raw.size, qtype, shape)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = _as_tensor(raw).view(-1, size)
    n = blocks.shape[0]
    if out is None:
        out = torch.empty(shape, dtype=torch.float32)
    values = out.view(n, block)
    step = max(1, CHUNK_ELEMENTS // block)
    for i in range(0, n, step):
        decode(blocks[i : i + step], values[i : i + step])
    return out.view(shape)


def _check_out(out: torch.Tensor, shape: tuple[int, ...]) -> None:
    if out.dtype != torch.float32 or out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous float32 CPU tensor, got {out.dtype} on {out.device}"
            + ("" if out.is_contiguous() else " (not contiguous)")
        )
    if out.numel() != _n_elements(shape):
        raise ValueError(f"out has {out.numel()} elements, shape {list(shape)} needs {_n_elements(shape)}")


def _fallback(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """Types without a torch decoder here (IQ*, TQ*, MXFP4, ...): gguf-py's numpy code, the one place it is used."""
    log.debug("dequantizing %s with gguf-py's numpy code", qtype.name)
    return torch.from_numpy(gguf_io.dequantize(data, qtype, shape))
