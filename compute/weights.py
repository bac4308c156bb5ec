"""Weights as ggml multiplies them: a matrix in its file type at a fixed address (a view of the memory map,
nothing copied), ggml's repacked layout for the types this CPU has repacked kernels for, and the float32
fallback for a type ggml has no kernel for.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from swarm.compute import probes
from swarm.compute.ggml import F32, ggml_lib
from swarm.compute.values import float32_values
from swarm.proto.numerics import Numerics

log = logging.getLogger(__name__)

_QTYPES = frozenset(int(t) for t in GGMLQuantizationType)

@dataclass(frozen=True)
class Weight:
    """A matrix [O, I] in a ggml type at a fixed address: a view of a file's bytes or a float32 tensor.

    `keep` holds whatever owns the memory (a memory-mapped numpy array, a torch tensor), so the address
    stays valid as long as the Weight lives.
    """

    qtype: int
    rows: int  # O
    cols: int  # I
    ptr: int
    nbytes: int
    keep: object
    experts: int = 1  # > 1: a stack of that many [O, I] matrices, one after the other (a GGUF *_exps tensor)
    repack: Repacked | None = None  # set: the bytes at ptr are ggml's repacked layout, not the file's

    def stacked(self, experts: int, first: int) -> Weight:
        """The stack whose expert `first` this matrix (or the first of this stack) is, `experts` matrices in
        all, back to back in memory."""
        one = self.nbytes // self.experts
        return Weight(self.qtype, self.rows, self.cols, self.ptr - first * one, experts * one, self.keep, experts,
                      self.repack)  # fmt: skip

    @property
    def stored(self) -> np.ndarray:
        """The matrix's bytes in its file layout (for dequantizing it): the file's own, even when repacked."""
        return self.repack.source if self.repack is not None else np.asarray(self.keep)

    @classmethod
    def of_bytes(cls, data: np.ndarray, qtype: int, shape: Sequence[int]) -> Weight:
        """The stored bytes of a GGUF tensor (torch-order `shape` [O, I] or [O, ..., I] flattened to 2-D)."""
        qtype = int(qtype)
        cols = int(shape[-1])
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        if cols % block:
            raise ValueError(f"rows of {cols} values are not whole {block}-value blocks")
        want = rows * (cols // block) * type_size
        arr = np.asarray(data)
        if arr.nbytes != want:
            raise ValueError(f"{arr.nbytes} bytes for a [{rows}, {cols}] matrix of type {qtype}; want {want}")
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        return cls(qtype, rows, cols, arr.ctypes.data, want, arr)

    @classmethod
    def of_float(cls, w: np.ndarray) -> Weight:
        """A float32 matrix [O, I] (C-contiguous) for the exact path."""
        if not isinstance(w, np.ndarray) or w.dtype != np.float32 or not w.flags.c_contiguous or w.ndim != 2:
            raise ValueError("Weight.of_float takes a C-contiguous 2-D float32 numpy array")
        return cls(F32, int(w.shape[0]), int(w.shape[1]), w.__array_interface__["data"][0], w.nbytes, w)


class Repacked:
    """A matrix copied into ggml's CPU_REPACK buffer (the interleaved layout llama.cpp loads Q4_0, Q4_K and
    IQ4_NL weights into on AVX2 CPUs, other types on ARM): its products run ggml's repacked kernels. Holds
    the buffer (freed with this object) and the file bytes it came from (`source`, for dequantizing)."""

    def __init__(self, ctx: object, buffer: object, tensor: object, source: np.ndarray) -> None:
        self.g = ggml_lib()
        self.ctx, self.buffer, self.source = ctx, buffer, source
        self.ptr = int(tensor.contents.data)
        self.extra = int(tensor.contents.extra)

    def __del__(self) -> None:
        g = getattr(self, "g", None)
        if g is None or getattr(g, "ggml_free", None) is None:  # at interpreter exit ggml may be gone first
            return
        if self.buffer:
            g.ggml_backend_buffer_free(self.buffer)
            self.buffer = None
        if self.ctx:
            g.ggml_free(self.ctx)
            self.ctx = None


_repack_buft: list[object] = []  # [the CPU_REPACK buffer type, or None where ggml has none]
_repackable: dict[tuple[int, int], bool] = {}
_anchor: list[Repacked] = []  # [a small CPU_REPACK buffer kept for the process's life]


def _repack_buffer_type() -> object | None:
    if not _repack_buft:
        g = ggml_lib()
        reg = g.ggml_backend_cpu_reg()
        fn = g.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
        found = None
        if fn:
            extra = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(fn)(
                g.ggml_backend_reg_dev_get(reg, 0)
            )
            i = 0
            while extra and extra[i]:
                if g.ggml_backend_buft_name(extra[i]) == b"CPU_REPACK":
                    found = extra[i]
                i += 1
        _repack_buft.append(found)
    return _repack_buft[0]


def _new_repacked(qtype: int, ne: Sequence[int]) -> tuple[object, object, object] | None:
    """A tensor of this type and ggml shape in a new CPU_REPACK buffer (ctx, buffer, tensor), or None when
    ggml has no repacked layout for it on this CPU."""
    g = ggml_lib()
    buft = _repack_buffer_type()
    if buft is None:
        return None
    ctx = g.ggml_init(
        g.ggml_init_params(mem_size=4 * g.ggml_tensor_overhead(), mem_buffer=None, no_alloc=True)
    )
    t = g.ggml_new_tensor(ctx, qtype, len(ne), (ctypes.c_int64 * len(ne))(*ne))
    buffer = g.ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft)
    if not buffer or not t.contents.extra:  # no layout for this type/shape here: ggml left it unset
        if buffer:
            g.ggml_backend_buffer_free(buffer)
        g.ggml_free(ctx)
        return None
    return ctx, buffer, t


def repackable(qtype: int, rows: int) -> bool:
    """Whether matrices of this type with this many rows get a repacked layout on this CPU (cheap, cached)."""
    key = (int(qtype), int(rows))
    known = _repackable.get(key)
    if known is None:
        block = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][0] if qtype in _QTYPES else 1
        made = _new_repacked(int(qtype), (block, int(rows))) if block > 1 else None
        known = _repackable[key] = made is not None
        if made is not None:
            rp = Repacked(*made, np.empty(0, np.uint8))
            if not _anchor:
                _anchor.append(rp)  # kept: the first is repack_anchor()
    return known


def repack_anchor() -> Repacked:
    """A small buffer of ggml's CPU_REPACK type, alive as long as the process: what a graph's weight slot for
    repacked matrices points at, since ggml reads only the buffer's type there (the matrix comes with each
    run). Only asked for once some matrix was found repackable."""
    assert _anchor, "repack_anchor() before any repackable() found a repacked layout"
    return _anchor[0]


def repacked(w: Weight) -> Weight:
    """w (a matrix or a stack of experts) in ggml's repacked layout, where this CPU has one for its type and
    shape (llama.cpp's default for them), else w itself. The file's pages under w are released once copied
    (they come back from the page cache if read again), so the copy replaces them in resident memory.

    A repacked matrix is multiplied one activation row at a time (repacked gemv, Graph.mul_mat) unless its
    GEMM gives a row the same bits (graph.repacked_rows_independent), and its experts by mul_mat_id, which
    takes one row at a time too, so a row's bits never depend on its batch."""
    if w.repack is not None or not repackable(w.qtype, w.rows):  # (float types have none: 1-value blocks)
        return w
    ne = (w.cols, w.rows, *([w.experts] if w.experts > 1 else []))
    made = _new_repacked(w.qtype, ne)
    if made is None:
        return w
    ctx, buffer, t = made
    g = ggml_lib()
    g.ggml_backend_tensor_set(t, ctypes.c_void_p(w.ptr), 0, w.nbytes)
    from swarm.compute import pages

    source = np.asarray(w.keep)
    pages.release(source, w.ptr, w.nbytes)
    rp = Repacked(ctx, buffer, t, source)
    return Weight(w.qtype, w.rows, w.cols, rp.ptr, w.nbytes, rp, w.experts, rp)


def stored_weight(
    data: np.ndarray, qtype: int, shape: Sequence[int], numerics: Numerics, what: str = "a weight"
) -> Weight:
    """The Weight a matrix is multiplied as: its stored bytes (native, or any float32 tensor), else a float32
    copy dequantized bit-identically to gguf-py (exact, or a type ggml has no kernel for)."""
    qtype = int(qtype)
    if qtype == F32:
        return Weight.of_bytes(data, qtype, shape)
    if numerics == Numerics.NATIVE and probes.has_kernel(qtype):
        return repacked(Weight.of_bytes(data, qtype, shape))
    if numerics == Numerics.NATIVE:
        probes.warn_no_kernel(qtype, what)

    cols = int(shape[-1])
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return Weight.of_float(float32_values(data, qtype, (rows, cols)))

