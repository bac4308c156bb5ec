"""Matrix products on GGUF weights as they are stored, with ggml's CPU kernels (the ones llama.cpp runs).

Dimension letters: N rows (tokens or token-expert pairs), I input width, O output width, F expert width.

Two numerics, one code path:
- `native` (the default): every weight stays in its file type (Q4_K, Q8_0, BF16, ...) and ggml multiplies
  the stored blocks, quantizing each activation row to the type its kernel pairs with (Q8_K for K-quants,
  Q8_0/Q8_1 for the legacy quants, BF16 for BF16, ...). These are llama.cpp's numerics.
- `exact`: float32 weights (dequantized once, bit-identical to gguf-py) times float32 activations with
  ggml's F32 kernel: the oracle that matches transformers.

ggml is taken through ggml-python (its package builds ggml from source, with the build's SIMD level: AVX2,
AVX-512, NEON). Each activation row is quantized on its own, and every output element is computed by one
kernel whatever the batch: a row's result does not depend on how many rows share the matmul, which other
sequences are in the step, or which process on the same CPU computes it. Two kernels compute products:
ggml's `vec_dot` (one weight row times one activation row) and, for matmuls of 2 or more rows, llamafile's
tinyBLAS GEMM when ggml is built with it (the README's install command: several rows per weight read,
1.3-1.8x less time per row on Q8_0, bench/tinyblas.py). For Q8_0, Q4_0 and Q5_0 on x86 tinyBLAS sums each element exactly as
`vec_dot` does (the same integer block dots, one FMA per block in block order, the same horizontal sum);
for other types it does not, so those are multiplied with every row in its own batch slot, where tinyBLAS
never runs. Which types take tinyBLAS is checked once per process on this build (`_tinyblas_exact`),
never assumed. (A different SIMD level rounds differently, so a swarm mixing AVX2 and AVX-512 nodes agrees
to rounding, not to the bit.)

Weights are multiplied where they lie (a view of the GGUF or slab memory map): nothing is copied. One
process runs one ggml graph at a time on its thread budget (`set_threads`), and ggml's OpenMP threads are
torch's (the one libgomp in the process), so the two pools never fight over the cores.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

log = logging.getLogger(__name__)

Numerics = Literal["native", "exact"]
NATIVE: Numerics = "native"
EXACT: Numerics = "exact"
NUMERICS: tuple[Numerics, ...] = (NATIVE, EXACT)

_F32 = int(GGMLQuantizationType.F32)

# ggml is loaded on first use: `import ggml` loads the shared libraries, which a process that never
# multiplies (swarm inspect, shard) should not pay for.
_ggml = None
_load_lock = threading.Lock()
_compute_lock = threading.Lock()  # one graph at a time per process: one thread budget
_threads = 0  # 0: torch's thread count
_warned: set[int] = set()


def ggml_lib():  # noqa: ANN201 - the ggml-python module
    global _ggml
    if _ggml is None:
        with _load_lock:
            if _ggml is None:
                import ggml

                ggml.ggml_cpu_init()
                _callbacks.append(ggml.ggml_log_callback(_ggml_log))  # kept alive while ggml may call it
                ggml.ggml_log_set(_callbacks[-1], None)
                if ggml.ggml_cpu_has_avx512():
                    log.warning(AVX512_WARNING)
                elif ggml.ggml_cpu_has_avx2() and not ggml.ggml_cpu_has_llamafile():
                    log.warning(NO_TINYBLAS_WARNING)
                _ggml = ggml
    return _ggml


def _ggml_log(level: int, text: bytes | None, _user: object) -> None:
    """ggml's own messages (a tensor repacked, a buffer allocated) into this module's log: debug-level news
    stays out of a user's terminal, warnings and errors do not."""
    msg = (text or b"").decode(errors="replace").rstrip()
    if msg:
        log.log(logging.WARNING if level >= 3 else logging.DEBUG, "ggml: %s", msg)  # 3: GGML_LOG_LEVEL_WARN


_callbacks: list[object] = []


# ggml built for an AVX-512 CPU takes AVX-512 code paths in some quantized dot products whose float sums round
# differently from the AVX2 ones: the same slab gives other bits than on an AVX2 node (an audit would then ban
# an honest node) and strays from llama.cpp's own kernels (which take the AVX2 paths for these types on both).
# On x86, ggml is built for the AVX2 baseline (README: the install command's CMAKE_ARGS).
GGML_CMAKE_ARGS = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_LLAMAFILE=ON"
AVX512_WARNING = (
    "ggml was built with AVX-512 kernels: its results differ in the last bits from AVX2 machines' and from "
    f'llama.cpp\'s; reinstall ggml-python with CMAKE_ARGS="{GGML_CMAKE_ARGS}" (see the README)'
)
NO_TINYBLAS_WARNING = (
    "ggml was built without llamafile's tinyBLAS: prompts are read up to 1.8x slower on Q8_0 weights; reinstall "
    f'ggml-python with CMAKE_ARGS="{GGML_CMAKE_ARGS}" (see the README)'
)


def set_threads(n: int) -> None:
    """Threads for every ggml graph of this process (and torch's, the same OpenMP pool)."""
    global _threads
    if n < 1:
        raise ValueError(f"thread count must be at least 1, got {n}")
    _threads = n
    torch.set_num_threads(n)


def threads() -> int:
    return getattr(_here, "threads", 0) or _threads or torch.get_num_threads()


_here = threading.local()


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """ggml graphs run on one thread in this block, on this thread only (work off the critical path, e.g.
    audits, takes one core rather than the model's whole team)."""
    saved = getattr(_here, "threads", 0)
    _here.threads = 1
    try:
        yield
    finally:
        _here.threads = saved


# Types whose tinyBLAS GEMM can sum each element as vec_dot does (x86: Q8_0 pairs, and Q4_0 / Q5_0 unpacked to
# the same int8 values); each is still checked on this build before it is trusted.
_TINYBLAS_CANDIDATES = frozenset(int(t) for t in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0,
                                                  GGMLQuantizationType.Q5_0))  # fmt: skip
_tinyblas: dict[int, bool] = {}
_tinyblas_lock = threading.Lock()


def _tinyblas_exact(qtype: int) -> bool:
    """Whether a matmul of several rows gives each row the bits it gets alone, for weights of this type on
    this ggml build: always without tinyBLAS; with it, only for a candidate type whose probe agrees."""
    known = _tinyblas.get(qtype)
    if known is not None:
        return known
    with _tinyblas_lock:
        if qtype not in _tinyblas:
            g = ggml_lib()
            if not g.ggml_cpu_has_llamafile():
                _tinyblas[qtype] = True
            else:
                _tinyblas[qtype] = qtype in _TINYBLAS_CANDIDATES and _probe_batched_rows(qtype)
                log.debug("tinyBLAS for %s: %s", GGMLQuantizationType(qtype).name, _tinyblas[qtype])
    return _tinyblas[qtype]


def _probe_batched_rows(qtype: int) -> bool:
    """Random weights of this type times 7 and 2 rows in one matmul (tinyBLAS's tiles and its edge tiles)
    against each row alone (vec_dot): the same bytes?"""
    from gguf import quants

    rng = np.random.default_rng(0)
    rows, cols = 64, 512
    data = quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), GGMLQuantizationType(qtype))
    w = Weight.of_bytes(np.ascontiguousarray(data).view(np.uint8).reshape(-1), qtype, (rows, cols))
    x = torch.from_numpy(rng.standard_normal((7, cols)).astype(np.float32))

    def product(xs: torch.Tensor) -> torch.Tensor:
        n = int(xs.shape[0])
        gr = Graph(4 * n * (rows + cols) + 4096, 4, keep=True)  # own memory: a graph may be mid-build
        try:
            gr.output(gr.g.ggml_mul_mat(gr.ctx, gr.weight(w), gr.input(cols, n)))
            out = torch.empty(n, rows)
            gr.build().run([xs.contiguous()], [out])
            return out
        finally:
            gr.free()

    alone = torch.cat([product(x[i : i + 1]) for i in range(7)])
    return all(torch.equal(product(x[:n]), alone[:n]) for n in (7, 2))


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
    name = GGMLQuantizationType(qtype).name if qtype in GGMLQuantizationType._value2member_map_ else qtype
    log.warning(
        "ggml has no CPU kernel for %s (%s): multiplied as dequantized float32 (the exact path) instead",
        name,
        what,
    )


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
    def of_float(cls, w: torch.Tensor) -> Weight:
        """A float32 matrix [O, I] (CPU, contiguous) for the exact path."""
        if w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous() or w.dim() != 2:
            raise ValueError("Weight.of_float takes a contiguous 2-D float32 CPU tensor")
        return cls(_F32, int(w.shape[0]), int(w.shape[1]), w.data_ptr(), w.numel() * 4, w)


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
            Repacked(*made, np.empty(0, np.uint8))  # freed at once
    return known


def repacked(w: Weight) -> Weight:
    """w (a matrix or a stack of experts) in ggml's repacked layout, where this CPU has one for its type and
    shape (llama.cpp's default for them), else w itself. The file's pages under w are released once copied
    (they come back from the page cache if read again), so the copy replaces them in resident memory.

    A repacked matrix is multiplied one activation row at a time (repacked gemv, Graph.mul_mat) and its
    experts by mul_mat_id, which takes one row at a time too, so a row's bits never depend on its batch."""
    if w.repack is not None or not repackable(w.qtype, w.rows):  # (float types have none: 1-value blocks)
        return w
    ne = (w.cols, w.rows, *([w.experts] if w.experts > 1 else []))
    made = _new_repacked(w.qtype, ne)
    if made is None:
        return w
    ctx, buffer, t = made
    g = ggml_lib()
    g.ggml_backend_tensor_set(t, ctypes.c_void_p(w.ptr), 0, w.nbytes)
    from swarm.node import pages

    source = np.asarray(w.keep)
    pages.release(source, w.ptr, w.nbytes)
    rp = Repacked(ctx, buffer, t, source)
    return Weight(w.qtype, w.rows, w.cols, rp.ptr, w.nbytes, rp, w.experts, rp)


_QTYPES = frozenset(int(t) for t in GGMLQuantizationType)


class _Buffers(threading.local):
    """Per-thread scratch for one-off graphs, reused across them: the ggml context pool (tensor headers), the
    allocator of their intermediates and the work buffer."""

    def __init__(self) -> None:
        self.ctx_mem = np.empty(0, dtype=np.uint8)
        self.work = np.empty(0, dtype=np.uint8)
        self.galloc: _GraphAllocator | None = None  # (freed with this thread's buffers)

    def get_galloc(self) -> int:
        if self.galloc is None:
            self.galloc = _GraphAllocator()
        return self.galloc.ptr

    def get_ctx(self, n: int) -> np.ndarray:
        if self.ctx_mem.nbytes < n:
            self.ctx_mem = np.empty(max(n, 2 * self.ctx_mem.nbytes), dtype=np.uint8)
        return self.ctx_mem

    def get_work(self, n: int) -> np.ndarray:
        if self.work.nbytes < n:
            self.work = np.empty(max(n, 2 * self.work.nbytes), dtype=np.uint8)
        return self.work


class _GraphAllocator:
    """ggml's graph allocator (ggml-alloc, as llama.cpp lays out its graphs) and its CPU buffer: it lays a
    graph's intermediates out so that one whose last reader has run lends its memory to the next, and keeps
    its buffer (grown to the largest graph so far) for the graphs after it. A 512-token prompt's graphs of the
    Qwen3.6-35B layer shape take 56 MiB of it, where every intermediate of its own took a 302 MiB scratch pool
    (604 MiB once it grew again)."""

    def __init__(self) -> None:
        self.g = ggml_lib()
        # ggml-python declares ggml_backend_cpu_buffer_type's result a C int (a pointer cut to 32 bits): called
        # here with the right prototype
        cpu_buft = ctypes.CFUNCTYPE(ctypes.c_void_p)(
            ctypes.cast(self.g.ggml_backend_cpu_buffer_type, ctypes.c_void_p).value
        )()
        self.ptr = self.g.ggml_gallocr_new(cpu_buft)
        if not self.ptr:
            raise MemoryError("ggml_gallocr_new failed")

    def __del__(self) -> None:
        g = getattr(self, "g", None)
        if getattr(self, "ptr", None) and getattr(g, "ggml_gallocr_free", None) is not None:
            g.ggml_gallocr_free(self.ptr)
            self.ptr = None


_buffers = _Buffers()
_placeholder = np.zeros(64, dtype=np.uint8)  # where a slot points until its run gives it memory
_PLACEHOLDER = _placeholder.ctypes.data


class Graph:
    """One ggml graph over torch inputs and outputs: built once, run once or (kept in a GraphCache) again.

    Inputs and outputs are slots: torch float32 CPU tensors whose data pointers are set on each run, so
    ggml reads and writes them in place. Weights are used where they lie. Intermediates live in the
    graph's own memory (a kept graph: `scratch_bytes` of it) or in the per-thread buffer of ggml's graph
    allocator (a one-off graph: a prompt's, whose intermediates are laid out to share memory).
    """

    def __init__(self, scratch_bytes: int, n_tensors: int, keep: bool = False) -> None:
        g = self.g = ggml_lib()
        self.n_nodes = max(16, 2 * n_tensors)
        size = (
            (scratch_bytes if keep else 0)
            + (n_tensors + 8) * g.ggml_tensor_overhead()
            + g.ggml_graph_overhead_custom(self.n_nodes, False)
            + 4096
        )
        self.kept = keep
        self.mem = np.empty(size, dtype=np.uint8) if keep else _buffers.get_ctx(size)
        params = g.ggml_init_params(
            mem_size=self.mem.nbytes, mem_buffer=self.mem.ctypes.data, no_alloc=not keep
        )
        self.ctx = g.ggml_init(params)
        if not self.ctx:
            raise MemoryError("ggml_init failed")
        self._weights: list[object] = []  # what owns the weights' memory, for as long as the graph lives
        # (tensor, its struct, values): the struct read once, since every `.contents` makes a new ctypes object
        self.inputs: list[tuple[object, object, int]] = []
        self.outputs: list[tuple[object, object, int]] = []
        self.views: list[tuple[object, object, int]] = []  # (view, its slot, offset): found by build()
        self.weight_slots: list[tuple[object, int, bool]] = []  # (tensor struct, bytes, repacked)
        self.graph: object = None
        self.plan: object = None
        self.plan_threads = 0
        self.work = np.empty(0, dtype=np.uint8)

    def free(self) -> None:
        if self.ctx:
            ctx, self.ctx = self.ctx, None
            self.g.ggml_free(ctx)

    def __del__(self) -> None:
        if getattr(self.g, "ggml_free", None) is not None:  # at interpreter exit ggml may be gone first
            self.free()

    def placed(self, qtype: int, *ne: int) -> object:
        """A tensor of ggml shape `ne` (fastest dimension first) whose data the caller points somewhere."""
        g = self.g
        g.ggml_set_no_alloc(self.ctx, True)
        t = g.ggml_new_tensor(self.ctx, qtype, len(ne), (ctypes.c_int64 * len(ne))(*ne))
        g.ggml_set_no_alloc(self.ctx, not self.kept)
        return t

    def weight(self, w: Weight) -> object:
        t = self._matrix(w)
        t.contents.data = w.ptr
        self._weights.append(w.keep)
        return t

    def weight_slot(self, w: Weight) -> object:
        """A weight of w's type and shape whose matrix is given on each run (`run(weights=...)`), so one
        graph serves every matrix of that shape: a node's call for other experts of the same layer shape."""
        t = self._matrix(w)
        self.weight_slots.append((t.contents, w.nbytes, w.repack is not None))
        self._weights.append(
            w.keep
        )  # a repacked slot points at this weight's buffer (its type is all ggml reads)
        return t

    def _matrix(self, w: Weight) -> object:
        t = self.placed(w.qtype, w.cols, w.rows, *([w.experts] if w.experts > 1 else []))
        if w.repack is not None:  # ggml runs the repacked kernels for a weight in a CPU_REPACK buffer
            t.contents.buffer = ctypes.cast(w.repack.buffer, ctypes.c_void_p)
            t.contents.extra = w.repack.extra
        return t

    def input(self, *ne: int, qtype: int = _F32) -> object:
        """An input slot of ggml shape `ne` (fastest first: [cols, rows] for a matrix), float32 by default."""
        t = self.placed(qtype, *ne)
        self.inputs.append((t, t.contents, int(np.prod(ne))))
        return t

    def constant(self, x: torch.Tensor) -> object:
        """A float32 tensor that stays the same on every run (a bias), held by the graph."""
        x = _f32_rows(x.reshape(1, -1) if x.dim() == 1 else x)
        t = self.placed(_F32, int(x.shape[1]), int(x.shape[0]))
        t.contents.data = x.data_ptr()
        self._weights.append(x)
        return t

    def mul_mat(self, w: object, x: object) -> object:
        """w [I, O] (ggml order) times the rows of x [I, N] -> [O, N], each element by one kernel whatever N:
        a repacked weight (whose GEMM for 4 rows sums in another order than its GEMV for one) or a weight type
        whose tinyBLAS sums differ from vec_dot's gets its rows as N batches of one row [I, 1, N] (tinyBLAS
        only takes matmuls of 2 or more rows per batch, the repacked GEMM 4 rows of one batch)."""
        g = self.g
        n = int(x.contents.ne[1])
        one_by_one = bool(w.contents.buffer) or not _tinyblas_exact(int(w.contents.type))  # repacked: gemv
        if n > 1 and int(x.contents.ne[2]) == 1 and one_by_one:
            rows = g.ggml_reshape_3d(self.ctx, x, int(x.contents.ne[0]), 1, n)
            y = g.ggml_mul_mat(self.ctx, w, rows)  # [O, 1, N]
            return g.ggml_reshape_2d(self.ctx, y, int(y.contents.ne[0]), n)
        return g.ggml_mul_mat(self.ctx, w, x)  # [O, N]

    def swiglu(self, gate: object, up: object | None = None) -> object:
        """silu(gate) * up; with one tensor [N, 2F], its first F columns are the gate."""
        if up is None:
            return self.g.ggml_swiglu(self.ctx, gate)
        return self.g.ggml_swiglu_split(self.ctx, gate, up)

    def add_row(self, x: object, bias: torch.Tensor) -> object:
        """x [N, O] + bias [O] (broadcast over rows)."""
        return self.g.ggml_add(self.ctx, x, self.constant(bias))

    def output(self, t: object) -> None:
        """An output slot: t is computed into the tensor given for it on each run (a reshaped product: the
        product itself is, since a reshape computes nothing)."""
        n = int(self.g.ggml_nelements(t))
        while t.contents.op == self.g.GGML_OP_RESHAPE:
            t = t.contents.view_src
        self.outputs.append((t, t.contents, n))

    def build(self) -> Graph:
        g = self.g
        self.graph = g.ggml_new_graph_custom(self.ctx, self.n_nodes, False)
        for t, _, _ in self.outputs:
            g.ggml_build_forward_expand(self.graph, t)
        self._find_slot_views()
        if not self.kept:
            self._allocate()
        return self

    def _allocate(self) -> None:
        """Place the intermediates of a one-off graph with ggml's graph allocator. The slots (inputs, outputs,
        weight slots) get their memory on each run: they point at a placeholder meanwhile, so that the
        allocator leaves them (and their views) alone."""
        g = self.g
        slots = [c for _, c, _ in self.inputs + self.outputs] + [c for c, _, _ in self.weight_slots]
        for t in slots:
            if not t.data:
                t.data = _PLACEHOLDER
        for v, src, offs in self.views:
            v.data = src.data + offs
        galloc = _buffers.get_galloc()
        # laid out for this graph: ggml_gallocr_alloc_graph alone reuses the last graph's layout when the new
        # one fits it by node counts and sizes, and a graph of another wiring then has an intermediate
        # overwritten before its last reader runs (test_kernels: ..._each_get_their_own_layout)
        if not g.ggml_gallocr_reserve(galloc, self.graph) or not g.ggml_gallocr_alloc_graph(
            galloc, self.graph
        ):
            raise MemoryError("ggml could not allocate a graph's intermediates")

    def _find_slot_views(self) -> None:
        """Every view (reshape, transpose, slice) of an input or output slot, whose data pointer must follow
        the slot's on each run: ggml gives each view its root tensor and offset."""
        slots = {ctypes.addressof(c) for _, c, _ in self.inputs + self.outputs}
        seen: set[int] = set()
        stack = [self.g.ggml_graph_node(self.graph, i) for i in range(self.g.ggml_graph_n_nodes(self.graph))]
        while stack:
            t = stack.pop().contents
            if ctypes.addressof(t) in seen:
                continue
            seen.add(ctypes.addressof(t))
            if t.view_src and ctypes.addressof(t.view_src.contents) in slots:
                self.views.append((t, t.view_src.contents, int(t.view_offs)))
            stack.extend(src for src in t.src if src)

    def run(
        self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], weights: Sequence[Weight] = ()
    ) -> None:
        """Compute with these inputs and outputs (float32, contiguous, CPU; one per slot, in order) and these
        matrices in the weight slots (each of its slot's type and shape; the caller keeps them alive)."""
        assert len(inputs) == len(self.inputs) and len(outputs) == len(self.outputs)
        assert len(weights) == len(self.weight_slots)
        for (t, nbytes, packed), w in zip(self.weight_slots, weights, strict=True):
            if w.nbytes != nbytes or w.qtype != t.type or (w.repack is not None) != packed:
                raise ValueError(
                    f"a matrix of {w.nbytes} bytes of type {w.qtype} for a slot of {nbytes} / {t.type}"
                )
            t.data = w.ptr
        for (_, t, n), x in zip(self.inputs, inputs, strict=True):
            if x.numel() != n or x.element_size() != 4 or not x.is_contiguous():  # float32 (or int32 ids)
                raise ValueError(f"input of {x.numel()} {x.dtype} values for a slot of {n} float32")
            t.data = x.data_ptr()
        for (_, t, n), y in zip(self.outputs, outputs, strict=True):
            if y.numel() != n or y.dtype != torch.float32 or not y.is_contiguous():
                raise ValueError(f"output of {y.numel()} {y.dtype} values for a slot of {n} float32")
            # ggml allocated the result in the graph's memory; point it at `y` instead (it is computed last)
            t.data = y.data_ptr()
        for v, src, offs in self.views:
            v.data = src.data + offs
        g = self.g
        with _compute_lock:
            n_threads = threads()
            if self.plan is None or self.plan_threads != n_threads:
                self.plan = g.ggml_graph_plan(self.graph, n_threads, None)
                self.plan_threads = n_threads
                if self.plan.work_size:
                    self.work = (
                        np.empty(self.plan.work_size, dtype=np.uint8)
                        if self.kept
                        else _buffers.get_work(self.plan.work_size)
                    )
                    self.plan.work_data = self.work.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
            status = g.ggml_graph_compute(self.graph, ctypes.byref(self.plan))
        if status != 0:
            raise RuntimeError(f"ggml graph compute failed (status {status})")


class GraphCache:
    """Graphs kept for calls that repeat with the same weights and shapes (a decode step's dense matmuls):
    a kept graph runs without being built again. Least recently used first out.

    A graph holds its inputs and outputs, so one graph serves one call at a time: `take` checks it out (a
    concurrent call of the same key builds its own), `put` checks it back in. A node serves several calls at
    once, and two of them sharing a graph would compute into each other's rows."""

    def __init__(self, size: int = 512) -> None:
        self.size = size
        self._graphs: OrderedDict[tuple, Graph] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, key: tuple) -> Graph | None:
        with self._lock:
            return self._graphs.pop(key, None)

    def put(self, key: tuple, gr: Graph) -> None:
        with self._lock:
            old = self._graphs.pop(key, None)
            self._graphs[key] = gr
            evicted = [old] if old is not None else []
            while len(self._graphs) > self.size:
                evicted.append(self._graphs.popitem(last=False)[1])
        for g in evicted:
            g.free()


# Rows up to which a dense call's graph is kept: decode steps (one token per sequence) repeat exactly.
KEEP_ROWS = 16
_cache = GraphCache()


def _f32_rows(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32 and x.is_contiguous() and x.device.type == "cpu":
        return x  # the common case, without torch's dispatch of a no-op conversion
    return x.to(device="cpu", dtype=torch.float32).contiguous()


def _run(
    key: tuple | None,
    build: Callable[[bool], Graph],
    inputs: list,
    outputs: list,
    weights: Sequence[Weight] = (),
) -> None:
    """Run the kept graph for `key`, or build one (and keep it when `key` is given)."""
    gr = _cache.take(key) if key is not None else None
    if gr is None:
        gr = build(key is not None).build()
    try:
        gr.run(inputs, outputs, weights)
    except BaseException:
        gr.free()
        raise
    if key is None:
        gr.free()
    else:
        _cache.put(key, gr)


# What happens to a product before it leaves the graph: steps in order, each the name of a unary op
# ("sigmoid", "silu", "softplus", "exp") or ("add" | "mul", a float32 vector [O] broadcast over the rows).
Post = tuple[str | tuple[str, torch.Tensor], ...]


def _post_key(post: Post | None) -> tuple:
    if not post:
        return ()
    return tuple(s if isinstance(s, str) else (s[0], s[1].data_ptr()) for s in post)


def apply_post(y: torch.Tensor, post: Post | None) -> torch.Tensor:
    """The same steps in torch and ggml's unary ops, for a product computed elsewhere (a GPU)."""
    for step in post or ():
        if isinstance(step, str):
            y = unary(step, y)
        else:
            y = y + step[1] if step[0] == "add" else y * step[1]
    return y


@dataclass(frozen=True)
class Norm:
    """An RMSNorm applied inside a graph: each group of len(weight) values (a row, or each head of a row) is
    divided by its root mean square (ggml_rms_norm, llama.cpp's: the sum of squares in double), then
    multiplied by `weight`."""

    weight: torch.Tensor  # [G] float32
    eps: float


def linear(
    weights: Sequence[Weight],
    x: torch.Tensor,
    post: Sequence[Post | None] | None = None,
    *,
    norm: Norm | None = None,
    gate: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    normed: bool = False,
) -> list[torch.Tensor]:
    """x [N, I] times each of several matrices [O_j, I] of the same input: one graph, outputs [N, O_j].

    In the same graph, in this order: `norm` (x normed first), `gate` [N, I] (the normed x times it,
    elementwise), the products, `post[j]` on product j (an activation, a bias), `residual` [N, O_0] added to
    the first output. `normed`: the input as multiplied ([N, I], after norm and gate) comes first in the list.
    A decode step's dense path is a few of these: each graph has a fixed cost, each torch op around it too."""
    x = _f32_rows(x)
    n, cols = int(x.shape[0]), int(x.shape[1])
    posts = list(post) if post is not None else [None] * len(weights)
    extra = [t for t in (gate, residual) if t is not None]
    inputs = [x, *(_f32_rows(t) for t in extra)]
    outs = ([torch.empty(n, cols)] if normed else []) + [torch.empty(n, w.rows) for w in weights]
    if norm is not None and cols % norm.weight.numel():
        raise ValueError(f"a norm of {norm.weight.numel()} values does not divide rows of {cols}")

    def build(keep: bool) -> Graph:
        gr = Graph(_dense_scratch(n, cols, weights, posts), _dense_tensors(weights, posts), keep)
        xt = gr.input(cols, n)
        gt = gr.input(cols, n) if gate is not None else None
        rt = gr.input(weights[0].rows, n) if residual is not None else None
        xin, ys = _dense_ops(gr, xt, weights, posts, norm, gt, rt)
        if normed:  # the input itself is a slot, not a result: copy it out
            gr.output(xin if norm is not None or gate is not None else gr.g.ggml_cont(gr.ctx, xin))
        for y in ys:
            gr.output(y)
        return gr

    key = None
    if n <= KEEP_ROWS:
        shape = (norm.weight.data_ptr(), norm.eps) if norm is not None else None
        key = ("linear", n, shape, gate is not None, residual is not None, normed,
               *((w.ptr, _post_key(p)) for w, p in zip(weights, posts, strict=True)))  # fmt: skip
    _run(key, build, inputs, outs)
    return outs


def _dense_scratch(n: int, cols: int, weights: Sequence[Weight], posts: Sequence[Post | None]) -> int:
    """Graph memory for _dense_ops over n rows: each product before it is pointed at its output, its
    steps, the quantized activations."""
    products = sum(4 * n * w.rows * (2 + len(p or ())) + 64 for w, p in zip(weights, posts, strict=True))
    return products + 4 * 4 * n * cols + 256


def _dense_tensors(weights: Sequence[Weight], posts: Sequence[Post | None]) -> int:
    return 2 * len(weights) + 2 * sum(len(p or ()) for p in posts) + 12


def _dense_ops(
    gr: Graph,
    xt: object,
    weights: Sequence[Weight],
    posts: Sequence[Post | None],
    norm: Norm | None,
    gt: object | None = None,
    rt: object | None = None,
) -> tuple[object, list[object]]:
    """linear()'s ops on graph tensor xt [I, N]: (the input as multiplied, [each product after its steps])."""
    g, ctx = gr.g, gr.ctx
    cols, n = int(xt.contents.ne[0]), int(xt.contents.ne[1])
    if norm is not None:
        width = int(norm.weight.numel())
        grouped = g.ggml_reshape_3d(ctx, xt, width, cols // width, n)
        xn = g.ggml_mul(ctx, g.ggml_rms_norm(ctx, grouped, norm.eps), gr.constant(norm.weight))
        xt = g.ggml_reshape_2d(ctx, xn, cols, n)
    if gt is not None:
        xt = g.ggml_mul(ctx, xt, gt)
    ys = []
    for j, (w, p) in enumerate(zip(weights, posts, strict=True)):
        t = gr.mul_mat(gr.weight(w), xt)
        for step in p or ():
            if isinstance(step, str):
                if step not in _UNARY:
                    raise ValueError(f"unary op {step!r} is not one of {_UNARY}")
                t = getattr(g, f"ggml_{step}")(ctx, t)
            elif step[0] in ("add", "mul"):
                t = getattr(g, f"ggml_{step[0]}")(ctx, t, gr.constant(step[1]))
            else:
                raise ValueError(f"unknown step {step[0]!r}")
        if j == 0 and rt is not None:
            t = g.ggml_add(ctx, t, rt)
        ys.append(t)
    return xt, ys


@dataclass(frozen=True)
class Heads:
    """A full-attention layer's steps between its projections and the attention itself: q and k get an
    optional per-head RMSNorm and NeoX RoPE on their first n_rot dims (ggml_rope_ext, llama.cpp's: the angles
    in float32, position by position). `gated` (qwen35moe, qwen3next): attn_q's rows per head are
    [q_h, gate_h], and the gate leaves through a sigmoid."""

    n_head: int  # H
    n_head_kv: int  # Hkv
    head_dim: int  # hd
    n_rot: int
    rope_base: float
    q_norm: Norm | None
    k_norm: Norm | None
    gated: bool


def attention_heads(
    x: torch.Tensor,
    norm: Norm,
    weights: Sequence[Weight],
    posts: Sequence[Post | None],
    heads: Heads,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [N, D] at positions [N] through the q, k, v `weights` (each product then its `posts`: a bias) ->
    q [N, H, hd], k [N, Hkv, hd] (normed, rotated), v [N, Hkv*hd] and, gated, sigmoid(gate) [N, H*hd] (else
    None): the norm, the products, the q/k norms, RoPE and the gate's sigmoid in one graph (a decode step's
    torch ops around the products cost more than they do). Each row is computed alone: its bits do not
    depend on the other rows."""
    x = _f32_rows(x)
    n, cols = int(x.shape[0]), int(x.shape[1])
    h, hkv, hd = heads.n_head, heads.n_head_kv, heads.head_dim
    pos = positions.to(device="cpu", dtype=torch.int32).contiguous()
    outs = [torch.empty(n, h, hd), torch.empty(n, hkv, hd), torch.empty(n, hkv * hd)]
    if heads.gated:
        outs.append(torch.empty(n, h * hd))

    def build(keep: bool) -> Graph:
        gr = Graph(_dense_scratch(n, cols, weights, posts) + 4 * 4 * n * (3 * h + 2 * hkv) * hd,
                   _dense_tensors(weights, posts) + 24, keep)  # fmt: skip
        g, ctx = gr.g, gr.ctx
        xt = gr.input(cols, n)
        pt = gr.input(n, qtype=g.GGML_TYPE_I32)
        _, (qx, kx, vx) = _dense_ops(gr, xt, weights, posts, norm)
        f32 = 4
        if heads.gated:  # per head [q_h, gate_h]: q and the gate are strided views [hd, H, N]
            q = g.ggml_view_3d(ctx, qx, hd, h, n, 2 * hd * f32, 2 * h * hd * f32, 0)
            gate = g.ggml_view_3d(ctx, qx, hd, h, n, 2 * hd * f32, 2 * h * hd * f32, hd * f32)
        else:
            q, gate = g.ggml_reshape_3d(ctx, qx, hd, h, n), None

        def normed_rotated(t: object, nm: Norm | None) -> object:
            if nm is not None:
                t = g.ggml_mul(ctx, g.ggml_rms_norm(ctx, t, nm.eps), gr.constant(nm.weight))
            return g.ggml_rope_ext(ctx, t, pt, None, heads.n_rot, g.GGML_ROPE_TYPE_NEOX, 0,
                                   heads.rope_base, 1.0, 0.0, 1.0, 32.0, 1.0)  # fmt: skip

        gr.output(normed_rotated(q, heads.q_norm))
        gr.output(normed_rotated(g.ggml_reshape_3d(ctx, kx, hd, hkv, n), heads.k_norm))
        gr.output(vx)
        if gate is not None:
            gr.output(g.ggml_sigmoid(ctx, g.ggml_cont(ctx, gate)))
        return gr

    key = None
    if n <= KEEP_ROWS:
        key = ("attention_heads", n, norm.weight.data_ptr(),
               *((w.ptr, _post_key(p)) for w, p in zip(weights, posts, strict=True)),
               *(nm.weight.data_ptr() if nm is not None else None for nm in (heads.q_norm, heads.k_norm)))  # fmt: skip
    _run(key, build, [x, pos], outs)
    return outs[0], outs[1], outs[2], outs[3] if heads.gated else None


@dataclass(frozen=True)
class FFN:
    """One SwiGLU feed-forward net: down(silu(gate x) * up x), gate and up stored apart or fused [2F, I]."""

    down: Weight  # [I, F]
    gate: Weight | None = None  # [F, I]
    up: Weight | None = None  # [F, I]
    gate_up: Weight | None = None  # [2F, I], gate rows first
    gate_bias: torch.Tensor | None = None  # [F] (or [2F] with gate_up)
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None

    @property
    def width(self) -> int:
        return self.down.cols  # F

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in (self.down, self.gate, self.up, self.gate_up) if w is not None)

    @property
    def matrices(self) -> tuple[Weight, ...]:
        """Its matrices in the order add_to gives them slots."""
        if self.gate_up is not None:
            return (self.gate_up, self.down)
        assert self.gate is not None and self.up is not None
        return (self.gate, self.up, self.down)

    @property
    def shape(self) -> tuple:
        """What a graph of this FFN depends on: its matrices' types and shapes (the matrices themselves are
        given on each run), and its biases (constants of the graph)."""
        bs = (self.gate_bias, self.up_bias, self.down_bias)
        return (
            *((w.qtype, w.rows, w.cols, w.repack is not None) for w in self.matrices),
            *(b.data_ptr() if b is not None else 0 for b in bs),
        )

    def add_to(self, gr: Graph, xt: object) -> object:
        """This FFN over the rows of graph tensor xt: its output tensor; its matrices are weight slots, in the
        order of `matrices`."""
        if self.gate_up is not None:
            h = gr.mul_mat(gr.weight_slot(self.gate_up), xt)  # [n, 2F]
            if self.gate_bias is not None:
                h = gr.add_row(h, self.gate_bias)
            h = gr.swiglu(h)
        else:
            assert self.gate is not None and self.up is not None
            gate = gr.mul_mat(gr.weight_slot(self.gate), xt)  # [n, F]
            up = gr.mul_mat(gr.weight_slot(self.up), xt)
            if self.gate_bias is not None:
                gate = gr.add_row(gate, self.gate_bias)
            if self.up_bias is not None:
                up = gr.add_row(up, self.up_bias)
            h = gr.swiglu(gate, up)  # [n, F]
        y = gr.mul_mat(gr.weight_slot(self.down), h)  # [n, D]
        if self.down_bias is not None:
            y = gr.add_row(y, self.down_bias)
        return y


def ffn_rows(blocks: Sequence[tuple[FFN, int, int]], x: torch.Tensor, out: torch.Tensor) -> None:
    """For each (ffn, start, n): out[start:start+n] = ffn(x[start:start+n]); one graph for all of them.

    x, out [N, D] float32 contiguous CPU. This is a node's whole Compute call (every expert it was sent
    for one layer) and the coordinator's shared expert. A graph takes its matrices on each run, so a small
    call's graph is kept for the next call of the same shapes, whichever experts it multiplies.
    """
    blocks = [(f, a, n) for f, a, n in blocks if n]
    if not blocks:
        return
    d = int(x.shape[1])

    def build(kept: bool) -> Graph:
        scratch = sum(4 * n * (3 * f.width) + 4 * n * d + 256 for f, _, n in blocks)
        gr = Graph(scratch, 16 * len(blocks) + 2, kept)  # 3 products, their views, swiglu, in, out
        for f, _, n in blocks:
            gr.output(f.add_to(gr, gr.input(d, n)))
        return gr

    key = None
    if sum(n for _, _, n in blocks) <= KEEP_ROWS:
        key = ("ffn", *((f.shape, n) for f, _, n in blocks))
    weights = [w for f, _, _ in blocks for w in f.matrices]
    _run(key, build, [x[a : a + n] for _, a, n in blocks], [out[a : a + n] for _, a, n in blocks], weights)


def ffn(f: FFN, x: torch.Tensor) -> torch.Tensor:
    """One FFN over rows x [N, D] -> [N, D] float32."""
    x = _f32_rows(x)
    out = torch.empty_like(x)
    ffn_rows([(f, 0, int(x.shape[0]))], x, out)
    return out


@dataclass(frozen=True)
class ExpertStack:
    """One layer's experts where the GGUF stacks them: every expert's gate, up (or fused gate_up) and down
    back to back (Weight.experts > 1), multiplied with ggml_mul_mat_id as llama.cpp does."""

    down: Weight
    gate: Weight | None = None
    up: Weight | None = None
    gate_up: Weight | None = None


def _moe_scratch(n: int, slots: int, d: int, f: int) -> int:
    return 4 * n * slots * (4 * f + d) + 4096


def _moe_ops(gr: Graph, stack: ExpertStack, xt: object, it: object) -> object:
    """Expert ids it [S, N] (int32) of rows xt [D, 1, N] -> their FFNs' outputs [D, S, N]."""
    g, ctx = gr.g, gr.ctx
    if stack.gate_up is not None:
        h = g.ggml_swiglu(ctx, g.ggml_mul_mat_id(ctx, gr.weight(stack.gate_up), xt, it))
    else:
        assert stack.gate is not None and stack.up is not None
        gate = g.ggml_mul_mat_id(ctx, gr.weight(stack.gate), xt, it)  # [F, S, N]
        up = g.ggml_mul_mat_id(ctx, gr.weight(stack.up), xt, it)
        h = g.ggml_swiglu_split(ctx, gate, up)
    return g.ggml_mul_mat_id(ctx, gr.weight(stack.down), h, it)  # [D, S, N]


def _combine_scratch(t: int, k: int, d: int) -> int:
    """_combine_ops' tensors: the weighted outputs [D, K, T] and each sum [D, T] along the way."""
    return 4 * t * d * (2 * k + 4) + 4096


def _combine_ops(gr: Graph, out: object, wt: object, shared: object | None, ht: object) -> object:
    """h + (sum over slots of w_k * out_k, in slot order) (+ shared): out [D, K, T], wt [1, K, T], shared
    and ht [D, T] -> [D, T]. The slots are added one after the other, as llama.cpp's build_moe_ffn does."""
    g, ctx = gr.g, gr.ctx
    d, k, t = (int(out.contents.ne[i]) for i in range(3))
    weighted = g.ggml_mul(ctx, out, wt)  # [D, K, T]
    nb1, nb2 = int(weighted.contents.nb[1]), int(weighted.contents.nb[2])
    acc = g.ggml_view_2d(ctx, weighted, d, t, nb2, 0)
    for slot in range(1, k):
        acc = g.ggml_add(ctx, acc, g.ggml_view_2d(ctx, weighted, d, t, nb2, slot * nb1))
    if k == 1:
        acc = g.ggml_cont(ctx, acc)
    if shared is not None:
        acc = g.ggml_add(ctx, acc, shared)
    return g.ggml_add(ctx, ht, acc)


def moe_combine(
    h: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None
) -> torch.Tensor:
    """A MoE layer's output from its parts: h [T, D] + sum_k weights[:, k] * out[:, k] + shared [T, D], for
    the experts' outputs out [T, K, D] however they were computed (a node's, in process); moe_layer computes
    the same ops in its graph."""
    t, k, d = (int(v) for v in out.shape)
    ins = [_f32_rows(h), _f32_rows(out), _f32_rows(weights)] + (
        [_f32_rows(shared)] if shared is not None else []
    )
    y = torch.empty(t, d)

    def build(keep: bool) -> Graph:
        gr = Graph(_combine_scratch(t, k, d), 2 * k + 12, keep)
        ht, ot, wt = gr.input(d, t), gr.input(d, k, t), gr.input(1, k, t)
        st = gr.input(d, t) if shared is not None else None
        gr.output(_combine_ops(gr, ot, wt, st, ht))
        return gr

    key = ("combine", t, k, d, shared is not None) if t <= KEEP_ROWS else None
    _run(key, build, ins, [y])
    return y


def moe_layer(
    h: torch.Tensor,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    stack: ExpertStack,
    shared: FFN | None,
    shared_gate: torch.Tensor | None,
) -> torch.Tensor:
    """A whole MoE layer in process, in one graph: h [T, D] + sum_k weights[:, k] * expert_k(x) +
    shared_gate * shared(x), for the normed rows x [T, D], the routed experts ids [T, K] of `stack` and
    their weights [T, K], shared_gate [T, 1]. The ops of moe_rows, ffn and moe_combine on the same values:
    the same bits as computing the experts apart (here or on nodes) and combining them with moe_combine."""
    t, d = int(x.shape[0]), int(x.shape[1])
    k = int(ids.shape[1])
    f = stack.down.cols
    ins = [_f32_rows(x), ids.to(torch.int32).contiguous(), _f32_rows(weights), _f32_rows(h)]
    if shared_gate is not None:
        ins.append(_f32_rows(shared_gate))
    y = torch.empty(t, d)

    def build(keep: bool) -> Graph:
        g = ggml_lib()
        scratch = _moe_scratch(t, k, d, f) + _combine_scratch(t, k, d)
        if shared is not None:
            scratch += 4 * t * (3 * shared.width) + 4 * t * d + 256
        gr = Graph(scratch, 2 * k + 40, keep)
        xt = gr.input(d, t)
        it = gr.input(k, t, qtype=g.GGML_TYPE_I32)
        wt = gr.input(1, k, t)
        ht = gr.input(d, t)
        gt = gr.input(1, t) if shared_gate is not None else None
        out = _moe_ops(gr, stack, g.ggml_reshape_3d(gr.ctx, xt, d, 1, t), it)
        st = None
        if shared is not None:
            st = shared.add_to(gr, xt)
            if gt is not None:
                st = g.ggml_mul(gr.ctx, st, gt)
        gr.output(_combine_ops(gr, out, wt, st, ht))
        return gr

    key = None
    if t <= KEEP_ROWS:
        ws = (stack.down, stack.gate, stack.up, stack.gate_up)
        key = ("moe-layer", t, k, *(w.ptr if w is not None else 0 for w in ws),
               shared.shape if shared is not None else None, shared_gate is not None)  # fmt: skip
    _run(key, build, ins, [y], shared.matrices if shared is not None else ())
    return y


def moe_rows(stack: ExpertStack, ids: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> None:
    """out[i, s] = expert ids[i, s]'s FFN of x[i] for rows x [N, D], ids [N, S] -> out [N, S, D]: one
    mul_mat_id per matrix for every expert at once (fewer, larger ops than one graph node per expert: the
    threads share all the experts' rows). A node's call is S = 1 (rows packed expert-major); in process a
    step's tokens go as they are, S = K slots each. Each (row, slot) is computed by the same per-row kernel
    as ffn_rows, so the bits are the same either way."""
    n, d = int(x.shape[0]), int(x.shape[1])
    if n == 0:
        return
    slots = int(ids.shape[1])
    ids = ids.to(torch.int32).contiguous()
    f = stack.down.cols

    def build(keep: bool) -> Graph:
        gr = Graph(_moe_scratch(n, slots, d, f), 12, keep)
        xt = gr.input(d, 1, n)  # [D, 1, N]: every slot of a row reads the row
        it = gr.input(slots, n, qtype=gr.g.GGML_TYPE_I32)
        gr.output(_moe_ops(gr, stack, xt, it))
        return gr

    # the graph depends on the stack and the shape only (the experts are an input): a decode step's call
    # repeats it layer after layer
    ws = (stack.down, stack.gate, stack.up, stack.gate_up)
    key = ("moe", n, slots, *(w.ptr if w is not None else 0 for w in ws)) if n <= KEEP_ROWS else None
    _run(key, build, [x, ids], [out])


def stored_weight(
    data: np.ndarray, qtype: int, shape: Sequence[int], numerics: Numerics, what: str = "a weight"
) -> Weight:
    """The Weight a matrix is multiplied as: its stored bytes (native, or any float32 tensor), else a float32
    copy dequantized bit-identically to gguf-py (exact, or a type ggml has no kernel for)."""
    qtype = int(qtype)
    if qtype == _F32:
        return Weight.of_bytes(data, qtype, shape)
    if numerics == NATIVE and has_kernel(qtype):
        return repacked(Weight.of_bytes(data, qtype, shape))
    if numerics == NATIVE:
        warn_no_kernel(qtype, what)
    from swarm.node.dequant import dequantize

    cols = int(shape[-1])
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return Weight.of_float(dequantize(data, GGMLQuantizationType(qtype), (rows, cols)).contiguous())


_UNARY = ("sigmoid", "silu", "softplus", "exp", "soft_max")  # soft_max: over each row (the last dim)


def unary(op: str, x: torch.Tensor) -> torch.Tensor:
    """sigmoid / silu / softplus / exp of x, or soft_max over its last dim (any shape, float32 result), by
    ggml, one row of the last dim at a time.

    torch's vectorized kernels compute the last few elements of a tensor (and of each thread's share) with
    scalar code that rounds differently, so the same row can come out differently in a batch of another
    size. ggml's row loop puts every element at the same place in its row whatever the batch: one row's
    result never depends on the others. (Elementwise ops that round once, like + and *, and per-row
    reductions, are position-free in torch too.)
    """
    if op not in _UNARY:
        raise ValueError(f"unary op {op!r} is not one of {_UNARY}")
    if x.dtype == torch.float64:  # the float64 forms of the math (tests' definitions) stay in torch
        if op == "soft_max":
            return torch.softmax(x, dim=-1)
        return {"sigmoid": torch.sigmoid, "silu": F.silu, "softplus": F.softplus, "exp": torch.exp}[op](x)
    shape = x.shape
    x2 = _f32_rows(x.reshape(-1, shape[-1]) if x.dim() else x.reshape(1, 1))
    rows, cols = int(x2.shape[0]), int(x2.shape[1])
    out = torch.empty_like(x2)

    def build(keep: bool) -> Graph:
        gr = Graph(4 * x2.numel() + 64, 3, keep)
        gr.output(getattr(gr.g, f"ggml_{op}")(gr.ctx, gr.input(cols, rows)))
        return gr

    _run(("unary", op, rows, cols) if rows <= KEEP_ROWS else None, build, [x2], [out])
    return out.view(shape)


@dataclass(frozen=True)
class DeltaRule:
    """What a Gated DeltaNet layer's conv and delta rule are, for a graph: conv_weight [C, Kc]; Hk key
    heads serving the value heads tiled (value head h reads key head h % Hk) or, `grouped`, in blocks
    (h // (Hv / Hk)); the L2 norm's eps."""

    conv_weight: torch.Tensor
    n_k_heads: int
    grouped: bool
    eps: float


def _delta_rule_ops(
    gr: Graph,
    tm: object,
    tg: object,
    tb: object,
    spans: Sequence[tuple[int, int]],
    tconv: Sequence[object],
    tstate: Sequence[object],
    rule: DeltaRule,
    cw: object,
    marks: Sequence[int] = (),
) -> tuple[list[object], list[object], list[tuple[object, object, object] | None]]:
    """The conv, SiLU, L2-normed q and k and the gated delta rule of each sequence (start, T) of the rows:
    tm [C, N] conv inputs, tg, tb [Hv, N] log decay and beta; tconv[i] [Kc-1, C] and tstate[i] [S, S, Hv]
    sequence i's past. -> (each sequence's gated_delta_net result: o [S, Hv, T] then the new state; its new
    conv inputs [Kc-1, C]; its mark's pieces).

    A sequence with a mark m (0 < m < T, marks[i]) is also wanted as it stands after its first m new tokens
    (a checkpoint a prompt's reader keeps): its rule runs as two ops, m tokens then T - m from the state
    the first left, which is what reading the two parts in two calls does, so its bits are the same either
    way. Its result is then the second op's (o of the last T - m tokens, the new state), and its pieces are
    (the first op's result: o of the first m tokens, then the state after them; the conv inputs [Kc-1, C]
    and the state [S, S, Hv] there, each a tensor of its own)."""
    gm, ctx = gr.g, gr.ctx
    c = int(tm.contents.ne[0])
    hv = int(tg.contents.ne[0])
    s = int(tstate[0].contents.ne[0])
    kc = int(rule.conv_weight.shape[1])
    hk = rule.n_k_heads

    def l2_norm(x: object) -> object:  # llama.cpp's form: rms_norm(x, eps / S) / sqrt(S)
        return gm.ggml_scale(ctx, gm.ggml_rms_norm(ctx, x, rule.eps / s), 1.0 / float(np.sqrt(s)))

    results, new_convs = [], []
    pieces: list[tuple[object, object, object] | None] = []
    for i, (start, t) in enumerate(spans):
        new = gm.ggml_view_2d(ctx, tm, c, t, c * 4, start * c * 4)  # [C, T]
        window = gm.ggml_concat(
            ctx, tconv[i], gm.ggml_cont(ctx, gm.ggml_transpose(ctx, new)), 0
        )  # [Kc-1+T, C]

        def last_inputs(at: int, window: object = window, t: int = t) -> object:
            """The Kc-1 conv inputs before new token `at`: [Kc-1, C]."""
            return gm.ggml_cont(ctx, gm.ggml_view_2d(ctx, window, kc - 1, c, (kc - 1 + t) * 4, at * 4))

        new_convs.append(last_inputs(t))
        sx = gm.ggml_reshape_3d(ctx, window, kc - 1 + t, c, 1)
        act = gm.ggml_silu(ctx, gm.ggml_ssm_conv(ctx, sx, cw))  # [C, T, 1]

        def heads(n_heads: int, first: int, act: object = act, t: int = t) -> object:
            view = gm.ggml_view_4d(ctx, act, s, n_heads, t, 1, s * 4, c * 4, c * t * 4, first * 4)
            return gm.ggml_cont(ctx, view)  # [S, H, T, 1]

        q = l2_norm(heads(hk, 0))
        k = l2_norm(heads(hk, hk * s))
        v = heads(hv, 2 * hk * s)
        if rule.grouped and hv != hk:
            # value head h <- key head h // r: repeat each key head r times in place
            r = hv // hk
            shape = gr.placed(_F32, s, r, hk, t)  # only its shape is read
            q, k = (
                gm.ggml_reshape_4d(ctx, gm.ggml_repeat(ctx, gm.ggml_reshape_4d(ctx, x, s, 1, hk, t), shape),
                                   s, hv, t, 1)
                for x in (q, k)
            )  # fmt: skip
        state = gm.ggml_reshape_4d(ctx, tstate[i], s, s, hv, 1)
        m = marks[i] if marks else 0
        if not 0 < m < t:
            results.append(_rule_op(gm, ctx, q, k, v, tg, tb, start, 0, t, state))
            pieces.append(None)
            continue
        head = _rule_op(gm, ctx, q, k, v, tg, tb, start, 0, m, state)
        there = gm.ggml_view_4d(ctx, head, s, s, hv, 1, s * 4, s * s * 4, s * s * hv * 4, m * hv * s * 4)
        results.append(_rule_op(gm, ctx, q, k, v, tg, tb, start, m, t - m, there))
        pieces.append((head, last_inputs(m), gm.ggml_cont(ctx, gm.ggml_reshape_3d(ctx, there, s, s, hv))))
    return results, new_convs, pieces


def _rule_op(
    gm: Any, ctx: object, q: object, k: object, v: object, tg: object, tb: object, start: int, first: int,
    n: int, state: object,
) -> object:  # fmt: skip
    """gated_delta_net over tokens first..first+n of a sequence whose q, k, v [S, H, T, 1] were made from its
    rows start.. of tg, tb [Hv, N], from `state` [S, S, Hv, 1]: o [S, Hv, n] then the new state."""
    hv = int(tg.contents.ne[0])

    def tokens(x: object) -> object:
        e = x.contents
        if first == 0 and int(e.ne[2]) == n:
            return x
        return gm.ggml_view_4d(ctx, x, int(e.ne[0]), int(e.ne[1]), n, 1, int(e.nb[1]), int(e.nb[2]),
                               int(e.nb[2]) * n, first * int(e.nb[2]))  # fmt: skip

    gi, bi = (
        gm.ggml_view_4d(ctx, x, 1, hv, n, 1, 4, hv * 4, hv * n * 4, (start + first) * hv * 4)
        for x in (tg, tb)
    )
    return gm.ggml_gated_delta_net(ctx, tokens(q), tokens(k), tokens(v), gi, bi, state, 1)


def _rule_results(
    states: Sequence[torch.Tensor], lengths: Sequence[int], hv: int, s: int
) -> list[torch.Tensor]:
    """Where each sequence's gated_delta_net result goes: [T*Hv*S outputs, then the new Hv*S*S state]. A state
    that lies at the end of such a buffer of this T (the one before came from a call of the same shape: a
    decode step after a decode step) is updated where it lies: ggml's op copies each head's state into its
    output and updates it there, reading nothing else of the input state, so the copy is onto itself. A
    new buffer each step was 2 MiB a sequence per layer of the real shape, every page of it zeroed by the
    kernel first. Whoever keeps an older state keeps a copy (DeltaNetState.checkpoint)."""
    out = []
    for st, t in zip(states, lengths, strict=True):
        n_attn, n = t * hv * s, t * hv * s + hv * s * s
        fits = (
            st.dtype == torch.float32
            and st.is_contiguous()
            and st.storage_offset() == n_attn
            and st.untyped_storage().nbytes() == 4 * n
        )
        out.append(st.as_strided((n,), (1,), 0) if fits else torch.empty(n))  # (the whole buffer st ends)
    return out


def _delta_rule_scratch(spans: Sequence[tuple[int, int]], c: int, kc: int, hv: int, s: int) -> int:
    return sum(4 * (t * hv * s + hv * s * s + 10 * (kc - 1 + t) * c) for _, t in spans) + 256 * 1024


def delta_net_step(
    mixed: torch.Tensor,
    convs: Sequence[torch.Tensor],
    g: torch.Tensor,
    beta: torch.Tensor,
    states: Sequence[torch.Tensor],
    rule: DeltaRule,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """T steps of Gated DeltaNet for each of B sequences, all in one ggml graph (llama.cpp's ops): the
    depthwise conv over each sequence's past and new inputs, SiLU, L2-normed q and k, the gated delta rule.

    mixed [B, T, C]: each sequence's T new conv inputs; convs: B x [C, Kc-1] each one's last Kc-1 inputs;
    g (log decay), beta [B, T, Hv]; states: B x [Hv, S, S] in ggml's layout: row j of a head's block holds
    column j of the state S (state[h, j, i] = S[i, j]).
    -> (o: B x [T, Hv, S], the new convs, the new states), each sequence's its own tensors: a state is read
    where it lies and the new one is a view of that sequence's output, so no state is copied on the way.

    Each sequence has its own ops, and every op computes a token's values from that token's row alone (the
    conv from its window, the rule step by step), so a sequence read T tokens at a time, one at a time
    (decode) or beside other sequences gets the same bits (and the same as in delta_net_layer's graph).
    """
    b, t, c = (int(d) for d in mixed.shape)
    kc = int(rule.conv_weight.shape[1])
    hv, s = int(states[0].shape[0]), int(states[0].shape[1])
    n_attn = t * hv * s
    spans = [(i * t, t) for i in range(b)]
    ins = (
        [_f32_rows(a) for a in (mixed, g, beta)]
        + [_f32_rows(x) for x in convs]
        + [_f32_rows(x) for x in states]
    )
    outs = _rule_results(states, [t] * b, hv, s) + [torch.empty(c, kc - 1) for _ in range(b)]
    w = _f32_rows(rule.conv_weight)

    def build(keep: bool) -> Graph:
        gr = Graph(_delta_rule_scratch(spans, c, kc, hv, s), 40 * b + 8, keep)
        tm, tg, tb = gr.input(c, b * t), gr.input(hv, b * t), gr.input(hv, b * t)
        tconv = [gr.input(kc - 1, c) for _ in range(b)]
        tstate = [gr.input(s, s, hv) for _ in range(b)]
        results, new_convs, _ = _delta_rule_ops(gr, tm, tg, tb, spans, tconv, tstate, rule, gr.constant(w))
        for r in results + new_convs:
            gr.output(r)
        return gr

    key = (
        ("dn-step", b, t, c, kc, hv, s, rule.n_k_heads, rule.grouped, w.data_ptr())
        if b * t <= KEEP_ROWS
        else None
    )
    _run(key, build, ins, outs)
    o = [y[:n_attn].view(t, hv, s) for y in outs[:b]]
    return o, outs[b:], [y[n_attn:].view(hv, s, s) for y in outs[:b]]


def delta_net_layer(
    x: torch.Tensor,
    lengths: Sequence[int],
    inputs: Sequence[Weight],
    posts: Sequence[Post | None],
    norm: Norm,
    convs: Sequence[torch.Tensor],
    states: Sequence[torch.Tensor],
    rule: DeltaRule,
    out_norm: Norm,
    out: Weight,
    marks: Sequence[int] = (),
) -> tuple[
    torch.Tensor, list[torch.Tensor], list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor] | None]
]:
    """A whole Gated DeltaNet layer over the new tokens of several sequences, in one graph:
    x + out(out_norm(delta_rule(conv(...))) * z) for x [N, D] (lengths[i] rows of sequence i, in order).

    `inputs` (after `norm`, with `posts`) give the conv input [N, C], silu(z) [N, Hv*S], beta and the log
    decay g [N, Hv], as linear() would; then delta_net_step's ops per sequence, then out_norm per value head,
    times z, the out product and the residual as linear() would. Every op is the one those calls run on the
    same values, so this gives their bits: a sequence's result does not depend on which path ran it.
    `marks[i]` (0 < m < lengths[i]; 0: none): sequence i's conv inputs [C, Kc-1] and state [Hv, S, S] after
    its first m new tokens too (_delta_rule_ops: the same bits as reading it in two calls).
    -> (y [N, D], the new convs, the new states [Hv, S, S]: views of this call's outputs, the marks' (conv,
    state) or None)."""
    x = _f32_rows(x)
    n, d = int(x.shape[0]), int(x.shape[1])
    c, hv = inputs[0].rows, inputs[2].rows
    s = int(states[0].shape[1])
    kc = int(rule.conv_weight.shape[1])
    starts = np.cumsum([0, *lengths[:-1]]).tolist()
    spans = [(int(a), int(t)) for a, t in zip(starts, lengths, strict=True)]
    w = _f32_rows(rule.conv_weight)
    ins = [x] + [_f32_rows(t) for t in convs] + [_f32_rows(t) for t in states]
    marks = tuple(int(m) if 0 < m < t else 0 for m, t in zip(marks, lengths, strict=True)) if marks else ()
    tails = [t - m for t, m in zip(lengths, marks, strict=True)] if marks else list(lengths)  # the last op's
    results = _rule_results(states, tails, hv, s)
    new_convs = [torch.empty(c, kc - 1) for _ in lengths]
    marked = [(torch.empty(c, kc - 1), torch.empty(hv, s, s)) for m in marks if m]
    y = torch.empty(n, d)

    def build(keep: bool) -> Graph:
        b = len(spans)
        scratch = (
            _dense_scratch(n, d, inputs, posts)
            + _delta_rule_scratch(spans, c, kc, hv, s)
            + _dense_scratch(n, hv * s, [out], [None])
            + 4 * 2 * n * hv * s
            + sum(
                4 * (t * hv * s + 2 * hv * s * s + (kc - 1) * c)
                for m, t in zip(marks, lengths, strict=False)
                if m
            )
        )
        gr = Graph(scratch, _dense_tensors(inputs, posts) + 40 * b + 24 + 24 * sum(map(bool, marks)), keep)
        gm, ctx = gr.g, gr.ctx
        xt = gr.input(d, n)
        tconv = [gr.input(kc - 1, c) for _ in range(b)]
        tstate = [gr.input(s, s, hv) for _ in range(b)]
        _, (tm, tz, tb, tg) = _dense_ops(gr, xt, inputs, posts, norm)
        res, ncs, pieces = _delta_rule_ops(gr, tm, tg, tb, spans, tconv, tstate, rule, gr.constant(w), marks)
        parts = []  # (o of rows start..start+T, start, T)
        for i, (r, p, (start, t)) in enumerate(zip(res, pieces, spans, strict=True)):
            m = marks[i] if p is not None else 0
            if p is not None:
                parts.append((p[0], start, m))
            parts.append((r, start + m, t - m))
        views = [gm.ggml_view_2d(ctx, r, hv * s, t, hv * s * 4, 0) for r, _, t in parts]
        o = views[0]
        if len(views) > 1:  # each part's rows copied into place (a chain of concats copied O(B^2) rows)
            o = gm.ggml_new_tensor_2d(ctx, _F32, hv * s, n)
            for view, (_, start, _) in zip(views, parts, strict=True):
                o = gm.ggml_set_2d_inplace(ctx, o, view, hv * s * 4, start * hv * s * 4)  # [Hv*S, N]
        (yt,) = _dense_ops(gr, o, [out], [None], out_norm, tz, xt)[1]
        gr.output(yt)
        for r in res + ncs:
            gr.output(r)
        for p in pieces:
            if p is not None:
                gr.output(p[1])
                gr.output(p[2])
        return gr

    key = None
    if n <= KEEP_ROWS:
        key = ("dn-layer", tuple(lengths), marks, *((v.ptr, _post_key(p)) for v, p in zip(inputs, posts, strict=True)),
               norm.weight.data_ptr(), norm.eps, out_norm.weight.data_ptr(), out_norm.eps, out.ptr, w.data_ptr())  # fmt: skip
    _run(key, build, ins, [y, *results, *new_convs, *(t for pair in marked for t in pair)])
    got = iter(marked)
    return (
        y,
        new_convs,
        [r[t * hv * s :].view(hv, s, s) for r, t in zip(results, tails, strict=True)],
        [next(got) if m else None for m in marks] if marks else [None] * len(lengths),
    )
