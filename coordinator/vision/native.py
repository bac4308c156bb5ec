"""The vision tower's native numerics: its LayerNorm -> products -> GELU chains as llama.cpp's clip graph
computes them, in one ggml graph each, on the matrices as the mmproj stores them (F32, F16, BF16, Q8_0, ...).

What makes these llama.cpp's numbers rather than torch's: ggml_norm (mean and variance summed in double),
the products with each activation row converted to the weight's vec_dot type (F16 for an F16 matrix, as
llama.cpp's conv_2d does through its F16 im2col), and ggml_gelu, which on the CPU reads a table of fp16
values indexed by the fp16-rounded input. Attention and the 2-D RoPE stay in torch float32: both engines
compute them in float32 and the difference is far below the GELU table's.

Dimension letters: N rows, I input width, O output width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from swarm.compute.graph import Graph, f32_rows, run_graph
from swarm.coordinator.models.linear import GGMLMatrix, Linear


class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dim (GGUF `ln1`, `ln2`, `post_ln`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


def on_ggml(linears: Sequence[Linear]) -> bool:
    """Whether every matrix is multiplied by ggml on the CPU (else torch computes the tower: a GPU)."""
    return all(isinstance(lin.matrix, GGMLMatrix) for lin in linears)


def chain(
    x: torch.Tensor,
    norm: LayerNorm | None,
    steps: Sequence[tuple[Linear, bool]],
    group: int = 1,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [N, I] through `norm` (ggml_norm, times weight, plus bias), then `group` consecutive rows joined into
    one (the merger's 2x2 windows), then each (Linear, gelu) step: the product, its bias, ggml_gelu where
    asked; `residual` added last. One ggml graph; every Linear's matrix must be on ggml."""
    x = f32_rows(x)
    n, cols = int(x.shape[0]), int(x.shape[1])
    if n % group:
        raise ValueError(f"{n} rows do not join into groups of {group}")
    out_rows, out_cols = n // group, steps[-1][0].d_out
    out = torch.empty(out_rows, out_cols)
    inputs = [x] if residual is None else [x, f32_rows(residual)]

    def build(keep: bool) -> Graph:
        gr = Graph(8 + 6 * len(steps) + 8, keep)
        g, ctx = gr.g, gr.ctx
        t = gr.input(cols, n)
        rt = gr.input(out_cols, out_rows) if residual is not None else None
        if norm is not None:
            t = g.ggml_norm(ctx, t, norm.eps)
            t = g.ggml_add(
                ctx, g.ggml_mul(ctx, t, gr.constant(norm.weight.detach())), gr.constant(norm.bias.detach())
            )
        if group > 1:
            t = g.ggml_reshape_2d(ctx, t, cols * group, out_rows)
        for lin, gelu in steps:
            assert isinstance(lin.matrix, GGMLMatrix), "chain() takes matrices on ggml"
            t = _whole_picture(gr, gr.weight(lin.matrix.weight), t)
            if lin.bias is not None:
                t = gr.add_row(t, lin.bias.detach())
            if gelu:
                t = g.ggml_gelu(ctx, t)
        if rt is not None:
            t = g.ggml_add(ctx, t, rt)
        gr.output(t)
        return gr

    run_graph(None, build, inputs, [out])  # a picture's graph runs once: nothing to keep
    return out


def pair(x: torch.Tensor, first: Linear, second: Linear, bias: torch.Tensor) -> torch.Tensor:
    """first(x) + second(x) + bias in one graph: the patch embedding, llama.cpp's two conv_2d of the split
    Conv3d (one per temporal slice, both on the same still frame) added, then the bias."""
    x = f32_rows(x)
    n, cols = int(x.shape[0]), int(x.shape[1])
    out = torch.empty(n, first.d_out)

    def build(keep: bool) -> Graph:
        gr = Graph(16, keep)
        g, ctx = gr.g, gr.ctx
        t = gr.input(cols, n)
        ys = [_whole_picture(gr, gr.weight(lin.matrix.weight), t) for lin in (first, second)]  # type: ignore[union-attr]
        gr.output(gr.add_row(g.ggml_add(ctx, ys[0], ys[1]), bias.detach()))
        return gr

    run_graph(None, build, [x], [out])
    return out


def _whole_picture(gr: Graph, w: object, x: object) -> object:
    """w [I, O] times every row of x [I, N] in one batched product (tinyBLAS, the repacked GEMM: the kernels
    llama.cpp's encoder runs), not row by row as the text model's products (Graph.mul_mat): a picture is
    always encoded whole, on its own, so its rows are the same whatever else is read beside it, and the
    batched kernels run its F16 products 2-4x faster (docs/BENCHMARKS.md, bench:vision)."""
    return gr.g.ggml_mul_mat(gr.ctx, w, x)
