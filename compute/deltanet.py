"""Gated DeltaNet on ggml: the causal conv and the delta rule of a linear-attention layer, for one decode
step or a whole prompt.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from swarm.compute.dense import Norm, Post, dense_ops, dense_tensors, post_key
from swarm.compute.ggml import F32
from swarm.compute.graph import KEEP_ROWS, Graph, f32_rows, run_graph
from swarm.compute.weights import Weight

log = logging.getLogger(__name__)


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
    marks: Sequence[tuple[int, ...]] = (),
) -> tuple[list[object], list[object], list[list[tuple[object, object, object]]]]:
    """The conv, SiLU, L2-normed q and k and the gated delta rule of each sequence (start, T) of the rows:
    tm [C, N] conv inputs, tg, tb [Hv, N] log decay and beta; tconv[i] [Kc-1, C] and tstate[i] [S, S, Hv]
    sequence i's past. -> (each sequence's gated_delta_net result: o [S, Hv, T] then the new state; its new
    conv inputs [Kc-1, C]; its marks' pieces).

    A sequence with marks m1 < m2 < ... (each 0 < m < T, marks[i]) is also wanted as it stands after its
    first m1, m2, ... new tokens (a checkpoint a prompt's reader keeps; every row of a checking window): its
    rule runs as one op per stretch between marks, each from the state the one before left, which is what
    reading the stretches in separate calls does, so its bits are the same either way. Its result is then
    the last op's (o of the tokens after the last mark, the new state), and its pieces, one per mark, are
    (the op's result before the mark: o of its tokens, then the state after them; the conv inputs [Kc-1, C]
    and the state [S, S, Hv] at the mark, each a tensor of its own)."""
    gm, ctx = gr.g, gr.ctx
    c = int(tm.contents.ne[0])
    hv = int(tg.contents.ne[0])
    s = int(tstate[0].contents.ne[0])
    kc = int(rule.conv_weight.shape[1])
    hk = rule.n_k_heads

    def l2_norm(x: object) -> object:  # llama.cpp's form: rms_norm(x, eps / S) / sqrt(S)
        return gm.ggml_scale(ctx, gm.ggml_rms_norm(ctx, x, rule.eps / s), 1.0 / float(np.sqrt(s)))

    results, new_convs = [], []
    pieces: list[list[tuple[object, object, object]]] = []
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
            shape = gr.placed(F32, s, r, hk, t)  # only its shape is read
            q, k = (
                gm.ggml_reshape_4d(ctx, gm.ggml_repeat(ctx, gm.ggml_reshape_4d(ctx, x, s, 1, hk, t), shape),
                                   s, hv, t, 1)
                for x in (q, k)
            )  # fmt: skip
        state = gm.ggml_reshape_4d(ctx, tstate[i], s, s, hv, 1)
        cuts = marks[i] if marks else ()
        mine = []
        first = 0
        for m in cuts:  # one op per stretch between marks, each from the state the one before left
            head = _rule_op(gm, ctx, q, k, v, tg, tb, start, first, m - first, state)
            n_out = (m - first) * hv * s
            state = gm.ggml_view_4d(ctx, head, s, s, hv, 1, s * 4, s * s * 4, s * s * hv * 4, n_out * 4)
            mine.append((head, last_inputs(m), gm.ggml_cont(ctx, gm.ggml_reshape_3d(ctx, state, s, s, hv))))
            first = m
        results.append(_rule_op(gm, ctx, q, k, v, tg, tb, start, first, t - first, state))
        pieces.append(mine)
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


def result_size(t: int, hv: int, s: int) -> int:
    """Floats of one sequence's gated_delta_net result for t tokens: T*Hv*S outputs, then the Hv*S*S state."""
    return t * hv * s + hv * s * s


def own_buffer(state: torch.Tensor, n: int) -> torch.Tensor | None:
    """The whole n-float result buffer `state` lies at the end of (the one before came from a call of the same
    T: a decode step after a decode step), else None."""
    fits = (
        state.dtype == torch.float32
        and state.is_contiguous()
        and state.storage_offset() == n - state.numel()
        and state.untyped_storage().nbytes() == 4 * n
    )
    return state.as_strided((n,), (1,), 0) if fits else None


# Where a sequence's result may be written: (its index in the call, the result's size in floats) -> an
# n-float buffer, or None for a new one.
Buffers = Callable[[int, int], torch.Tensor | None]


def _rule_results(
    states: Sequence[torch.Tensor], lengths: Sequence[int], hv: int, s: int, buffers: Buffers | None = None
) -> list[torch.Tensor]:
    """Where each sequence's gated_delta_net result goes: [T*Hv*S outputs, then the new Hv*S*S state].
    ggml's op copies each head's state into its output and updates it there, reading nothing else of the
    input state, so a state may be updated where it lies, at the end of its own buffer. A new buffer each
    step would be megabytes a sequence per layer at a real model's shape, every page of it zeroed by the
    kernel first. Without `buffers` a state is updated where it lies whenever it can be (whoever keeps an
    older state keeps a copy); with them, the caller says where (models/deltanet.py keeps checkpoints that
    share a state's buffer, and gives another one while a checkpoint refers to it)."""
    out = []
    for i, (st, t) in enumerate(zip(states, lengths, strict=True)):
        n = result_size(t, hv, s)
        buf = own_buffer(st, n) if buffers is None else buffers(i, n)
        out.append(buf if buf is not None and buf.numel() == n else torch.empty(n))
    return out


def delta_net_step(
    mixed: torch.Tensor,
    convs: Sequence[torch.Tensor],
    g: torch.Tensor,
    beta: torch.Tensor,
    states: Sequence[torch.Tensor],
    rule: DeltaRule,
    buffers: Buffers | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """T steps of Gated DeltaNet for each of B sequences, all in one ggml graph (llama.cpp's ops): the
    depthwise conv over each sequence's past and new inputs, SiLU, L2-normed q and k, the gated delta rule.

    mixed [B, T, C]: each sequence's T new conv inputs; convs: B x [C, Kc-1] each one's last Kc-1 inputs;
    g (log decay), beta [B, T, Hv]; states: B x [Hv, S, S] in ggml's layout: row j of a head's block holds
    column j of the state S (state[h, j, i] = S[i, j]).
    -> (o: B x [T, Hv, S], the new convs, the new states), each sequence's its own tensors: a state is read
    where it lies and the new one is a view of that sequence's output, so no state is copied on the way
    (`buffers`: where each result goes, see _rule_results).

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
        [f32_rows(a) for a in (mixed, g, beta)] + [f32_rows(x) for x in convs] + [f32_rows(x) for x in states]
    )
    outs = _rule_results(states, [t] * b, hv, s, buffers) + [torch.empty(c, kc - 1) for _ in range(b)]
    w = f32_rows(rule.conv_weight)

    def build(keep: bool) -> Graph:
        gr = Graph(40 * b + 8, keep)
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
    run_graph(key, build, ins, outs)
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
    marks: Sequence[Sequence[int]] = (),
    buffers: Buffers | None = None,
) -> tuple[
    torch.Tensor, list[torch.Tensor], list[torch.Tensor], list[list[tuple[torch.Tensor, torch.Tensor]]]
]:
    """A whole Gated DeltaNet layer over the new tokens of several sequences, in one graph:
    x + out(out_norm(delta_rule(conv(...))) * z) for x [N, D] (lengths[i] rows of sequence i, in order).

    `inputs` (after `norm`, with `posts`) give the conv input [N, C], silu(z) [N, Hv*S], beta and the log
    decay g [N, Hv], as linear() would; then delta_net_step's ops per sequence, then out_norm per value head,
    times z, the out product and the residual as linear() would. Every op is the one those calls run on the
    same values, so this gives their bits: a sequence's result does not depend on which path ran it.
    `marks[i]` (increasing, each 0 < m < lengths[i]): sequence i's conv inputs [C, Kc-1] and state [Hv, S, S]
    after its first m new tokens too (_delta_rule_ops: the same bits as reading it in separate calls).
    -> (y [N, D], the new convs, the new states [Hv, S, S]: views of this call's outputs, per sequence the
    (conv, state) at each of its marks)."""
    x = f32_rows(x)
    n, d = int(x.shape[0]), int(x.shape[1])
    c, hv = inputs[0].rows, inputs[2].rows
    s = int(states[0].shape[1])
    kc = int(rule.conv_weight.shape[1])
    starts = np.cumsum([0, *lengths[:-1]]).tolist()
    spans = [(int(a), int(t)) for a, t in zip(starts, lengths, strict=True)]
    w = f32_rows(rule.conv_weight)
    ins = [x] + [f32_rows(t) for t in convs] + [f32_rows(t) for t in states]
    marks = tuple(tuple(int(m) for m in ms) for ms in marks) if any(marks) else ()
    tails = [t - (ms[-1] if ms else 0) for t, ms in zip(lengths, marks or [()] * len(lengths), strict=True)]
    results = _rule_results(states, tails, hv, s, buffers)
    new_convs = [torch.empty(c, kc - 1) for _ in lengths]
    marked = [[(torch.empty(c, kc - 1), torch.empty(hv, s, s)) for _ in ms] for ms in marks]
    y = torch.empty(n, d)

    def build(keep: bool) -> Graph:
        b = len(spans)
        gr = Graph(dense_tensors(inputs, posts) + 40 * b + 24 + 24 * sum(map(len, marks)), keep)
        xt = gr.input(d, n)
        tconv = [gr.input(kc - 1, c) for _ in range(b)]
        tstate = [gr.input(s, s, hv) for _ in range(b)]
        _, (tm, tz, tb, tg) = dense_ops(gr, xt, inputs, posts, norm)
        res, ncs, pieces = _delta_rule_ops(gr, tm, tg, tb, spans, tconv, tstate, rule, gr.constant(w), marks)
        o = _rows_in_place(gr, res, pieces, spans, marks, hv * s, n)  # [Hv*S, N]
        (yt,) = dense_ops(gr, o, [out], [None], out_norm, tz, xt)[1]
        gr.output(yt)
        for r in res + ncs:
            gr.output(r)
        for mine in pieces:
            for p in mine:
                gr.output(p[1])
                gr.output(p[2])
        return gr

    key = None
    if n <= KEEP_ROWS:
        key = ("dn-layer", tuple(lengths), marks, *((v.ptr, post_key(p)) for v, p in zip(inputs, posts, strict=True)),
               norm.weight.data_ptr(), norm.eps, out_norm.weight.data_ptr(), out_norm.eps, out.ptr, w.data_ptr())  # fmt: skip
    run_graph(
        key, build, ins, [y, *results, *new_convs, *(t for mine in marked for pair in mine for t in pair)]
    )
    return (
        y,
        new_convs,
        [r[t * hv * s :].view(hv, s, s) for r, t in zip(results, tails, strict=True)],
        marked or [[] for _ in lengths],
    )


def _rows_in_place(
    gr: Graph,
    res: Sequence[object],
    pieces: Sequence[Sequence[tuple[object, object, object]]],
    spans: Sequence[tuple[int, int]],
    marks: Sequence[Sequence[int]],
    width: int,
    n: int,
) -> object:
    """o [width, N] (width = Hv*S): the rule outputs of _delta_rule_ops (a marked sequence's ops) each at
    its rows of the call. Each part's rows are copied into place: a chain of concats would copy O(B^2) rows
    for B sequences."""
    gm, ctx = gr.g, gr.ctx
    parts = []  # (o of rows start..start+T, start, T)
    for i, (r, mine, (start, t)) in enumerate(zip(res, pieces, spans, strict=True)):
        first = 0
        for p, m in zip(mine, marks[i] if marks else (), strict=True):
            parts.append((p[0], start + first, m - first))
            first = m
        parts.append((r, start + first, t - first))
    views = [gm.ggml_view_2d(ctx, r, width, t, width * 4, 0) for r, _, t in parts]
    o = views[0]
    if len(views) > 1:
        o = gm.ggml_new_tensor_2d(ctx, F32, width, n)
        for view, (_, start, _) in zip(views, parts, strict=True):
            o = gm.ggml_set_2d_inplace(ctx, o, view, width * 4, start * width * 4)
    return o
