"""The Qwen3.5 / Qwen3.6 vision tower (an mmproj's `qwen3vl_merger`): a ViT over a picture's patches and the
2x2 merger that makes one row of the text model's width per window. Modules are named after the GGUF tensors
(`v.blk.N.attn_qkv`, `mm.0`, ...), so loading needs no rename table but one: the Conv3d's second temporal
slice, `v.patch_embd.weight.1`, is the module `v.patch_embd_1`.

The steps (llama.cpp tools/mtmd/models/qwen3vl.cpp; transformers Qwen3_5MoeVisionModel):
1. patch embedding: the split Conv3d is two products of each patch row (both temporal slices see the same
   still frame) plus the bias;
2. the learned position grid (pos_side x pos_side) resampled bilinearly with align_corners to the patch grid,
   added in the patches' window order;
3. blocks: x += attn_out(attention(ln1(x))); x += ffn_down(gelu(ffn_up(ln2(x)))), attention over all the
   picture's patches with a 2-D RoPE: of each head's hd/2 rotary pairs (i, i + hd/2), the first half turn by
   the patch's row, the second by its column, at frequencies theta^(-4j/hd);
4. merger: post_ln on every patch, each window's merge^2 patches joined, mm.2(gelu(mm.0(.))).

Numerics: native (llama.cpp's: swarm.coordinator.vision.native, ggml graphs on the stored matrices, ggml's
fp16-table GELU everywhere) or exact (transformers' float32: the tanh GELU in the ViT MLP, the erf GELU in
the merger). On a GPU both run in torch.

Dimension letters: P patches, D ViT width, F its MLP width, H heads, hd head width, N output rows,
E the text model's width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from swarm.coordinator.models.linear import Linear
from swarm.coordinator.vision import native
from swarm.coordinator.vision.mmproj import ROPE_THETA, VisionConfig
from swarm.coordinator.vision.native import LayerNorm


class VisionEncoder(nn.Module):
    """Patch rows of one picture (window order) -> its rows for the text model."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.v = ViT(cfg)
        width = cfg.n_embd * cfg.merge * cfg.merge
        self.mm = nn.ModuleDict(
            {"0": Linear(width, width, bias=True), "2": Linear(width, cfg.n_out, bias=True)}
        )
        self.native = True  # the loader's: llama.cpp's numerics (else transformers' float32)

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """patches [P, 3 * patch_size^2] float32 in window order, grid (rows, columns) of patches -> [N, E]."""
        gh, gw = grid
        m = self.cfg.merge
        if gh % m or gw % m or patches.shape[0] != gh * gw:
            raise ValueError(f"{patches.shape[0]} patches for a {gh} x {gw} grid (merge {m})")
        ggml = self.native and native.on_ggml(self.linears())
        x = self.v(patches, gh, gw, ggml)
        mm0, mm2 = self.mm["0"], self.mm["2"]
        if ggml:
            return native.chain(x, self.v.post_ln, [(mm0, True), (mm2, False)], group=m * m)
        x = self.v.post_ln(x).reshape(-1, mm0.d_in)  # [N, D * merge^2]
        h = mm0(x)
        # transformers' merger GELU is the erf one; llama.cpp's ggml_gelu is the tanh approximation
        return mm2(F.gelu(h) if not self.native else F.gelu(h, approximate="tanh"))

    def linears(self) -> list[Linear]:
        return [mod for mod in self.modules() if isinstance(mod, Linear)]


class PositionEmbedding(nn.Module):
    """The learned position grid: `weight` [pos_side^2, D], row-major over (row, column)."""

    def __init__(self, side: int, dim: int) -> None:
        super().__init__()
        self.side = side
        self.weight = nn.Parameter(torch.zeros(side * side, dim), requires_grad=False)

    def forward(self, gh: int, gw: int) -> torch.Tensor:
        """The grid resampled to gh x gw (bilinear, align_corners: the corners stay the corners) -> [gh * gw, D]
        in raster order."""
        s = self.side
        ys, xs = torch.linspace(0, s - 1, gh), torch.linspace(0, s - 1, gw)
        y0, x0 = ys.int(), xs.int()
        y1, x1 = (y0 + 1).clamp(max=s - 1), (x0 + 1).clamp(max=s - 1)
        dy, dx = (ys - y0)[:, None], (xs - x0)[None, :]  # [gh, 1], [1, gw]
        w = self.weight.float()

        def at(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
            return w[(rows[:, None] * s + cols[None, :]).reshape(-1)]  # [gh * gw, D]

        corners = (
            (at(y0, x0), (1 - dy) * (1 - dx)),
            (at(y0, x1), (1 - dy) * dx),
            (at(y1, x0), dy * (1 - dx)),
            (at(y1, x1), dy * dx),
        )
        out = torch.zeros(gh * gw, w.shape[1], device=w.device)
        for emb, weight in corners:
            out = out + emb * weight.reshape(-1, 1).to(w.device)
        return out


class ViT(nn.Module):
    """GGUF prefix `v.`: patch embedding, learned positions, blocks, post_ln."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embd = Linear(cfg.patch_values, cfg.n_embd, bias=True)
        self.patch_embd_1 = Linear(cfg.patch_values, cfg.n_embd)  # GGUF v.patch_embd.weight.1
        self.position_embd = PositionEmbedding(cfg.pos_side, cfg.n_embd)
        self.blk = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.n_layer))
        self.post_ln = LayerNorm(cfg.n_embd, cfg.eps)

    def forward(self, patches: torch.Tensor, gh: int, gw: int, ggml: bool) -> torch.Tensor:
        """-> [P, D] after the last block (post_ln is the merger's)."""
        m = self.cfg.merge
        bias = self.patch_embd.bias
        assert bias is not None
        if ggml:
            x = native.pair(patches, self.patch_embd, self.patch_embd_1, bias)
        else:
            first, second = self.patch_embd.matrix, self.patch_embd_1.matrix
            assert first is not None and second is not None
            x = first(patches) + second(patches) + bias
        pos = self.position_embd(gh, gw)
        x = x + window_order(pos, gh, gw, m).to(x.device)
        cos, sin = rope_tables(gh, gw, m, self.cfg.head_dim)
        cos, sin = cos.to(x.device), sin.to(x.device)
        for blk in self.blk:
            x = blk(x, cos, sin, ggml)
        return x


class VisionBlock(nn.Module):
    """One pre-LayerNorm ViT block: GGUF `ln1`, `attn_qkv`, `attn_out`, `ln2`, `ffn_up`, `ffn_down`."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d = cfg.n_embd
        self.n_head = cfg.n_head
        self.ln1 = LayerNorm(d, cfg.eps)
        self.attn_qkv = Linear(d, 3 * d, bias=True)
        self.attn_out = Linear(d, d, bias=True)
        self.ln2 = LayerNorm(d, cfg.eps)
        self.ffn_up = Linear(d, cfg.n_ff, bias=True)
        self.ffn_down = Linear(cfg.n_ff, d, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ggml: bool) -> torch.Tensor:
        if ggml:
            qkv = native.chain(x, self.ln1, [(self.attn_qkv, False)])
            x = native.chain(
                attention(qkv, cos, sin, self.n_head), None, [(self.attn_out, False)], residual=x
            )
            return native.chain(x, self.ln2, [(self.ffn_up, True), (self.ffn_down, False)], residual=x)
        x = x + self.attn_out(attention(self.attn_qkv(self.ln1(x)), cos, sin, self.n_head))
        return x + self.ffn_down(F.gelu(self.ffn_up(self.ln2(x)), approximate="tanh"))


def attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_head: int) -> torch.Tensor:
    """qkv [P, 3 * D] (rows [q; k; v]) -> [P, D]: full attention of every patch over the picture's patches,
    q and k turned by the 2-D RoPE (cos, sin [P, hd]), scale 1/sqrt(hd), float32."""
    p = qkv.shape[0]
    q, k, v = qkv.float().view(p, 3, n_head, -1).unbind(1)  # [P, H, hd] each
    hd = q.shape[-1]
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    # torch's fused (flash) attention never holds the [H, P, P] scores at once (16 heads x 16,384 patches
    # would be 17 GB); on the CPU it takes 4-D inputs only (3-D ones fall back to the math path, which holds
    # them: bench:vision), hence the batch of one. Its float32 sums differ from the plain softmax(q k^T) v by
    # float32 rounding alone.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=hd**-0.5
    )[0]  # [H, P, hd]
    return out.transpose(0, 1).reshape(p, n_head * hd).contiguous()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [P, H, hd] turned pairwise (i, i + hd/2) by the angles behind cos, sin [P, hd]."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + turned * sin[:, None, :]


def rope_tables(gh: int, gw: int, merge: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [P, hd] of the 2-D RoPE for the patches in window order: of the hd/2 angles, the first hd/4
    are row * theta^(-4j/hd), the next hd/4 column * theta^(-4j/hd) (j = 0..hd/4-1), then repeated for the
    pair's second member."""
    quarter = head_dim // 4
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float) / (2 * quarter)))
    rows = torch.arange(gh).repeat_interleave(gw)
    cols = torch.arange(gw).repeat(gh)
    rc = torch.stack((rows, cols), dim=-1).float()  # [P, 2] raster order
    rc = window_order(rc, gh, gw, merge)
    angles = (rc[:, :, None] * inv_freq[None, None, :]).reshape(-1, 2 * quarter)  # [P, hd/2]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def window_order(x: torch.Tensor, gh: int, gw: int, merge: int) -> torch.Tensor:
    """Rows of x [gh * gw, ...] from raster order to window order (see preprocess.Picture.patches)."""
    rest = x.shape[1:]
    y = x.reshape(gh // merge, merge, gw // merge, merge, *rest).transpose(1, 2)
    return y.reshape(gh * gw, *rest).contiguous()
