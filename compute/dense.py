"""The coordinator's dense products on ggml: matmuls of one input against several weights with their
post-steps, the attention heads' front (projections, per-head norms, RoPE), and elementwise ops.

Dimension letters: N rows, I input width, O output width.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swarm.compute.graph import KEEP_ROWS, Graph, f32_rows, run_graph
from swarm.compute.weights import Weight

log = logging.getLogger(__name__)

# What happens to a product before it leaves the graph: steps in order, each the name of a unary op
# ("sigmoid", "silu", "softplus", "exp") or ("add" | "mul", a float32 vector [O] broadcast over the rows).
Post = tuple[str | tuple[str, torch.Tensor], ...]


def post_key(post: Post | None) -> tuple:
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
    x = f32_rows(x)
    n, cols = int(x.shape[0]), int(x.shape[1])
    posts = list(post) if post is not None else [None] * len(weights)
    extra = [t for t in (gate, residual) if t is not None]
    inputs = [x, *(f32_rows(t) for t in extra)]
    outs = ([torch.empty(n, cols)] if normed else []) + [torch.empty(n, w.rows) for w in weights]
    if norm is not None and cols % norm.weight.numel():
        raise ValueError(f"a norm of {norm.weight.numel()} values does not divide rows of {cols}")

    def build(keep: bool) -> Graph:
        gr = Graph(dense_tensors(weights, posts), keep)
        xt = gr.input(cols, n)
        gt = gr.input(cols, n) if gate is not None else None
        rt = gr.input(weights[0].rows, n) if residual is not None else None
        xin, ys = dense_ops(gr, xt, weights, posts, norm, gt, rt)
        if normed:  # the input itself is a slot, not a result: copy it out
            gr.output(xin if norm is not None or gate is not None else gr.g.ggml_cont(gr.ctx, xin))
        for y in ys:
            gr.output(y)
        return gr

    key = None
    if n <= KEEP_ROWS:
        shape = (norm.weight.data_ptr(), norm.eps) if norm is not None else None
        key = ("linear", n, shape, gate is not None, residual is not None, normed,
               *((w.ptr, post_key(p)) for w, p in zip(weights, posts, strict=True)))  # fmt: skip
    run_graph(key, build, inputs, outs)
    return outs


def dense_tensors(weights: Sequence[Weight], posts: Sequence[Post | None]) -> int:
    return 2 * len(weights) + 2 * sum(len(p or ()) for p in posts) + 12


def dense_ops(
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
    x = f32_rows(x)
    n, cols = int(x.shape[0]), int(x.shape[1])
    h, hkv, hd = heads.n_head, heads.n_head_kv, heads.head_dim
    pos = positions.to(device="cpu", dtype=torch.int32).contiguous()
    outs = [torch.empty(n, h, hd), torch.empty(n, hkv, hd), torch.empty(n, hkv * hd)]
    if heads.gated:
        outs.append(torch.empty(n, h * hd))

    def build(keep: bool) -> Graph:
        gr = Graph(dense_tensors(weights, posts) + 24, keep)
        g, ctx = gr.g, gr.ctx
        xt = gr.input(cols, n)
        pt = gr.input(n, qtype=g.GGML_TYPE_I32)
        _, (qx, kx, vx) = dense_ops(gr, xt, weights, posts, norm)
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
               *((w.ptr, post_key(p)) for w, p in zip(weights, posts, strict=True)),
               *(nm.weight.data_ptr() if nm is not None else None for nm in (heads.q_norm, heads.k_norm)))  # fmt: skip
    run_graph(key, build, [x, pos], outs)
    return outs[0], outs[1], outs[2], outs[3] if heads.gated else None


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
    x2 = f32_rows(x.reshape(-1, shape[-1]) if x.dim() else x.reshape(1, 1))
    rows, cols = int(x2.shape[0]), int(x2.shape[1])
    out = torch.empty_like(x2)

    def build(keep: bool) -> Graph:
        gr = Graph(3, keep)
        gr.output(getattr(gr.g, f"ggml_{op}")(gr.ctx, gr.input(cols, rows)))
        return gr

    run_graph(("unary", op, rows, cols) if rows <= KEEP_ROWS else None, build, [x2], [out])
    return out.view(shape)

