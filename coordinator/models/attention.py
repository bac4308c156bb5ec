"""Attention building blocks shared by every architecture: the projections' front in one ggml graph, NeoX
RoPE, causal GQA attention per sequence, and the KV cache it reads.

Dimension letters: N tokens of several sequences concatenated, T tokens of one sequence, S keys held for
one sequence, H heads, Hkv key/value heads, hd head width, R rotated dims per head (n_rot).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from swarm.compute import dense
from swarm.coordinator.models.base import Batch
from swarm.coordinator.models.linear import Linear, RMSNorm, ggml_form


def heads_on_ggml(
    native: bool,
    x: torch.Tensor,
    norm: RMSNorm,
    linears: Sequence[Linear],
    q_norm: RMSNorm | None,
    k_norm: RMSNorm | None,
    cfg: Any,
    positions: torch.Tensor,
    gated: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """An attention layer's front in one ggml graph (dense.attention_heads: norm, the q/k/v `linears`, the q/k
    norms, RoPE, a gate's sigmoid) for the native numerics; None where the layer computes it in torch (exact
    numerics, or a matrix not on ggml). `cfg` has n_head, n_head_kv, head_dim, n_rot and rope_base."""
    on_ggml = ggml_form(linears, [None] * len(linears)) if native else None
    if on_ggml is None:
        return None
    heads = dense.Heads(
        cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_rot, cfg.rope_base,
        q_norm.on_ggml() if q_norm is not None else None, k_norm.on_ggml() if k_norm is not None else None,
        gated,
    )  # fmt: skip
    return dense.attention_heads(x, norm.on_ggml(), *on_ggml, heads, positions)


def rope(x: torch.Tensor, positions: torch.Tensor, n_rot: int, base: float) -> torch.Tensor:
    """NeoX rotary embedding on the first n_rot dims of every head; the rest pass through.

    x [T, H, hd], positions [T] (absolute, int) -> [T, H, hd]. Dim i pairs with i + n_rot/2 (the
    two halves of the rotated part), frequency base^(-2i/n_rot). The rotation runs in x's dtype on
    cos/sin tables computed in float64 (the phase stays exact at long positions).
    """
    half = n_rot // 2
    cos, sin = rope_tables(positions, n_rot, base)  # [T, R/2] float32
    cos = cos.to(device=x.device, dtype=x.dtype)[:, None, :]  # [T, 1, R/2]
    sin = sin.to(device=x.device, dtype=x.dtype)[:, None, :]
    x1, x2, rest = x[..., :half], x[..., half:n_rot], x[..., n_rot:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def rope_sections_of(sections: Sequence[int], n_rot: int) -> torch.Tensor:
    """Which position component (0: t, 1: h, 2: w) each rotary pair of interleaved multi-section RoPE (llama.cpp's
    IMROPE, Qwen3-VL / Qwen3.5) reads: pair i falls in sector i % sum(sections), sectors cycle t, h, w while
    each section lasts. [n_rot / 2] long. (hybrid.check_text_rope_sections refuses files where a pair would
    read the 4th component.)"""
    total = sum(sections)
    comp = []
    for pair in range(n_rot // 2):
        sector = pair % total
        comp.append(next(c for c in range(3) if sector % 3 == c and sector < 3 * sections[c]))
    return torch.tensor(comp, dtype=torch.long)


def rope_multi(
    x: torch.Tensor, positions: torch.Tensor, n_rot: int, base: float, comp: torch.Tensor
) -> torch.Tensor:
    """Interleaved multi-section RoPE (NeoX pairing) of picture rows: x [k, H, hd], positions [3, k] (t, h, w)
    -> [k, H, hd]; rotary pair i turns by positions[comp[i]] * base^(-2i/n_rot). The angles come from
    `rope`'s tables (a row's bits depend on its positions alone; a row whose three positions are equal gets
    `rope`'s rotation)."""
    half = n_rot // 2
    tables = [rope_tables(positions[c], n_rot, base) for c in range(3)]  # 3 x ([k, R/2], [k, R/2])
    pick = comp.to(torch.long)[None, :].expand(positions.shape[1], half)  # [k, R/2]
    cos = torch.stack([t[0] for t in tables], dim=-1).gather(-1, pick[..., None])[..., 0]
    sin = torch.stack([t[1] for t in tables], dim=-1).gather(-1, pick[..., None])[..., 0]
    cos = cos.to(device=x.device, dtype=x.dtype)[:, None, :]  # [k, 1, R/2]
    sin = sin.to(device=x.device, dtype=x.dtype)[:, None, :]
    x1, x2, rest = x[..., :half], x[..., half:n_rot], x[..., n_rot:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


ROPE_BLOCK = 64  # positions per cached table block


def rope_tables(positions: torch.Tensor, n_rot: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, R/2] of every position's angles, from fixed blocks of ROPE_BLOCK positions.

    Each block is always computed by one call of one shape, so a position's values are the same whatever
    else is in the batch (a vectorized cos rounds its last elements differently from the rest).
    """
    pos = positions.to("cpu", torch.long)
    blocks = torch.div(pos, ROPE_BLOCK, rounding_mode="floor")
    ids = sorted(set(blocks.tolist()))
    cos_t = torch.cat([_rope_block(n_rot, float(base), b)[0] for b in ids])
    sin_t = torch.cat([_rope_block(n_rot, float(base), b)[1] for b in ids])
    where = {b: i for i, b in enumerate(ids)}
    rows = torch.tensor([where[b] for b in blocks.tolist()], dtype=torch.long) * ROPE_BLOCK + pos % ROPE_BLOCK
    return cos_t[rows], sin_t[rows]


@functools.lru_cache(maxsize=1024)
def _rope_block(n_rot: int, base: float, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    half = n_rot // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64) * 2.0 / n_rot)  # [R/2]
    pos = torch.arange(block * ROPE_BLOCK, (block + 1) * ROPE_BLOCK, dtype=torch.float64)
    angles = pos[:, None] * inv_freq[None, :]  # [B, R/2]
    return angles.cos().float(), angles.sin().float()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention of one sequence, scale 1/sqrt(hd), in q's dtype.

    q [H, T, hd] are the last T positions of the S held in k, v [Hkv, S, hd] (S >= T: the cache plus
    the new tokens); query t sits at position S - T + t and sees keys 0..S-T+t. Query head h reads
    key/value head h // (H / Hkv), as llama.cpp and transformers group them. -> [H, T, hdv].

    Written as grouped matmuls rather than SDPA: each key/value head multiplies its group of query
    heads at once, so K/V are never repeated (SDPA's GQA path on CPU is far slower for decode).
    Each query is computed as the decode step at its position computes it (the same products over exactly
    the keys it sees, nothing masked), so a sequence read in one call, in chunks or a token at a time gets
    the same bits: the matmul and softmax kernels pick their blocking by shape, and a masked longer row
    would sum in another order.
    """
    h, t, hd = q.shape
    hkv, s, hdv = k.shape[0], k.shape[1], v.shape[2]
    rep = h // hkv
    out = q.new_empty(h, t, hdv)
    for i in range(t):
        n_keys = s - t + i + 1
        qi = q[:, i].reshape(hkv, rep, hd)  # [Hkv, rep, hd]
        scores = torch.bmm(qi, k[:, :n_keys].transpose(1, 2)).mul_(hd**-0.5)  # [Hkv, rep, S']
        out[:, i] = torch.bmm(torch.softmax(scores, dim=-1), v[:, :n_keys]).view(h, hdv)
    return out


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch, caches: Sequence[KVCache]
) -> torch.Tensor:
    """Attention of every sequence in the batch against its own cache.

    q [N, H, hd], k [N, Hkv, hd], v [N, Hkv, hdv] (already normed and rotated) -> [N, H, hdv].
    Each sequence's new k, v are appended to caches[i] first.
    """
    out = []
    for cache, qi, ki, vi in zip(caches, batch.split(q), batch.split(k), batch.split(v), strict=True):
        keys, values = cache.append(ki.transpose(0, 1), vi.transpose(0, 1))  # [Hkv, S, hd]
        out.append(attention(qi.transpose(0, 1), keys, values).transpose(0, 1))  # [T, H, hdv]
    return torch.cat(out)


class KVCache:
    """Keys and values of one attention layer for one sequence, grown by doubling (amortised O(1) append)."""

    MIN_CAPACITY = 64

    def __init__(self) -> None:
        self.length = 0  # S: positions held
        self.capacity: int | None = None  # most positions it will hold (grows no further), None: no bound
        self._k: torch.Tensor | None = None  # [Hkv, capacity, hd]
        self._v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add k [Hkv, T, hd], v [Hkv, T, hdv]; return every held key and value [Hkv, S, hd] (views)."""
        t = k.shape[1]
        need = self.length + t
        if self._k is None or self._v is None or need > self._k.shape[1]:
            self._grow(k, v, need)
        assert self._k is not None and self._v is not None
        self._k[:, self.length : need] = k
        self._v[:, self.length : need] = v
        self.length = need
        return self._k[:, :need], self._v[:, :need]

    def checkpoint(self) -> int:
        return self.length

    def take_marked(self, position: int) -> int:
        """The checkpoint at `position` of what this cache holds (the cache only appends)."""
        return position

    def restore(self, length: int) -> None:
        """Forget what came after the checkpoint (the cache only appends, so the length is the state)."""
        self.length = length

    def _grow(self, k: torch.Tensor, v: torch.Tensor, need: int) -> None:
        cap = max(self.MIN_CAPACITY, 2 * (self._k.shape[1] if self._k is not None else 0))
        cap = max(need, cap if self.capacity is None else min(cap, self.capacity))
        new_k = k.new_empty(k.shape[0], cap, k.shape[2])
        new_v = v.new_empty(v.shape[0], cap, v.shape[2])
        if self._k is not None and self._v is not None:
            new_k[:, : self.length] = self._k[:, : self.length]
            new_v[:, : self.length] = self._v[:, : self.length]
        self._k, self._v = new_k, new_v
