"""The standard-attention MoE decoder that qwen2moe and qwen3moe share: GQA attention (q/k/v biases in
qwen2moe, per-head q/k RMSNorm in qwen3moe), NeoX RoPE, then the routed experts (plus qwen2moe's gated
shared expert). Each arch module says only what differs, as flags of one frozen Config read here.

Dimension letters: N tokens (of every sequence in the call), D model width, H query heads, Hkv
key/value heads, hd head width, V vocabulary. The routed-expert FFN is moe.MoE: softmax over all
experts, top-K, then renormalised to sum 1 (qwen3moe, with llama.cpp's 2^-14 clamp) or the raw softmax
probabilities as weights (qwen2moe does NOT renormalise them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from gguf import Keys
from torch import nn

from swarm.coordinator.experts.backend import ExpertBackend
from swarm.coordinator.models.attention import KVCache, attend, heads_on_ggml, rope
from swarm.coordinator.models.base import Batch, DecoderModel
from swarm.coordinator.models.gguf_meta import meta_float, meta_int, n_main_layers, n_vocab_of
from swarm.coordinator.models.linear import Linear, RMSNorm, project
from swarm.coordinator.models.moe import MoE, MoEConfig


@dataclass(frozen=True)
class Config:
    n_vocab: int  # V
    n_embd: int  # D
    n_layer: int  # main-pass blocks (MTP blocks excluded)
    n_head: int  # H
    n_head_kv: int  # Hkv
    head_dim: int  # hd (key_length; may differ from D / H)
    n_rot: int
    rope_base: float
    eps: float
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int  # Fs; 0: no shared expert
    renormalize: bool  # top-K weights renormalised to sum 1
    qk_norm: bool  # per-head RMSNorm of q and k (attn_q_norm, attn_k_norm)
    attn_bias: bool = False  # q/k/v biases

    @classmethod
    def read(
        cls, meta: dict[str, Any], arch: str, *, shared_expert: bool, renormalize: bool, qk_norm: bool,
        attn_bias: bool = False,
    ) -> Config:  # fmt: skip
        """This arch's hyper-parameters from GGUF metadata (keys from gguf.Keys formatted with `arch`)."""
        a = arch
        n_embd = meta_int(meta, Keys.LLM.EMBEDDING_LENGTH.format(arch=a))
        n_head = meta_int(meta, Keys.Attention.HEAD_COUNT.format(arch=a))
        head_dim = meta_int(meta, Keys.Attention.KEY_LENGTH.format(arch=a), n_embd // n_head)
        n_used = meta_int(meta, Keys.LLM.EXPERT_USED_COUNT.format(arch=a))
        # Older files lack the expert widths; llama.cpp then derives them from feed_forward_length.
        n_ff = meta_int(meta, Keys.LLM.FEED_FORWARD_LENGTH.format(arch=a), 0)
        return cls(
            n_vocab=n_vocab_of(meta, a),
            n_embd=n_embd,
            n_layer=n_main_layers(meta, a),
            n_head=n_head,
            n_head_kv=meta_int(meta, Keys.Attention.HEAD_COUNT_KV.format(arch=a), n_head),
            head_dim=head_dim,
            n_rot=meta_int(meta, Keys.Rope.DIMENSION_COUNT.format(arch=a), head_dim),
            rope_base=meta_float(meta, Keys.Rope.FREQ_BASE.format(arch=a), 10000.0),
            eps=meta_float(meta, Keys.Attention.LAYERNORM_RMS_EPS.format(arch=a)),
            n_expert=meta_int(meta, Keys.LLM.EXPERT_COUNT.format(arch=a)),
            n_expert_used=n_used,
            n_ff_exp=meta_int(
                meta, Keys.LLM.EXPERT_FEED_FORWARD_LENGTH.format(arch=a), n_ff // max(n_used, 1)
            ),
            n_ff_shexp=(
                meta_int(meta, Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH.format(arch=a), n_ff)
                if shared_expert
                else 0
            ),
            renormalize=renormalize,
            qk_norm=qk_norm,
            attn_bias=attn_bias,
        )

    @property
    def moe(self) -> MoEConfig:
        return MoEConfig(
            n_embd=self.n_embd,
            n_expert=self.n_expert,
            n_expert_used=self.n_expert_used,
            n_ff_shared=self.n_ff_shexp,
            renormalize=self.renormalize,
            shared_gate=self.n_ff_shexp > 0,
        )


class Model(DecoderModel):
    def __init__(self, cfg: Config, experts: ExpertBackend) -> None:
        super().__init__(cfg.n_vocab, cfg.n_embd, cfg.eps)
        self.cfg = cfg
        self.blk.extend(Block(cfg, i, experts) for i in range(cfg.n_layer))


class Block(nn.Module):
    """x + attn(attn_norm(x)), then h + moe(ffn_norm(h))."""

    def __init__(self, cfg: Config, layer: int, experts: ExpertBackend) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.n_embd, cfg.eps)
        self.moe = MoE(cfg.moe, layer, experts)

    def new_state(self) -> KVCache:
        return KVCache()

    def forward(self, x: torch.Tensor, batch: Batch, states: list[KVCache]) -> torch.Tensor:
        # each norm runs in the graph of the products after it, each residual in the one before it
        h = self.attn(x, self.attn_norm, batch, states)  # x + attn(attn_norm(x)) [N, D]
        return self.moe(h, self.ffn_norm)  # all N tokens of every sequence in one fan-out


class Attention(nn.Module):
    """q, k, v projections (optional biases); optional per-head q/k RMSNorm; NeoX RoPE on q, k; causal GQA
    per sequence against its KV cache."""

    GGUF_TRANSPARENT: ClassVar[bool] = True  # tensors are blk.N.attn_*, no `attn.` segment

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.attn_q = Linear(cfg.n_embd, cfg.n_head * hd, bias=cfg.attn_bias)
        self.attn_k = Linear(cfg.n_embd, cfg.n_head_kv * hd, bias=cfg.attn_bias)
        self.attn_v = Linear(cfg.n_embd, cfg.n_head_kv * hd, bias=cfg.attn_bias)
        self.attn_output = Linear(cfg.n_head * hd, cfg.n_embd)
        self.attn_q_norm = RMSNorm(hd, cfg.eps) if cfg.qk_norm else None
        self.attn_k_norm = RMSNorm(hd, cfg.eps) if cfg.qk_norm else None
        # Native numerics (the loader sets it): the q/k norms and RoPE as llama.cpp computes them, in the
        # projections' graph. Exact numerics keep them in torch (RoPE's angles in float64: the oracle).
        self.native_steps = False

    def forward(self, x: torch.Tensor, norm: RMSNorm, batch: Batch, caches: list[KVCache]) -> torch.Tensor:
        """x [N, D] -> x + attention(norm(x))."""
        c, n = self.cfg, x.shape[0]
        linears = [self.attn_q, self.attn_k, self.attn_v]
        front = heads_on_ggml(self.native_steps, x, norm, linears, self.attn_q_norm, self.attn_k_norm, c,
                              batch.positions, gated=False)  # fmt: skip
        if front is not None:
            q, k, vx, _ = front
        else:
            qx, kx, vx = project(x, *linears, norm=norm)
            q = qx.view(n, c.n_head, c.head_dim)  # [N, H, hd]
            k = kx.view(n, c.n_head_kv, c.head_dim)  # [N, Hkv, hd]
            if self.attn_q_norm is not None and self.attn_k_norm is not None:
                q, k = self.attn_q_norm(q), self.attn_k_norm(k)
            q = rope(q, batch.positions, c.n_rot, c.rope_base)
            k = rope(k, batch.positions, c.n_rot, c.rope_base)
        v = vx.view(n, c.n_head_kv, c.head_dim)  # [N, Hkv, hd]
        o = attend(q, k, v, batch, caches)  # [N, H, hd]
        return project(o.reshape(n, c.n_head * c.head_dim), self.attn_output, residual=x)[0]  # [N, D]
