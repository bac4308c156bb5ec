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
