"""Activation rows quantized as a native kernel quantizes them, before they leave the coordinator: the 8-bit
block type ggml pairs a weight type with (its vec_dot_type), written by ggml's own CPU quantizer for it
(`from_float`, the routine its matmuls call on float32 rows), so that a node is sent a quarter of the bytes
and multiplies the same blocks (swarm.proto.q8 says how a node turns them back into rows ggml takes).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterable

import numpy as np

from swarm.compute import probes
from swarm.compute.ggml import ggml_lib
from swarm.proto.q8 import BLOCK, GGML_BLOCK, NAMES, Q8_0, Q8_K, Q8Rows, float_rows, to_wire

log = logging.getLogger(__name__)

ROW_TYPES = frozenset((Q8_0, Q8_K))  # the 8-bit types rows cross the wire in
F32, F16, BF16 = 0, 1, 30  # ggml's type numbers


def row_type(weight_qtypes: Iterable[int]) -> int | None:
    """The 8-bit type the rows multiplied by all these weight types are quantized to, when they share one
    and it is Q8_0 or Q8_K; None otherwise (float weights take float rows; Q4_1 / Q5_1 take Q8_1, whose
    block carries a sum of the unrounded scale that a receiver cannot make again; a type ggml has no
    kernel for is multiplied in float32)."""
    g = ggml_lib()
    found: set[int] = set()
    for qtype in weight_qtypes:
        if not probes.has_kernel(int(qtype)):
            return None
        found.add(int(g.ggml_get_type_traits_cpu(int(qtype)).contents.vec_dot_type))
    if len(found) != 1:
        return None
    (kind,) = found
    return kind if kind in ROW_TYPES else None


def quantize_rows(x: np.ndarray, qtype: int) -> np.ndarray:
    """float32 rows [N, D] as ggml's quantizer for qtype writes them: uint8 [N, D / block * block bytes]."""
    x = np.ascontiguousarray(x, np.float32)
    n, d = x.shape
    if d % BLOCK[qtype]:
        raise ValueError(f"rows of {d} values are not whole {NAMES[qtype]} blocks of {BLOCK[qtype]}")
    out = np.empty((n, d // BLOCK[qtype] * GGML_BLOCK[qtype].itemsize), np.uint8)
    if n:
        from_float = ggml_lib().ggml_get_type_traits_cpu(qtype).contents.from_float
        from_float(
            x.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), out.ctypes.data_as(ctypes.c_void_p), n * d
        )
    return out


def wire_rows(x: np.ndarray, qtype: int) -> Q8Rows | None:
    """Rows [N, D] as the wire's blocks of qtype, or None when some row's blocks would not reach a node's
    kernel as they are (their float preimage does not quantize back to them: a row ggml rounded to a zero
    scale but not to zero values). Checked here, with this build's quantizer: a node of the same numerics
    class quantizes the same way."""
    blocks = to_wire(quantize_rows(x, qtype), qtype)
    rows = Q8Rows(qtype, blocks, int(x.shape[1]))
    again = to_wire(quantize_rows(float_rows(rows), qtype), qtype)
    if not np.array_equal(again, blocks):
        bad = int((again != blocks).any(axis=1).sum())
        log.debug(
            "%d of %d rows do not survive %s on the wire: sent as float32", bad, len(blocks), NAMES[qtype]
        )
        return None
    return rows


def vec_dot_type(weight_qtype: int) -> int:
    """The type ggml turns a row into before multiplying it by a matrix of weight_qtype (F32 where this build
    multiplies that type in float32 only)."""
    if int(weight_qtype) == F32 or not probes.has_kernel(int(weight_qtype)):
        return F32
    return int(ggml_lib().ggml_get_type_traits_cpu(int(weight_qtype)).contents.vec_dot_type)


def kernel_values(x: np.ndarray, weight_qtype: int) -> np.ndarray | None:
    """float32 rows [N, D] as the values a native kernel for weight_qtype multiplies (float64, exact: an 8-bit
    block's d * q, an F16 / BF16 rounding), or None for an activation type whose kernel adds terms that are
    not a product of these values (Q8_1 carries a rounded sum of its block)."""
    x = np.ascontiguousarray(x, np.float32)
    kind = vec_dot_type(weight_qtype)
    if kind == F32:
        return x.astype(np.float64)
    if kind == F16:
        return x.astype(np.float16).astype(np.float64)  # round to nearest even, as ggml's F16C conversion
    if kind == BF16:
        return _bf16(x)
    if kind not in ROW_TYPES:
        return None
    n, d = x.shape
    blocks = quantize_rows(x, kind).view(GGML_BLOCK[kind]).reshape(n, d // BLOCK[kind])
    scale = blocks["d"].astype(np.float64)[..., None]
    return (scale * blocks["qs"].astype(np.float64)).reshape(n, d)


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> the BF16 values ggml's ggml_compute_fp32_to_bf16 makes (nearest even; a NaN stays NaN)."""
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint32)
    rounded = np.where(np.isnan(x), (bits >> 16).astype(np.uint32) | 64, rounded)
    return (rounded << 16).astype(np.uint32).view(np.float32).astype(np.float64)


def kernel_steps(x: np.ndarray, weight_qtype: int) -> np.ndarray:
    """float32 rows [N, D] -> float64 [N, D]: the step between the values a native kernel for weight_qtype can
    round each element to (its 8-bit block's scale d, one F16 / BF16 unit of it; 0 where rows stay float32,
    and for a type kernel_values cannot reproduce)."""
    x = np.ascontiguousarray(x, np.float32)
    kind = vec_dot_type(weight_qtype)
    if kind == F16:
        return np.spacing(np.abs(x).astype(np.float16)).astype(np.float64)
    if kind == BF16:
        return np.abs(_bf16(x)) * 2.0**-7
    if kind not in ROW_TYPES:
        return np.zeros(x.shape)
    n, d = x.shape
    blocks = quantize_rows(x, kind).view(GGML_BLOCK[kind]).reshape(n, d // BLOCK[kind])
    scale = np.abs(blocks["d"].astype(np.float64))[..., None]
    return np.broadcast_to(scale, (n, d // BLOCK[kind], BLOCK[kind])).reshape(n, d)


def kernel_offsets(x: np.ndarray, weight_qtype: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 rows [N, D] -> (offset, unit), float64 [N, D]: where each element lies between two values a
    native kernel for weight_qtype may round it to, in units of the spacing its quantizer rounds on (0 on a
    value, 0.5 on a boundary), and that unit (0 where rows stay float32, and for a type kernel_values cannot
    reproduce). An 8-bit block type rounds x·127/amax of its block: its unit is amax/127, not the scale it
    stores (Q8_0 stores it rounded to F16, so |x - d·q| / d is not where x lay)."""
    x = np.ascontiguousarray(x, np.float32)
    x64 = x.astype(np.float64)
    kind = vec_dot_type(weight_qtype)
    if kind in ROW_TYPES:
        n, d = x.shape
        amax = np.abs(x64).reshape(n, d // BLOCK[kind], BLOCK[kind]).max(axis=2, keepdims=True)
        unit = np.broadcast_to(amax / 127, (n, d // BLOCK[kind], BLOCK[kind])).reshape(n, d)
        with np.errstate(invalid="ignore", divide="ignore"):
            p = x64 / unit
            offset = np.abs(p - np.rint(p))
    else:
        unit = kernel_steps(x, weight_qtype)
        made = kernel_values(x, weight_qtype) if kind in (F16, BF16) else x64
        assert made is not None
        with np.errstate(invalid="ignore", divide="ignore"):
            offset = np.abs(x64 - made) / unit
    return np.where(unit > 0, offset, 0.0), unit
