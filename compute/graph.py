"""ggml graphs over torch tensors: built once, run with the inputs' and outputs' data pointers set in place,
kept for calls that repeat (a decode step's matmuls), their intermediates laid out by ggml's graph allocator.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch

from swarm.compute.ggml import F32, compute_lock, ggml_lib, threads
from swarm.compute.probes import tinyblas_exact
from swarm.compute.weights import Weight

log = logging.getLogger(__name__)



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

    def input(self, *ne: int, qtype: int = F32) -> object:
        """An input slot of ggml shape `ne` (fastest first: [cols, rows] for a matrix), float32 by default."""
        t = self.placed(qtype, *ne)
        self.inputs.append((t, t.contents, int(np.prod(ne))))
        return t

    def constant(self, x: torch.Tensor) -> object:
        """A float32 tensor that stays the same on every run (a bias), held by the graph."""
        x = f32_rows(x.reshape(1, -1) if x.dim() == 1 else x)
        t = self.placed(F32, int(x.shape[1]), int(x.shape[0]))
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
        one_by_one = bool(w.contents.buffer) or not tinyblas_exact(int(w.contents.type))  # repacked: gemv
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


def f32_rows(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32 and x.is_contiguous() and x.device.type == "cpu":
        return x  # the common case, without torch's dispatch of a no-op conversion
    return x.to(device="cpu", dtype=torch.float32).contiguous()


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
