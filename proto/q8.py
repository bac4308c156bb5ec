"""Rows on the wire as 8-bit blocks: the type a native kernel quantizes its activation rows to (ggml's
vec_dot_type: Q8_K for the K-quants, Q8_0 for Q4_0 / Q8_0 / IQ4_NL / MXFP4), already quantized by the sender
with ggml's own quantizer for that type, at about a quarter of float32's bytes.

A node gives such rows to ggml as float32 rows that ggml's quantizer maps back to exactly these blocks (their
"preimage", `float_rows`): every kernel path (plain, tinyBLAS, the repacked kernels, which take only float32
rows) then quantizes them to the blocks the sender made from its float32 rows, and multiplies exactly what it
would have multiplied had the float32 rows come. The sender checks that they do before it sends them
(swarm.compute.rowquant), so the answer is the float32 rows' bit for bit.

- Q8_0: 32 values a block, an f16 scale d then 32 int8 (34 bytes). Its preimage is q * d: the largest of
  them is 127 * d, whose d ggml computes back exactly, and each q * d times ggml's inverse scale lies within
  a few float32 ulps of q.
- Q8_K: 256 values a block, an f32 scale d then 256 int8 (260 bytes; ggml's block also has 16 int16 sums of
  the int8, which depend on them only: they stay off the wire and ggml's quantizer makes them again). ggml
  derives d from the block's signed largest value m as 1 / (-127 / m): the preimage puts at the first -127 a
  value m found among the few floats next to -127 * d for which that gives d back exactly, q * d elsewhere.

Only numpy here: a node never loads torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

Q8_0 = 8  # ggml's type numbers (GGMLQuantizationType)
Q8_K = 15
BLOCK = {Q8_0: 32, Q8_K: 256}  # values a block
WIRE_BLOCK = {
    Q8_0: np.dtype([("d", "<f2"), ("qs", "i1", (32,))]),  # ggml's block_q8_0, as it is
    Q8_K: np.dtype([("d", "<f4"), ("qs", "i1", (256,))]),  # ggml's block_q8_K less its bsums
}
GGML_BLOCK = {
    Q8_0: WIRE_BLOCK[Q8_0],
    Q8_K: np.dtype([("d", "<f4"), ("qs", "i1", (256,)), ("bsums", "<i2", (16,))]),
}
NAMES = {Q8_0: "q8_0", Q8_K: "q8_k"}
# How far from -127 * d the Q8_K preimage looks for the largest value (float32 ulps): the value it was made
# from lies within a few, since d = 1 / (-127 / m) rounds twice.
_SEARCH_ULPS = 24


@dataclass(frozen=True)
class Q8Rows:
    """Rows [N, D] as 8-bit blocks of `qtype`, in the wire's block layout (`WIRE_BLOCK`)."""

    qtype: int  # Q8_0 or Q8_K
    data: Any  # uint8 [N, wire_row_bytes(qtype, D)]: numpy, or a torch tensor in the coordinator
    cols: int  # D

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.data.shape[0]), self.cols)


def wire_row_bytes(qtype: int, cols: int) -> int:
    """Bytes of one row of `cols` values on the wire."""
    return cols // BLOCK[qtype] * WIRE_BLOCK[qtype].itemsize


def to_wire(blocks: np.ndarray, qtype: int) -> np.ndarray:
    """ggml's blocks (uint8 [N, row bytes], as its quantizer wrote them) in the wire's layout [N, wire bytes]."""
    n = blocks.shape[0]
    if qtype == Q8_0:
        return blocks
    full = np.ascontiguousarray(blocks).view(GGML_BLOCK[qtype])
    out = np.empty(full.shape, WIRE_BLOCK[qtype])
    out["d"], out["qs"] = full["d"], full["qs"]
    return out.view(np.uint8).reshape(n, -1)


def float_rows(rows: Q8Rows) -> np.ndarray:
    """The float32 rows [N, D] that ggml's quantizer for rows.qtype maps to exactly these blocks (see the
    module's docstring); a block made from other values (none of ggml's own) gives rows that do not."""
    data = np.ascontiguousarray(rows.data, np.uint8)
    n, d = rows.shape
    blocks = data.reshape(-1).view(WIRE_BLOCK[rows.qtype])
    q = blocks["qs"].astype(np.float32)  # [blocks, block]
    with np.errstate(all="ignore"):  # (a scale no quantizer made, inf or NaN, is the caller's garbage)
        if rows.qtype == Q8_0:
            x = q * blocks["d"].astype(np.float32)[:, None]  # exact: 8 bits times 11
        else:
            x = _q8_k_floats(blocks["d"].astype(np.float32), q)
    return x.reshape(n, d)


def _q8_k_floats(d: np.ndarray, q: np.ndarray) -> np.ndarray:
    x = q * d[:, None]
    m = _largest(d)
    at = q == -127.0  # the first of them is where the block's largest value was
    x = np.where(at, m[:, None], x)
    # +127 came from a value of the other sign just short of the largest in size: one ulp inside it
    opposite = (-m).view(np.int32) - np.where(m != 0, 1, 0).astype(np.int32)
    return np.where(q == 127.0, opposite.view(np.float32)[:, None], x).astype(np.float32)


def _largest(d: np.ndarray) -> np.ndarray:
    """Per block, a float32 m with 1 / (-127 / m) == d in float32 (as ggml's quantize_row_q8_K computes d),
    the nearest such to -127 * d; -127 * d where none is near (a block ggml did not make)."""
    start = (np.float32(-127.0) * d).astype(np.float32)
    best = start.copy()
    found = d == 0
    bits = start.view(np.int32)
    for k in sorted(range(-_SEARCH_ULPS, _SEARCH_ULPS + 1), key=abs):
        if found.all():
            break
        m = (bits + np.int32(k)).view(np.float32)  # |k| ulps away, one way or the other
        back = (np.float32(1.0) / (np.float32(-127.0) / m)).astype(np.float32)
        hit = ~found & (back.view(np.int32) == d.view(np.int32))
        best = np.where(hit, m, best)
        found |= hit
    return best
