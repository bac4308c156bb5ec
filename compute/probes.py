"""What this ggml build can multiply and how: which quant types have a kernel, and for which types a matmul of
several activation rows gives each row exactly the bits it gets alone (checked once per process and type on
this build, never assumed).

A batch can give a row other bits in two ways, both chosen inside ggml by the row count: llamafile's tinyBLAS
GEMM (2 or more rows) sums some types in another order than `vec_dot`, and on ARM CPUs with int8 matrix
instructions (i8mm) the `vec_dot` of Q4_0, Q4_1, Q8_0, Q4_K and Q6_K handles two rows at once whenever the
row count is even, which rounds each row differently from one row alone. Rather than know which build does
what, `rows_independent` multiplies random weights of the type by 2, 4, 7 and 8 rows and by each row alone,
and `batch_keeps_rows` (a pure function: tests feed it results recorded on other CPUs) compares the bits.
Where they differ, Graph.mul_mat gives ggml the rows as a batch of one-row products.

numpy only: a node runs this without torch.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Mapping, Sequence

import numpy as np
from gguf import GGMLQuantizationType

from swarm.compute.ggml import F32, compute_lock, ggml_lib

log = logging.getLogger(__name__)

# Row counts a probe multiplies at once: even ones take ggml's 2-row kernels, every one tinyBLAS (>= 2 rows),
# 7 an odd tail after tinyBLAS's tiles.
PROBE_ROWS = (2, 4, 7, 8)
# The probe's weight: 64 rows (split into even chunks for ggml's 2-row kernels on 1 thread) of 512 values
# (whole 256-value super-blocks of the K and IQ types).
PROBE_SHAPE = (64, 512)

_independent: dict[int, bool] = {}
_probe_lock = threading.Lock()
_warned: set[int] = set()  # types whose missing kernel has been logged


def rows_independent(qtype: int) -> bool:
    """Whether a matmul of several rows gives each row the bits it gets alone, for weights of this type as
    stored (not repacked) on this ggml build: probed once per type (a type without a kernel: False)."""
    qtype = int(qtype)
    known = _independent.get(qtype)
    if known is not None:
        return known
    with _probe_lock:
        if qtype not in _independent:
            verdict = has_kernel(qtype) and batch_keeps_rows(*probe_products(qtype))
            _independent[qtype] = verdict
            log.debug("rows of a %s batch keep their bits alone: %s", _name(qtype), verdict)
    return _independent[qtype]




def batch_keeps_rows(batched: Mapping[int, np.ndarray], alone: np.ndarray) -> bool:
    """The probe's decision: every product of n rows (`batched[n]`, [n, O]) equals, bit for bit, the first
    n rows of the rows multiplied one at a time (`alone`, [N, O])."""
    if not batched:
        raise ValueError("no batched products to judge")
    for n, got in batched.items():
        if got.shape != (n, alone.shape[1]) or n > alone.shape[0]:
            raise ValueError(f"a product of {n} rows of shape {got.shape} against rows alone {alone.shape}")
        if not np.array_equal(_bits(got), _bits(alone[:n])):
            return False
    return True


def probe_products(
    qtype: int, counts: Sequence[int] = PROBE_ROWS, seed: int = 0
) -> tuple[dict[int, np.ndarray], np.ndarray]:
    """(batched, alone): seeded random weights of this type (PROBE_SHAPE, quantized by ggml) times the first
    n of max(counts) seeded random rows in one matmul, for each n in counts; and each row alone."""
    rows, cols = PROBE_SHAPE
    w = probe_weight(qtype, rows, cols, seed)
    x = np.random.default_rng(seed + 1).standard_normal((max(counts), cols)).astype(np.float32)
    alone = np.concatenate([product(w, qtype, rows, x[i : i + 1]) for i in range(len(x))])
    return {n: product(w, qtype, rows, x[:n]) for n in counts}, alone


def probe_weight(qtype: int, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """A [rows, cols] matrix in this type: seeded normal values as ggml quantizes them (its row bytes), or, for
    the types whose quantizer first builds codebook tables (seconds of start-up: 16 s for IQ1_S on a fast x86
    core), seeded random codes under a sane scale."""
    g = ggml_lib()
    rng = np.random.default_rng(seed)
    if qtype in _CODEBOOK_TYPES:
        return _random_codes(qtype, rows, cols, rng)
    f = rng.standard_normal((rows, cols)).astype(np.float32)
    if qtype == F32:
        return f.view(np.uint8)
    out = np.empty((rows, int(g.ggml_row_size(qtype, cols))), dtype=np.uint8)
    g.ggml_quantize_chunk(qtype, f.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                          out.ctypes.data_as(ctypes.c_void_p), 0, rows, cols, None)  # fmt: skip
    return out


_Q = GGMLQuantizationType
# Codebook types whose 256-value blocks start with their float16 scale d (any other bytes are valid codes), and
# IQ1_M, whose float16 scale is the top nibbles of the four 16-bit scale words at byte 48.
_CODEBOOK_TYPES = frozenset(int(t) for t in (_Q.IQ2_XXS, _Q.IQ2_XS, _Q.IQ2_S, _Q.IQ1_S, _Q.IQ3_XXS, _Q.IQ3_S,
                                             _Q.IQ1_M))  # fmt: skip
_HALF_2_TO_MINUS_7 = 0x2000


def _random_codes(qtype: int, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    g = ggml_lib()
    size = int(g.ggml_type_size(qtype))
    blocks = rng.integers(0, 256, size=(rows * cols // int(g.ggml_blck_size(qtype)), size), dtype=np.uint8)
    if qtype == int(_Q.IQ1_M):
        words = np.ascontiguousarray(blocks[:, 48:56]).view(np.uint16)
        words &= 0x0FFF
        words[:, 3] |= _HALF_2_TO_MINUS_7
        blocks[:, 48:56] = words.view(np.uint8)
    else:
        blocks[:, 0:2] = np.array([_HALF_2_TO_MINUS_7], dtype=np.uint16).view(np.uint8)
    return blocks.reshape(rows, -1)


def product(w: np.ndarray, qtype: int, rows: int, x: np.ndarray, one_by_one: bool = False) -> np.ndarray:
    """w (`rows` rows of this type, as stored) times the rows of x [N, I] in one ggml mul_mat on 1 thread:
    [N, rows]. `one_by_one`: x given as N batches of one row ([I, 1, N]), as Graph.mul_mat gives a batch
    whose rows would not keep their bits otherwise."""
    g = ggml_lib()
    x = np.ascontiguousarray(x, dtype=np.float32)
    n, cols = x.shape
    if w.nbytes != rows * int(g.ggml_row_size(qtype, cols)):
        raise ValueError(f"{w.nbytes} bytes for {rows} rows of {cols} values of {_name(qtype)}")
    nodes = 16
    mem = np.empty(8 * g.ggml_tensor_overhead() + g.ggml_graph_overhead_custom(nodes, False) + 1024, np.uint8)
    ctx = g.ggml_init(g.ggml_init_params(mem_size=mem.nbytes, mem_buffer=mem.ctypes.data, no_alloc=True))
    if not ctx:
        raise MemoryError("ggml_init failed")
    try:
        wt = g.ggml_new_tensor_2d(ctx, qtype, cols, rows)
        xt = (
            g.ggml_new_tensor_3d(ctx, F32, cols, 1, n)
            if one_by_one
            else g.ggml_new_tensor_2d(ctx, F32, cols, n)
        )
        y = g.ggml_mul_mat(ctx, wt, xt)  # [rows, N] or [rows, 1, N]: the same memory as [N, rows]
        out = np.empty((n, rows), dtype=np.float32)
        wt.contents.data = w.ctypes.data
        xt.contents.data = x.ctypes.data
        y.contents.data = out.ctypes.data
        graph = g.ggml_new_graph_custom(ctx, nodes, False)
        g.ggml_build_forward_expand(graph, y)
        # 1 thread: ggml splits the weight's rows into even chunks, so even row counts do take the 2-row kernels
        plan = g.ggml_graph_plan(graph, 1, None)
        work = np.empty(max(1, int(plan.work_size)), dtype=np.uint8)
        plan.work_data = work.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        with compute_lock:
            status = g.ggml_graph_compute(graph, ctypes.byref(plan))
        if status != 0:
            raise RuntimeError(f"ggml graph compute failed (status {status})")
        return out
    finally:
        g.ggml_free(ctx)


def _bits(a: np.ndarray) -> np.ndarray:
    """float32 values as their bit patterns: equal NaNs equal, 0.0 and -0.0 not."""
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _name(qtype: int) -> str:
    return (
        GGMLQuantizationType(qtype).name if qtype in GGMLQuantizationType._value2member_map_ else str(qtype)
    )


_has_kernel: dict[int, bool] = {}


def has_kernel(qtype: int) -> bool:
    """Whether ggml's CPU backend multiplies this type as stored."""
    known = _has_kernel.get(int(qtype))
    if known is None:
        known = _has_kernel[int(qtype)] = _ggml_has_kernel(int(qtype))
    return known


def _ggml_has_kernel(qtype: int) -> bool:
    g = ggml_lib()
    if not 0 <= int(qtype) < g.GGML_TYPE_COUNT:
        return False
    traits = g.ggml_get_type_traits_cpu(int(qtype))
    if not traits or not ctypes.cast(traits.contents.vec_dot, ctypes.c_void_p).value:
        return False
    vdt = traits.contents.vec_dot_type
    if vdt == int(qtype):
        return True
    pair = g.ggml_get_type_traits_cpu(vdt)
    return bool(pair) and bool(ctypes.cast(pair.contents.from_float, ctypes.c_void_p).value)


def warn_no_kernel(qtype: int, what: str) -> None:
    """Say once per type that it falls back to the exact path."""
    if qtype in _warned:
        return
    _warned.add(qtype)
    log.warning(
        "ggml has no CPU kernel for %s (%s): multiplied as dequantized float32 (the exact path) instead",
        _name(qtype),
        what,
    )
