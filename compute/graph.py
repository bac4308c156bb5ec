"""ggml graphs over CPU arrays (numpy arrays; torch tensors in the coordinator): built once, run with the
inputs' and outputs' data pointers set in place,
kept for calls that repeat (a decode step's matmuls), their intermediates laid out by ggml's graph allocator.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from swarm.compute import probes
from swarm.compute.ggml import F32, compute_lock, ggml_lib, one_thread, threads
from swarm.compute.probes import rows_independent
from swarm.compute.weights import Weight, repack_anchor, repacked

log = logging.getLogger(__name__)

Array = Any  # a numpy array, or a torch tensor where the coordinator passes one (see `_buffer`)



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
    its buffer (grown to the largest graph so far) for the graphs after it: a prompt's graphs take a fraction
    of what a pool holding every intermediate at once would."""

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
    """One ggml graph over array inputs and outputs: built once, run once or (kept in a GraphCache) again.

    Inputs and outputs are slots: float32 CPU arrays (numpy arrays, or the coordinator's torch tensors: both
    are read through `_buffer`, which imports nothing) whose data pointers are set on each run, so
    ggml reads and writes them in place. Weights are used where they lie. Intermediates are laid out by ggml's
    graph allocator so that one whose last reader has run lends its memory to the next: in the per-thread
    buffer (a one-off graph: a prompt's) or in a buffer of the graph's own (a kept graph), which then holds
    the graph's largest live set, not every intermediate at once (a draft window's graphs keep their rows'
    DeltaNet states: summed, a 3-draft window's graphs of 30 layers held over a GiB).
    """

    def __init__(self, n_tensors: int, keep: bool = False) -> None:
        g = self.g = ggml_lib()
        self.n_nodes = max(16, 2 * n_tensors)
        size = (n_tensors + 8) * g.ggml_tensor_overhead() + g.ggml_graph_overhead_custom(self.n_nodes, False) + 4096
        self.kept = keep
        self.mem = np.empty(size, dtype=np.uint8) if keep else _buffers.get_ctx(size)
        params = g.ggml_init_params(mem_size=self.mem.nbytes, mem_buffer=self.mem.ctypes.data, no_alloc=True)
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
        self.galloc: _GraphAllocator | None = None  # a kept graph's own: its intermediates' buffer

    def free(self) -> None:
        if self.ctx:
            ctx, self.ctx = self.ctx, None
            self.g.ggml_free(ctx)
        self.galloc = None

    def __del__(self) -> None:
        if getattr(self.g, "ggml_free", None) is not None:  # at interpreter exit ggml may be gone first
            self.free()

    def placed(self, qtype: int, *ne: int) -> object:
        """A tensor of ggml shape `ne` (fastest dimension first) whose data the caller points somewhere."""
        return self.g.ggml_new_tensor(self.ctx, qtype, len(ne), (ctypes.c_int64 * len(ne))(*ne))

    def weight(self, w: Weight) -> object:
        t = self._matrix(w)
        t.contents.data = w.ptr
        self._weights.append(w.keep)
        return t

    def weight_slot(self, w: Weight) -> object:
        """A weight of w's type and shape whose matrix is given on each run (`run(weights=...)`), so one
        graph serves every matrix of that shape: a node's call for other experts of the same layer shape."""
        t = self._matrix(w, slot=True)
        self.weight_slots.append((t.contents, w.nbytes, w.repack is not None))
        return t

    def _matrix(self, w: Weight, slot: bool = False) -> object:
        t = self.placed(w.qtype, w.cols, w.rows, *([w.experts] if w.experts > 1 else []))
        if w.repack is not None:  # ggml runs the repacked kernels for a weight in a CPU_REPACK buffer
            # a slot's buffer only tells ggml the buffer type (its matrix comes with each run): a kept graph
            # holding the weight it was built with would keep that expert's copy alive past its eviction
            owner = repack_anchor() if slot else w.repack
            t.contents.buffer = ctypes.cast(owner.buffer, ctypes.c_void_p)
            t.contents.extra = w.repack.extra
            self._weights.append(owner)
        return t

    def input(self, *ne: int, qtype: int = F32) -> object:
        """An input slot of ggml shape `ne` (fastest first: [cols, rows] for a matrix), float32 by default."""
        t = self.placed(qtype, *ne)
        self.inputs.append((t, t.contents, int(np.prod(ne))))
        return t

    def constant(self, x: Array) -> object:
        """A float32 array that stays the same on every run (a bias), held by the graph."""
        x = f32_rows(x.reshape(1, -1) if len(x.shape) == 1 else x)
        t = self.placed(F32, int(x.shape[1]), int(x.shape[0]))
        t.contents.data = _buffer(x)[0]
        self._weights.append(x)
        return t

    def mul_mat(self, w: object, x: object) -> object:
        """w [I, O] (ggml order) times the rows of x [I, N] -> [O, N], each element by one kernel whatever N:
        a weight whose batched sums differ from one row's on this build (a repacked layout whose GEMM for 4
        rows sums in another order than its GEMV for one, `repacked_rows_independent`; tinyBLAS; ARM's 2-row
        int8-matmul kernels: swarm.compute.probes) gets its rows as N batches of one row [I, 1, N] (tinyBLAS
        only takes matmuls of 2 or more rows per batch, the 2-row kernels an even row count, the repacked
        GEMM 4 rows)."""
        g = self.g
        n = int(x.contents.ne[1])
        qtype = int(w.contents.type)
        repacked = bool(w.contents.buffer)
        one_by_one = not (repacked_rows_independent(qtype) if repacked else rows_independent(qtype))
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

    def add_row(self, x: object, bias: Array) -> object:
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
        self._allocate()
        return self

    def _allocate(self) -> None:
        """Place the intermediates with ggml's graph allocator: the per-thread one for a one-off graph, one of
        its own for a kept graph (its layout must outlive the next graph's). The slots (inputs, outputs,
        weight slots) get their memory on each run: they point at a placeholder meanwhile, so that the
        allocator leaves them (and their views) alone."""
        g = self.g
        slots = [c for _, c, _ in self.inputs + self.outputs] + [c for c, _, _ in self.weight_slots]
        for t in slots:
            if not t.data:
                t.data = _PLACEHOLDER
        for v, src, offs in self.views:
            v.data = src.data + offs
        if self.kept:
            self.galloc = _GraphAllocator()
            galloc = self.galloc.ptr
        else:
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

    def run(self, inputs: Sequence[Array], outputs: Sequence[Array], weights: Sequence[Weight] = ()) -> None:
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
            ptr, size, itemsize, _ = _buffer(x)
            if size != n or itemsize != 4:  # float32 (or int32 ids)
                raise ValueError(f"input of {size} {x.dtype} values for a slot of {n} float32")
            t.data = ptr
        for (_, t, n), y in zip(self.outputs, outputs, strict=True):
            ptr, size, _, f32 = _buffer(y)
            if size != n or not f32:
                raise ValueError(f"output of {size} {y.dtype} values for a slot of {n} float32")
            # ggml allocated the result in the graph's memory; point it at `y` instead (it is computed last)
            t.data = ptr
        for v, src, offs in self.views:
            v.data = src.data + offs
        g = self.g
        with compute_lock:
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


def _buffer(x: Array) -> tuple[int, int, int, bool]:
    """(address, elements, bytes per element, whether float32) of a C-contiguous CPU array: a numpy array,
    or a torch tensor read through its own methods (torch is not imported here: a node never loads it)."""
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            raise ValueError(f"a {x.shape} array that is not C-contiguous cannot be a graph's slot")
        return x.__array_interface__["data"][0], x.size, x.itemsize, x.dtype == np.float32
    if not x.is_contiguous() or x.device.type != "cpu":
        raise ValueError(f"a {tuple(x.shape)} tensor on {x.device} that is not contiguous on the CPU cannot be a slot")
    return x.data_ptr(), x.numel(), x.element_size(), str(x.dtype) == "torch.float32"


def f32_rows(x: Array) -> Array:
    """x as float32, C-contiguous, on the CPU: itself when it is (the common case, with no conversion)."""
    if isinstance(x, np.ndarray):
        return x if x.dtype == np.float32 and x.flags.c_contiguous else np.ascontiguousarray(x, np.float32)
    if str(x.dtype) == "torch.float32" and x.is_contiguous() and x.device.type == "cpu":
        return x
    return x.detach().cpu().float().contiguous()


def empty_rows(like: Array, shape: Sequence[int]) -> Array:
    """An uninitialised float32 CPU array of `shape`, of the kind `like` is (numpy, or a float32 torch tensor
    in the coordinator)."""
    if isinstance(like, np.ndarray):
        return np.empty(tuple(shape), np.float32)
    return like.new_empty(tuple(int(s) for s in shape))


def i32_rows(x: Array) -> Array:
    """Expert ids as int32, C-contiguous, on the CPU (the type ggml_mul_mat_id reads)."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x, np.int32)
    return x.cpu().int().contiguous()


def run_graph(
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


_repacked_independent: dict[int, bool] = {}
_repacked_lock = threading.Lock()


def repacked_rows_independent(qtype: int) -> bool:
    """Whether a batch of rows times a matrix of this type in ggml's repacked layout gives each row the bits
    it gets alone (the repacked GEMM of 4-row planes against the GEMV of one row): on an AVX2 build yes for
    Q4_0 and IQ4_NL, no for Q4_K. Probed once per type like `rows_independent` (2, 4, 7 and 8 rows against
    each alone, on one thread); a type without a repacked layout here: False."""
    qtype = int(qtype)
    with _repacked_lock:
        known = _repacked_independent.get(qtype)
        if known is None:
            known = _repacked_independent[qtype] = _probe_repacked(qtype)
            log.debug("rows of a repacked %s batch keep their bits alone: %s", qtype, known)
    return known


def _probe_repacked(qtype: int) -> bool:
    rows, cols = probes.PROBE_SHAPE
    w = repacked(Weight.of_bytes(probes.probe_weight(qtype, rows, cols), qtype, (rows, cols)))
    if w.repack is None:
        return False
    x = np.random.default_rng(1).standard_normal((max(probes.PROBE_ROWS), cols)).astype(np.float32)

    def product(xs: np.ndarray) -> np.ndarray:
        gr = Graph(8, keep=True)
        try:
            y = gr.g.ggml_mul_mat(gr.ctx, gr.weight(w), gr.input(cols, len(xs)))  # one plain batch
            gr.output(y)
            gr.build()
            out = np.empty((len(xs), rows), np.float32)
            gr.run([np.ascontiguousarray(xs)], [out])
            return out
        finally:
            gr.free()

    with one_thread():
        alone = np.concatenate([product(x[i : i + 1]) for i in range(len(x))])
        batched = {n: product(x[:n]) for n in probes.PROBE_ROWS}
    return probes.batch_keeps_rows(batched, alone)

