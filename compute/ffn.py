"""SwiGLU feed-forwards on ggml: one FFN on rows (a shared expert), a stack of experts over routed rows
(a node's call, or a whole MoE layer in process) and the weighted combination of their outputs.

Rows are numpy arrays on a node and torch tensors in the coordinator (swarm.compute.graph reads both); each
function returns the kind it was given.

Dimension letters: N rows, D model width, F expert width, K selected experts.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from swarm.compute.ggml import ggml_lib
from swarm.compute.graph import KEEP_ROWS, Array, Graph, empty_rows, f32_rows, i32_rows, run_graph
from swarm.compute.weights import Weight

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class FFN:
    """One SwiGLU feed-forward net: down(silu(gate x) * up x), gate and up stored apart or fused [2F, I]."""

    down: Weight  # [I, F]
    gate: Weight | None = None  # [F, I]
    up: Weight | None = None  # [F, I]
    gate_up: Weight | None = None  # [2F, I], gate rows first
    gate_bias: Array | None = None  # [F] (or [2F] with gate_up), float32
    up_bias: Array | None = None
    down_bias: Array | None = None

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
            *(id(b) if b is not None else 0 for b in bs),
        )

    def add_to(self, gr: Graph, xt: object, inner: list[object] | None = None) -> object:
        """This FFN over the rows of graph tensor xt: its output tensor; its matrices are weight slots, in the
        order of `matrices`. `inner`: the gate and up products are appended to it as one [n, 2F] tensor, gate
        first (the fused product itself, else the two joined in the graph), what an answer check reads beside
        the output."""
        if self.gate_up is not None:
            h = gr.mul_mat(gr.weight_slot(self.gate_up), xt)  # [n, 2F]
            if self.gate_bias is not None:
                h = gr.add_row(h, self.gate_bias)
            if inner is not None:
                inner.append(h)
            h = gr.swiglu(h)
        else:
            assert self.gate is not None and self.up is not None
            gate = gr.mul_mat(gr.weight_slot(self.gate), xt)  # [n, F]
            up = gr.mul_mat(gr.weight_slot(self.up), xt)
            if self.gate_bias is not None:
                gate = gr.add_row(gate, self.gate_bias)
            if self.up_bias is not None:
                up = gr.add_row(up, self.up_bias)
            if inner is not None:  # one [n, 2F] tensor, gate first, as the fused product lies
                inner.append(gr.g.ggml_concat(gr.ctx, gate, up, 0))
            h = gr.swiglu(gate, up)  # [n, F]
        y = gr.mul_mat(gr.weight_slot(self.down), h)  # [n, D]
        if self.down_bias is not None:
            y = gr.add_row(y, self.down_bias)
        return y


def ffn_rows(
    blocks: Sequence[tuple[FFN, int, int]], x: Array, out: Array, inner: Array | None = None
) -> None:
    """For each (ffn, start, n): out[start:start+n] = ffn(x[start:start+n]); one graph for all of them.
    `inner` [N, 2F]: each row's gate and up products too (gate first), as the graph computed them.

    x, out [N, D] float32 contiguous CPU (numpy, or torch in the coordinator). This is a node's whole Compute call (every expert it was sent
    for one layer) and the coordinator's shared expert. A graph takes its matrices on each run, so a small
    call's graph is kept for the next call of the same shapes, whichever experts it multiplies.
    """
    blocks = [(f, a, n) for f, a, n in blocks if n]
    if not blocks:
        return
    d = int(x.shape[1])

    def build(kept: bool) -> Graph:
        gr = Graph(16 * len(blocks) + 2, kept)  # 3 products, their views, swiglu, the joined inner, in, out
        for f, _, n in blocks:
            products: list[object] | None = [] if inner is not None else None
            gr.output(f.add_to(gr, gr.input(d, n), products))
            for t in products or ():
                gr.output(t)
        return gr

    key = None
    if sum(n for _, _, n in blocks) <= KEEP_ROWS:
        key = ("ffn", inner is not None, *((f.shape, n) for f, _, n in blocks))
    weights = [w for f, _, _ in blocks for w in f.matrices]
    outs = []
    for _, a, n in blocks:
        outs.append(out[a : a + n])
        if inner is not None:
            outs.append(inner[a : a + n])  # [n, 2F]: the graph writes the gate and up products here
    run_graph(key, build, [x[a : a + n] for _, a, n in blocks], outs, weights)


def ffn(f: FFN, x: Array) -> Array:
    """One FFN over rows x [N, D] -> [N, D] float32."""
    x = f32_rows(x)
    out = empty_rows(x, x.shape)
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


def _moe_ops(
    gr: Graph, stack: ExpertStack, xt: object, it: object, inner: list[object] | None = None
) -> object:
    """Expert ids it [S, N] (int32) of rows xt [D, 1, N] -> their FFNs' outputs [D, S, N]; the gate and up
    products appended to `inner` as FFN.add_to does."""
    g, ctx = gr.g, gr.ctx
    if stack.gate_up is not None:
        gu = g.ggml_mul_mat_id(ctx, gr.weight(stack.gate_up), xt, it)  # [2F, S, N]
        if inner is not None:
            inner.append(gu)
        h = g.ggml_swiglu(ctx, gu)
    else:
        assert stack.gate is not None and stack.up is not None
        gate = g.ggml_mul_mat_id(ctx, gr.weight(stack.gate), xt, it)  # [F, S, N]
        up = g.ggml_mul_mat_id(ctx, gr.weight(stack.up), xt, it)
        if inner is not None:
            inner.append(g.ggml_concat(ctx, gate, up, 0))  # [2F, S, N], gate first
        h = g.ggml_swiglu_split(ctx, gate, up)
    return g.ggml_mul_mat_id(ctx, gr.weight(stack.down), h, it)  # [D, S, N]


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


def moe_combine(h: Array, out: Array, weights: Array, shared: Array | None) -> Array:
    """A MoE layer's output from its parts: h [T, D] + sum_k weights[:, k] * out[:, k] + shared [T, D], for
    the experts' outputs out [T, K, D] however they were computed (a node's, in process); moe_layer computes
    the same ops in its graph."""
    t, k, d = (int(v) for v in out.shape)
    ins = [f32_rows(h), f32_rows(out), f32_rows(weights)] + (
        [f32_rows(shared)] if shared is not None else []
    )
    y = empty_rows(ins[0], (t, d))

    def build(keep: bool) -> Graph:
        gr = Graph(2 * k + 12, keep)
        ht, ot, wt = gr.input(d, t), gr.input(d, k, t), gr.input(1, k, t)
        st = gr.input(d, t) if shared is not None else None
        gr.output(_combine_ops(gr, ot, wt, st, ht))
        return gr

    key = ("combine", t, k, d, shared is not None) if t <= KEEP_ROWS else None
    run_graph(key, build, ins, [y])
    return y


def moe_layer(
    h: Array,
    x: Array,
    ids: Array,
    weights: Array,
    stack: ExpertStack,
    shared: FFN | None,
    shared_gate: Array | None,
) -> Array:
    """A whole MoE layer in process, in one graph: h [T, D] + sum_k weights[:, k] * expert_k(x) +
    shared_gate * shared(x), for the normed rows x [T, D], the routed experts ids [T, K] of `stack` and
    their weights [T, K], shared_gate [T, 1]. The ops of moe_rows, ffn and moe_combine on the same values:
    the same bits as computing the experts apart (here or on nodes) and combining them with moe_combine."""
    t, d = int(x.shape[0]), int(x.shape[1])
    k = int(ids.shape[1])
    ins = [f32_rows(x), i32_rows(ids), f32_rows(weights), f32_rows(h)]
    if shared_gate is not None:
        ins.append(f32_rows(shared_gate))
    y = empty_rows(ins[0], (t, d))

    def build(keep: bool) -> Graph:
        g = ggml_lib()
        gr = Graph(2 * k + 40, keep)
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
    run_graph(key, build, ins, [y], shared.matrices if shared is not None else ())
    return y


def moe_rows(stack: ExpertStack, ids: Array, x: Array, out: Array, inner: Array | None = None) -> None:
    """out[i, s] = expert ids[i, s]'s FFN of x[i] for rows x [N, D], ids [N, S] -> out [N, S, D]: one
    mul_mat_id per matrix for every expert at once (fewer, larger ops than one graph node per expert: the
    threads share all the experts' rows). A node's call is S = 1 (rows packed expert-major); in process a
    step's tokens go as they are, S = K slots each. Each (row, slot) is computed by the same per-row kernel
    as ffn_rows, so the bits are the same either way. `inner` [N, 2F] (S = 1 only): each row's gate and up
    products too, gate first."""
    n, d = int(x.shape[0]), int(x.shape[1])
    if n == 0:
        return
    slots = int(ids.shape[1])
    ids = i32_rows(ids)

    def build(keep: bool) -> Graph:
        gr = Graph(12, keep)
        xt = gr.input(d, 1, n)  # [D, 1, N]: every slot of a row reads the row
        it = gr.input(slots, n, qtype=gr.g.GGML_TYPE_I32)
        products: list[object] | None = [] if inner is not None else None
        gr.output(_moe_ops(gr, stack, xt, it, products))
        for t in products or ():
            gr.output(t)
        return gr

    outs = [out]
    if inner is not None:
        assert slots == 1, "inner products are for a node's calls (one slot a row)"
        outs.append(inner)
    # the graph depends on the stack and the shape only (the experts are an input): a decode step's call
    # repeats it layer after layer
    ws = (stack.down, stack.gate, stack.up, stack.gate_up)
    key = None
    if n <= KEEP_ROWS:
        key = ("moe", n, slots, inner is not None, *(w.ptr if w is not None else 0 for w in ws))
    run_graph(key, build, [x, ids], outs)


def swiglu_rows(gate_up: Array) -> Array:
    """silu(gate) * up of rows [N, 2F] (gate first) -> [N, F], by ggml's own swiglu: the same bits as the h a
    graph of this build forms between an expert's products (its vectorized exp is not libm's)."""
    gate_up = f32_rows(gate_up)
    n, f2 = int(gate_up.shape[0]), int(gate_up.shape[1])
    h = empty_rows(gate_up, (n, f2 // 2))
    if n == 0:
        return h

    def build(keep: bool) -> Graph:
        gr = Graph(4, keep)
        gr.output(gr.swiglu(gr.input(f2, n)))
        return gr

    run_graph(("swiglu", n, f2) if n <= KEEP_ROWS else None, build, [gate_up], [h])
    return h
