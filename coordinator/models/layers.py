"""Building blocks shared by every architecture: norms, RoPE, attention with its KV cache, the routed
MoE block with the shared expert, and the model API (DecoderModel, SequenceState, Batch).

Dimension letters: T tokens, D model width, E experts, K selected per token, F expert width, Fs shared width.
Modules are named after GGUF tensors, so a GGUF's tensors load by name. The one convention: a module
whose class sets GGUF_TRANSPARENT (the block's `moe`, an arch's attention) is a path segment the loader
drops (blk.N.moe.ffn_gate_inp.weight is the GGUF's blk.N.ffn_gate_inp.weight). Only nn.Modules and
pure functions: no file I/O, no network.

The model API: `model.new_state()` -> one SequenceState per sequence; `model(tokens [N], states,
lengths)` -> logits [N, V] for the new tokens of several sequences concatenated (attention runs per
sequence, every MoE layer sees all N tokens: one expert fan-out per layer for the whole batch);
`model.run(tokens, state)` for one sequence.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, Keys
from torch import nn

from swarm.compute import dense, ffn, ggml
from swarm.compute.dequant import dequantize
from swarm.compute.weights import Weight
from swarm.coordinator.experts import ExpertBackend, LocalExperts
from swarm.sharding.gguf_io import GGUFError

# llama.cpp clamps the sum of the selected routing weights before renormalising (build_moe_ffn).
RENORM_MIN = 2.0**-14


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


@dataclass(frozen=True)
class MoEConfig:
    n_embd: int  # D
    n_expert: int  # E
    n_expert_used: int  # K
    n_ff_shared: int  # Fs, 0 when the arch has no shared expert
    renormalize: bool  # top-K weights renormalised to sum 1 (all but qwen2moe)
    shared_gate: bool  # shared expert scaled by sigmoid(x . ffn_gate_inp_shexp)


def route(probs: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router probabilities [T, E] (the softmax of its logits over all E) -> (weights [T, K], ids [T, K]):
    top-K, optional renorm, as llama.cpp's build_moe_ffn: the K weights summed in double one after the other
    (ggml_sum_rows; a cumulative sum keeps that order), the sum clamped, then each weight divided by it.

    Ties go to the lower expert index, the same on every device. topk is not guaranteed stable, but where
    its K+1 largest are all distinct the choice and the order are unique; rows with a tie among them (or a
    NaN) are sorted by (prob desc, index asc) explicitly. topk is ~5x cheaper than sorting all E.
    """
    n_expert = probs.shape[-1]
    vals, ids = torch.topk(probs, min(k + 1, n_expert), dim=-1)  # [T, K+1], descending
    unsure = (vals[:, 1:] == vals[:, :-1]).any(dim=-1) | vals.isnan().any(dim=-1)  # [T]
    if bool(unsure.any()):
        rows = unsure.nonzero().squeeze(1)
        ids[rows] = torch.sort(probs[rows], dim=-1, descending=True, stable=True).indices[:, : ids.shape[1]]
    ids = ids[:, :k]  # [T, K]
    weights = probs.gather(-1, ids)  # [T, K]
    if renormalize:
        total = torch.cumsum(weights.double(), dim=-1)[:, -1:].float().clamp_min(RENORM_MIN)
        weights = weights / total
    return weights, ids


class MoE(nn.Module):
    """Routed experts (computed by an ExpertBackend, in process or on the swarm) plus the shared expert."""

    # The loader drops this module's path segment: its tensors sit directly under blk.N in a GGUF.
    GGUF_TRANSPARENT: ClassVar[bool] = True

    def __init__(self, cfg: MoEConfig, layer: int, experts: ExpertBackend) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer = layer
        self.experts = experts
        self.ffn_gate_inp = Linear(cfg.n_embd, cfg.n_expert)
        d, fs = cfg.n_embd, cfg.n_ff_shared
        self.ffn_gate_shexp = Linear(d, fs) if fs else None
        self.ffn_up_shexp = Linear(d, fs) if fs else None
        self.ffn_down_shexp = Linear(fs, d) if fs else None
        self.ffn_gate_inp_shexp = Linear(d, 1) if fs and cfg.shared_gate else None

    def forward(self, h: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """h [T, D] -> h + moe(norm(h)): the norm, the router's softmax and the shared expert's gate
        (sigmoid(x . w)) in one graph."""
        gates = [self.ffn_gate_inp] + (
            [self.ffn_gate_inp_shexp] if self.ffn_gate_inp_shexp is not None else []
        )
        x, probs, *shared_gate = project(
            h, *gates, post=[("soft_max",), ("sigmoid",)][: len(gates)], norm=norm, normed=True
        )
        gate_value = shared_gate[0] if shared_gate else None
        weights, ids = route(probs, self.cfg.n_expert_used, self.cfg.renormalize)
        whole = self._whole(h, x, weights, ids, gate_value)
        if whole is not None:
            return whole
        pending = self.experts.start(self.layer, x, ids)
        # Experts still in flight (computed elsewhere until wait()): the shared expert overlaps them on one
        # thread, the wait hides it, and the other cores are the nodes' (on this machine) or the network
        # stack's meanwhile. Experts already computed (in process): it takes every thread.
        in_flight = getattr(pending, "in_flight", False)
        with ggml.one_thread() if in_flight else contextlib.nullcontext():
            shared = self._shared(x, gate_value)
        out = pending.wait()  # [T, K, D]
        dropped = getattr(pending, "dropped", None)  # [T, K] bool: degraded mode left these pairs out
        if dropped is not None:
            kept = weights.masked_fill(dropped, 0.0)
            weights = kept * (
                weights.sum(-1, keepdim=True) / kept.sum(-1, keepdim=True).clamp_min(RENORM_MIN)
            )
        # Summed over K in slot order: the result does not depend on which holder answered first.
        if h.device.type == "cpu":
            return ffn.moe_combine(h, out, weights, shared)  # the ops of _whole's graph
        routed = (out * weights.unsqueeze(-1)).sum(dim=1)
        return h + (routed if shared is None else routed + shared)

    def _whole(
        self,
        h: torch.Tensor,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        gate_value: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """The experts, the shared expert and the sum in one graph (ffn.moe_layer: the ops of the path
        below, the same bits) when the experts are this process's own, stacked where they lie in the
        file, and every shared matrix is on ggml; else None."""
        if not isinstance(self.experts, LocalExperts) or h.device.type != "cpu":
            return None
        stack = self.experts.stack(self.layer, ids)
        shared = self._shared_ffn()
        if stack is None or (self.ffn_gate_shexp is not None and shared is None):
            return None
        return ffn.moe_layer(h, x, ids, weights, stack, shared, gate_value)

    def _shared_ffn(self) -> ffn.FFN | None:
        """The shared expert as ggml multiplies it; None without one or off ggml."""
        gate, up, down = self.ffn_gate_shexp, self.ffn_up_shexp, self.ffn_down_shexp
        if gate is None or up is None or down is None:
            return None
        mats = (gate.matrix, up.matrix, down.matrix)
        if not all(isinstance(m, GGMLMatrix) for m in mats):
            return None
        g, u, d = (m.weight for m in mats)  # type: ignore[union-attr]
        return ffn.FFN(down=d, gate=g, up=u)

    def _shared(self, x: torch.Tensor, gate_value: torch.Tensor | None) -> torch.Tensor | None:
        gate, up, down = self.ffn_gate_shexp, self.ffn_up_shexp, self.ffn_down_shexp
        if gate is None or up is None or down is None:
            return None
        on_ggml = self._shared_ffn()  # the same SwiGLU graph as a routed expert on a node
        y = ffn.ffn(on_ggml, x) if on_ggml is not None else down(F.silu(gate(x)) * up(x))
        if gate_value is not None:
            y = y * gate_value
        return y


# ---------------------------------------------------------------------------------------------------
# Attention building blocks shared by every architecture: RoPE, the KV cache, causal GQA attention.
# Extra letters: N tokens of several sequences concatenated, S keys held for one sequence, H heads,
# Hkv key/value heads, hd head width, R rotated dims per head (n_rot).


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
    heads at once, so K/V are never repeated (SDPA's GQA path on CPU is 10-20x slower for decode).
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


# ---------------------------------------------------------------------------------------------------
# The model API every architecture implements, and the plumbing of several sequences in one call.


@dataclass
class SequenceState:
    """Everything a model keeps for one sequence between calls: one entry per block.

    An attention block keeps a KVCache; a linear-attention block its conv and recurrent states.
    """

    layers: list[Any]
    length: int = 0  # tokens consumed so far = position of the next token
    # the checkpoint at the mark of the last call that had one for this sequence (DecoderModel's `marks`)
    marked: tuple[int, list[Any]] | None = None

    def checkpoint(self) -> tuple[int, list[Any]]:
        """What `restore` needs to bring this sequence back to now (the work after it is done again)."""
        return self.length, [s.checkpoint() for s in self.layers]

    def restore(self, cp: tuple[int, list[Any]]) -> None:
        self.length, states = cp
        for s, c in zip(self.layers, states, strict=True):
            s.restore(c)


@dataclass(frozen=True)
class Batch:
    """The layout of one call: the new tokens of several sequences, concatenated in order."""

    lengths: tuple[int, ...]  # new tokens of each sequence
    starts: tuple[int, ...]  # tokens each sequence already held = position of its first new token
    positions: torch.Tensor  # [N] absolute position of every token
    # per sequence, 0 or how many of its new tokens come before the point a checkpoint is wanted at (a
    # prompt's reader keeps one before the prompt's end): its recurrent layers keep their state there
    marks: tuple[int, ...] = ()

    @classmethod
    def of(
        cls,
        states: Sequence[SequenceState],
        lengths: Sequence[int],
        device: torch.device,
        marks: Sequence[int] = (),
    ) -> Batch:
        starts = tuple(s.length for s in states)
        # one tensor from a Python list: a decode step's few positions cost one op, not an arange per sequence
        at = [p for s, n in zip(starts, lengths, strict=True) for p in range(s, s + int(n))]
        positions = torch.tensor(at, dtype=torch.long, device=device)
        return cls(
            lengths=tuple(int(n) for n in lengths),
            starts=starts,
            positions=positions,
            marks=tuple(int(m) for m in marks) if any(marks) else (),
        )

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [N, ...] -> one tensor [lengths[i], ...] per sequence (views)."""
        if len(self.lengths) == 1:
            return (x,)
        return torch.split(x, list(self.lengths), dim=0)


class Block(Protocol):
    def __call__(self, x: torch.Tensor, batch: Batch, states: list[Any]) -> torch.Tensor:
        """x [N, D] -> [N, D]; states[i] is this block's state for sequence i (updated in place)."""
        ...

    def new_state(self) -> Any: ...


class PackedEmbedding(nn.Module):
    """token_embd kept as the file encodes it (quantized, f16, bf16) and decoded per lookup, row by row.

    A real vocabulary makes the table big (248k x 2048 is 2 GB as float32, 0.4 GB as Q6_K) while a step
    reads a handful of rows, and decoding just those rows gives the same float32 values as decoding the
    whole table. `rows` [V, bytes or values per row] may be a view of the file's memory map (only the rows
    looked up are read); `decode(rows, (n, D))` -> float32 [n, D] on the CPU.
    """

    def __init__(
        self,
        rows: np.ndarray,
        n_embd: int,
        decode: Callable[[np.ndarray, tuple[int, int]], torch.Tensor],
        device: torch.device,
    ) -> None:
        super().__init__()
        self.rows = rows
        self.num_embeddings, self.embedding_dim = int(rows.shape[0]), n_embd
        self.decode = decode
        self.device = device

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        picked = self.rows[ids.cpu().numpy()]  # [N, row]: copies of just these rows
        return self.decode(picked, (picked.shape[0], self.embedding_dim)).to(self.device)  # [N, D]


class DecoderModel(nn.Module):
    """token_embd -> blocks -> output_norm -> output. Subclasses fill `blk` with their blocks.

    Every block's forward(x [N, D], batch, states) runs attention (or the recurrence) per sequence
    and its MoE over all N tokens at once: one expert fan-out per layer for the whole batch.
    """

    token_embd: nn.Embedding | PackedEmbedding  # the loader's PackedEmbedding over the file's table

    def __init__(self, n_vocab: int, n_embd: int, eps: float) -> None:
        super().__init__()
        # A placeholder without memory (meta device): the loader puts the file's own table here.
        self.token_embd = nn.Embedding(n_vocab, n_embd, device="meta")
        self.token_embd.weight.requires_grad_(False)
        self.blk = nn.ModuleList()
        self.output_norm = RMSNorm(n_embd, eps)
        self.output = Linear(n_embd, n_vocab)

    def new_state(self) -> SequenceState:
        return SequenceState(layers=[blk.new_state() for blk in self.blk])

    def set_experts(self, experts: ExpertBackend) -> None:
        """Swap the expert backend of every MoE layer (in-process <-> swarm) without reloading."""
        for module in self.modules():
            if isinstance(module, MoE):
                module.experts = experts

    def forward(
        self,
        tokens: torch.Tensor,
        states: Sequence[SequenceState],
        lengths: Sequence[int],
        last_only: bool = False,
        marks: Sequence[int] = (),
    ) -> torch.Tensor:
        """tokens [N] (lengths[i] new tokens of sequence i, in order) -> logits [N, V] float32.

        With last_only, only each sequence's last position: [len(states), V] (saves the vocab
        projection of a long prefill). States are advanced in place. `marks[i]` (0 < m < lengths[i]; 0:
        none): sequence i is also checkpointed after its first m new tokens, into states[i].marked (as
        calling with those m tokens, checkpointing, and calling with the rest would, in one pass).
        """
        if not states or len(states) != len(lengths):
            raise ValueError(f"{len(states)} states but {len(lengths)} lengths; give at least one sequence")
        if sum(lengths) != tokens.shape[0] or any(n <= 0 for n in lengths):
            raise ValueError(f"lengths {list(lengths)} do not split {tokens.shape[0]} tokens")
        if marks and (
            len(marks) != len(lengths) or any(not 0 <= m < n for m, n in zip(marks, lengths, strict=True))
        ):
            raise ValueError(f"marks {list(marks)} do not fall within lengths {list(lengths)}")
        device = self.output_norm.weight.device
        # inference_mode throughout, so caches made in one call stay writable in the next.
        with torch.inference_mode():
            batch = Batch.of(states, lengths, device, marks)
            x = self.token_embd(tokens.to(device))  # [N, D]
            for i, blk in enumerate(self.blk):
                x = blk(x, batch, [s.layers[i] for s in states])
            for i, (s, n) in enumerate(zip(states, batch.lengths, strict=True)):
                if batch.marks and batch.marks[i]:
                    at = s.length + batch.marks[i]
                    s.marked = (at, [layer.take_marked(at) for layer in s.layers])
                s.length += n
            if last_only and x.shape[0] != len(states):  # (a decode step's rows are the last ones already)
                ends = torch.tensor(batch.lengths, device=device).cumsum(0) - 1
                x = x.index_select(0, ends)  # [B, D]
        # The head runs outside inference_mode so that callers get an ordinary tensor they may modify.
        with torch.no_grad():
            return project(x, self.output, norm=self.output_norm)[0].float()  # [N, V]

    def warm_up(self) -> None:
        """One token through every expert of every layer (llama.cpp warms up the same way), so that the
        weights are paged in, and every node has answered once, before the first real request."""
        moes = [m for m in self.modules() if isinstance(m, MoE)]
        kept = [m.cfg for m in moes]
        for m in moes:
            m.cfg = dataclasses.replace(m.cfg, n_expert_used=m.cfg.n_expert)
        try:
            self(torch.zeros(1, dtype=torch.long), [self.new_state()], [1])
        finally:
            for m, cfg in zip(moes, kept, strict=True):
                m.cfg = cfg

    def run(self, tokens: Sequence[int] | torch.Tensor, state: SequenceState) -> torch.Tensor:
        """One sequence: feed its next tokens, get logits [T, V]."""
        ids = torch.as_tensor(tokens, dtype=torch.long)
        return self(ids, [state], [ids.shape[0]])


# ---------------------------------------------------------------------------------------------------
# Reading hyper-parameters from GGUF metadata (every arch's Config.from_metadata uses these).


def meta_value(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    """meta[key]; a missing key with no default is a GGUFError naming it (the loader adds the file)."""
    if key in meta:
        return meta[key]
    if default is None:
        raise GGUFError(f"has no metadata key {key}, which this architecture needs; convert the model again")
    return default


def meta_int(meta: dict[str, Any], key: str, default: int | None = None) -> int:
    value = meta_value(meta, key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise GGUFError(f"metadata key {key} is {value!r}, expected an integer")
    return value


def meta_float(meta: dict[str, Any], key: str, default: float | None = None) -> float:
    value = meta_value(meta, key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise GGUFError(f"metadata key {key} is {value!r}, expected a number")
    return float(value)


def n_vocab_of(meta: dict[str, Any], arch: str) -> int:
    """Vocabulary size: `<arch>.vocab_size` when present, else the length of the token list."""
    key = Keys.LLM.VOCAB_SIZE.format(arch=arch)
    if key in meta:
        return meta_int(meta, key)
    tokens = meta.get(Keys.Tokenizer.LIST)
    if not isinstance(tokens, list) or not tokens:
        raise GGUFError(f"has neither {key} nor {Keys.Tokenizer.LIST}: the vocabulary size is unknown")
    return len(tokens)


def n_main_layers(meta: dict[str, Any], arch: str) -> int:
    """Blocks of the main pass: block_count less the trailing MTP blocks (`nextn_predict_layers`)."""
    n_block = meta_int(meta, Keys.LLM.BLOCK_COUNT.format(arch=arch))
    n_mtp = meta_int(meta, Keys.LLM.NEXTN_PREDICT_LAYERS.format(arch=arch), 0)
    if not 0 <= n_mtp < n_block:
        raise GGUFError(f"has {n_mtp} MTP blocks (nextn_predict_layers) but only {n_block} blocks in all")
    return n_block - n_mtp
