"""Linear layers and the RMSNorm before them: a GGUF matrix as the loader sets it (multiplied by torch on
a GPU or by ggml where the file holds it), and `project`, which runs a norm, several products of the same
input and what follows them in one ggml graph where every matrix is on ggml.

Dimension letters: N rows, I input width, O output width.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from swarm.compute import dense
from swarm.compute.dequant import dequantize
from swarm.compute.weights import Weight


class RMSNorm(nn.Module):
    """x / rms(x) * weight. GGUF weights already carry any "+1" offset, so they are used as stored."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def on_ggml(self) -> dense.Norm:
        """This norm as a ggml graph applies it."""
        return dense.Norm(self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class TorchMatrix:
    """A weight [out, in] as a torch tensor on a GPU (float16 for the native numerics, float32 for exact)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight).float()

    def dense(self) -> torch.Tensor:
        return self.weight.float()


class GGMLMatrix:
    """A weight [out, in] multiplied by ggml's CPU kernels where it lies (a view of the GGUF's memory map in
    its file type for the native numerics; a float32 copy for exact). See swarm.compute.weights."""

    def __init__(self, weight: Weight) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return dense.linear([self.weight], x.reshape(-1, x.shape[-1]))[0].view(*x.shape[:-1], -1)

    def dense(self) -> torch.Tensor:
        w = self.weight
        if w.qtype == int(GGMLQuantizationType.F32):
            return torch.from_numpy(np.array(w.stored, dtype=np.float32)).view(w.rows, w.cols)
        return dequantize(w.stored, GGMLQuantizationType(w.qtype), (w.rows, w.cols))


Matrix = TorchMatrix | GGMLMatrix


class Linear(nn.Module):
    """A GGUF matrix {in, out}: weight [out, in] as the loader sets it (a Matrix: multiplied as the file
    stores it, see swarm.compute.weights), optional bias [out] (float32)."""

    def __init__(self, d_in: int, d_out: int, bias: bool = False) -> None:
        super().__init__()
        self.d_in, self.d_out = d_in, d_out
        self.matrix: Matrix | None = None  # the loader's: not a parameter, never a float32 copy
        self.bias = nn.Parameter(torch.empty(d_out), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.matrix is not None, "Linear used before the loader set its matrix"
        y = self.matrix(x)
        return y if self.bias is None else y + self.bias


def project(
    x: torch.Tensor,
    *linears: Linear,
    post: Sequence[dense.Post | None] | None = None,
    norm: RMSNorm | None = None,
    gate: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    normed: bool = False,
) -> list[torch.Tensor]:
    """x [N, I] through several Linears of the same input, with what comes just before and after them:
    `norm` first (per group of its width: a row, or each head of a row), then times `gate` [N, I], the
    products, `post[j]` on output j (dense.Post: an activation), `residual` [N, O_0] added to the first.
    `normed`: the input as multiplied (after norm and gate) comes first in the list.

    One ggml graph when every matrix is on ggml (a decode step's pieces are small, and each graph and each
    torch op around it has a fixed cost), else torch op by op (a GPU)."""
    posts = list(post) if post is not None else [None] * len(linears)
    on_ggml = ggml_form(linears, posts)
    if on_ggml is not None:
        weights, steps = on_ggml
        return dense.linear(
            weights,
            x,
            steps,
            norm=norm.on_ggml() if norm is not None else None,
            gate=gate,
            residual=residual,
            normed=normed,
        )
    xn = x if norm is None else norm(x.view(*x.shape[:-1], -1, norm.weight.numel())).view(x.shape)
    if gate is not None:
        xn = xn * gate
    outs = [dense.apply_post(lin(xn), p) for lin, p in zip(linears, posts, strict=True)]
    if residual is not None:
        outs[0] = outs[0] + residual
    return [xn, *outs] if normed else outs


def ggml_form(
    linears: Sequence[Linear], posts: Sequence[dense.Post | None]
) -> tuple[list[Weight], list[dense.Post | None]] | None:
    """The matrices and steps ggml multiplies these Linears as (a bias is the first step after its
    product), or None when one of them is not on ggml (a GPU)."""
    mats = [lin.matrix for lin in linears]
    if not all(isinstance(m, GGMLMatrix) for m in mats):
        return None
    steps = [
        (("add", lin.bias), *(p or ())) if lin.bias is not None else p
        for lin, p in zip(linears, posts, strict=True)
    ]
    return [m.weight for m in mats], steps  # type: ignore[union-attr]
