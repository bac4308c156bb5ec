"""What qwen35moe and qwen3next share: the hybrid model of Gated DeltaNet layers (models.deltanet) and
gated full attention, each followed by the routed MoE.

Dimension letters: N tokens of all sequences in a call, D model width, V vocabulary, C = 2*Hk*Dk + Hv*Dv
conv channels, Hk / Hv linear-attention key / value heads, Dk = Dv their head width, H / Hkv
full-attention query / key-value heads, Dh their head width, Kc conv kernel.

The two archs differ only in how a file lays out the linear attention (see `HybridConfig`):
- value head h uses key head h % Hk (qwen35moe: the converter re-tiles value heads) or h // (Hv/Hk)
  (qwen3next: value heads stay grouped by key head);
- beta and alpha come from two matrices (`ssm_beta`, `ssm_alpha`; qwen35moe) or one `ssm_ba` laid
  out per key head as [b (Hv/Hk), a (Hv/Hk)] (qwen3next); old qwen3next files carry the raw fused
  `ssm_in` (per key head [q, k, v, z]) instead of `attn_qkv` + `attn_gate`; metadata does not say
  which, so the loader refines the config from the tensor names (`HybridConfig.for_tensors`).
Module names follow the GGUF tensors (blk.N.ssm_a, blk.N.ssm_dt.bias, ...), so a file loads by name.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Self

import torch
from gguf import Keys
from torch import nn

from swarm.compute import dense
from swarm.coordinator.experts.backend import ExpertBackend
from swarm.coordinator.models.attention import (
    KVCache,
    attend,
    heads_on_ggml,
    rope,
    rope_multi,
    rope_sections_of,
)
from swarm.coordinator.models.base import Batch, DecoderModel
from swarm.coordinator.models.deltanet import DeltaNetState, GatedDeltaNet
from swarm.coordinator.models.gguf_meta import meta_float, meta_int, n_vocab_of
from swarm.coordinator.models.linear import Linear, RMSNorm, project
from swarm.coordinator.models.moe import MoE, MoEConfig
from swarm.sharding.gguf_io import RECURRENT_LAYERS_KEY, GGUFError


@dataclass(frozen=True)
class HybridConfig:
    arch: str
    n_vocab: int  # V
    n_embd: int  # D
    n_layer: int  # blocks in the main pass (MTP blocks excluded)
    n_nextn: int  # MTP blocks after the main ones, not run
    eps: float  # every RMSNorm, q/k norms and the gated norm included
    recurrent: tuple[bool, ...]  # per main block: Gated DeltaNet (True) or full attention
    # full attention
    n_head: int  # H
    n_head_kv: int  # Hkv
    head_dim: int  # Dh
    n_rot: int  # leading dims of each head that RoPE rotates (NeoX pairing i, i + n_rot/2)
    rope_base: float
    # Gated DeltaNet
    conv_kernel: int  # Kc
    n_k_heads: int  # Hk
    n_v_heads: int  # Hv
    d_state: int  # Dk = Dv
    v_heads_tiled: bool  # value head h uses key head h % Hk (else h // (Hv/Hk))
    fused_ba: bool  # beta/alpha from one ssm_ba matrix (else ssm_beta + ssm_alpha)
    moe: MoEConfig = field(repr=False)
    fused_qkvz: bool = False  # old qwen3next files: ssm_in instead of attn_qkv + attn_gate
    # rope.dimension_sections (qwen35moe: interleaved multi-section RoPE for picture rows); () where the file
    # has none (text positions only)
    rope_sections: tuple[int, ...] = ()

    @property
    def conv_dim(self) -> int:
        return 2 * self.n_k_heads * self.d_state + self.n_v_heads * self.d_state

    def for_tensors(self, names: Collection[str]) -> HybridConfig:
        """The config for a file holding tensors `names`: picks the legacy fused ssm_in layout
        (which metadata does not announce) when the file has it."""
        fused = any(n.endswith(".ssm_in.weight") for n in names)
        return self if fused == self.fused_qkvz else replace(self, fused_qkvz=fused)

    @classmethod
    def parse(cls, meta: dict[str, Any], arch: str, v_heads_tiled: bool, fused_ba: bool) -> Self:
        """Build the config from GGUF metadata (the one place that reads it)."""

        def key(k: str) -> str:
            return k.format(arch=arch)

        n_block = meta_int(meta, key(Keys.LLM.BLOCK_COUNT))
        n_nextn = meta_int(meta, key(Keys.LLM.NEXTN_PREDICT_LAYERS), 0)
        n_layer = n_block - n_nextn
        if n_layer <= 0:
            raise GGUFError(f"has {n_block} blocks of which {n_nextn} are MTP blocks: no main pass to run")
        flags = meta.get(key(RECURRENT_LAYERS_KEY))
        if flags is not None:
            if not isinstance(flags, list) or len(flags) != n_block:
                raise GGUFError(f"metadata {key(RECURRENT_LAYERS_KEY)} = {flags!r} is not one bool per block")
            recurrent = tuple(bool(f) for f in flags[:n_layer])
        else:
            interval = meta_int(meta, key(Keys.LLM.FULL_ATTENTION_INTERVAL), 4)
            recurrent = tuple((i + 1) % interval != 0 for i in range(n_layer))

        n_embd = meta_int(meta, key(Keys.LLM.EMBEDDING_LENGTH))
        n_head = meta_int(meta, key(Keys.Attention.HEAD_COUNT))
        head_dim = meta_int(meta, key(Keys.Attention.KEY_LENGTH), n_embd // n_head)
        if meta_int(meta, key(Keys.Attention.VALUE_LENGTH), head_dim) != head_dim:
            raise GGUFError(f"{arch}: attention key_length and value_length differ; not supported")
        n_rot = meta_int(meta, key(Keys.Rope.DIMENSION_COUNT), head_dim)
        if n_rot % 2 or not 0 < n_rot <= head_dim:
            raise GGUFError(f"{arch}: rope.dimension_count {n_rot} is not an even number <= {head_dim}")
        sections = meta.get(key(Keys.Rope.DIMENSION_SECTIONS))
        if sections is not None:
            check_text_rope_sections([int(s) for s in sections], n_rot)
        rope_sections = tuple(int(s) for s in sections) if sections is not None else ()

        n_k = meta_int(meta, key(Keys.SSM.GROUP_COUNT))
        n_v = meta_int(meta, key(Keys.SSM.TIME_STEP_RANK))
        d_state = meta_int(meta, key(Keys.SSM.STATE_SIZE))
        d_inner = meta_int(meta, key(Keys.SSM.INNER_SIZE))
        if n_k <= 0 or n_v % n_k:
            raise GGUFError(
                f"{arch}: {n_v} linear-attention value heads are not a multiple of {n_k} key heads"
            )
        if d_inner != n_v * d_state:
            raise GGUFError(
                f"{arch}: ssm.inner_size {d_inner} != {n_v} value heads x state size {d_state}; "
                "value and key head widths must be equal"
            )
        moe = MoEConfig(
            n_embd=n_embd,
            n_expert=meta_int(meta, key(Keys.LLM.EXPERT_COUNT)),
            n_expert_used=meta_int(meta, key(Keys.LLM.EXPERT_USED_COUNT)),
            n_ff_shared=meta_int(meta, key(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH), 0),
            renormalize=True,
            shared_gate=True,
        )
        return cls(
            arch=arch,
            n_vocab=n_vocab_of(meta, arch),
            n_embd=n_embd,
            n_layer=n_layer,
            n_nextn=n_nextn,
            eps=meta_float(meta, key(Keys.Attention.LAYERNORM_RMS_EPS)),
            recurrent=recurrent,
            n_head=n_head,
            n_head_kv=meta_int(meta, key(Keys.Attention.HEAD_COUNT_KV), n_head),
            head_dim=head_dim,
            n_rot=n_rot,
            rope_base=meta_float(meta, key(Keys.Rope.FREQ_BASE), 10000.0),
            conv_kernel=meta_int(meta, key(Keys.SSM.CONV_KERNEL)),
            n_k_heads=n_k,
            n_v_heads=n_v,
            d_state=d_state,
            v_heads_tiled=v_heads_tiled,
            fused_ba=fused_ba,
            moe=moe,
            rope_sections=rope_sections,
        )


# ---------------------------------------------------------------------------------------------------
# Model


class HybridModel(DecoderModel):
    """token_embd -> blocks (Gated DeltaNet or gated full attention, each then the MoE) -> output."""

    def __init__(self, cfg: HybridConfig, experts: ExpertBackend) -> None:
        super().__init__(cfg.n_vocab, cfg.n_embd, cfg.eps)
        self.cfg = cfg
        self.blk.extend(Block(cfg, i, experts) for i in range(cfg.n_layer))


class Block(nn.Module):
    """x + mixer(attn_norm(x)), then h + moe(post_attention_norm(h)); the mixer is linear or full attention."""

    def __init__(self, cfg: HybridConfig, layer: int, experts: ExpertBackend) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.eps)
        self.mixer: GatedDeltaNet | GatedAttention = (
            GatedDeltaNet(cfg) if cfg.recurrent[layer] else GatedAttention(cfg)
        )
        self.post_attention_norm = RMSNorm(cfg.n_embd, cfg.eps)
        self.moe = MoE(cfg.moe, layer, experts)

    def new_state(self) -> DeltaNetState | KVCache:
        return self.mixer.new_state()

    def forward(self, x: torch.Tensor, batch: Batch, states: list[Any]) -> torch.Tensor:
        # each norm runs in the graph of the products after it, each residual in the one before it
        h = self.mixer(x, self.attn_norm, batch, states)  # x + mixer(attn_norm(x)) [N, D]
        return self.moe(h, self.post_attention_norm)  # all N tokens of every sequence in one fan-out


class GatedAttention(nn.Module):
    """Full attention with an output gate: attn_q rows per head [q_h, gate_h]; per-head q/k RMSNorm;
    NeoX RoPE on the first n_rot dims; out = attn_output(softmax attention * sigmoid(gate))."""

    GGUF_TRANSPARENT: ClassVar[bool] = True  # tensors are blk.N.attn_*

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, h, hkv, dh = cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim
        self.attn_q = Linear(d, 2 * h * dh)
        self.attn_k = Linear(d, hkv * dh)
        self.attn_v = Linear(d, hkv * dh)
        self.attn_q_norm = RMSNorm(dh, cfg.eps)
        self.attn_k_norm = RMSNorm(dh, cfg.eps)
        self.attn_output = Linear(h * dh, d)
        self.sections = rope_sections_of(cfg.rope_sections, cfg.n_rot) if cfg.rope_sections else None
        # Native numerics (the loader sets it): the q/k norms, RoPE and the gate's sigmoid as llama.cpp
        # computes them, in the projections' graph. Exact numerics keep them in torch (RoPE's angles in
        # float64: the oracle against transformers).
        self.native_steps = False

    def new_state(self) -> KVCache:
        return KVCache()

    def forward(self, x: torch.Tensor, norm: RMSNorm, batch: Batch, caches: list[KVCache]) -> torch.Tensor:
        """x [N, D] -> x + attention(norm(x))."""
        c, n = self.cfg, x.shape[0]
        multi = batch.multi
        if multi is not None and self.sections is None:
            raise ValueError(f"{c.arch}: this file has no rope.dimension_sections; it does not read pictures")
        # picture rows turn by their (t, h, w) below: the graph leaves them unturned (position 0)
        flat = batch.positions if multi is None else batch.positions.index_fill(0, multi.to(x.device), 0)
        front = heads_on_ggml(self.native_steps, x, norm, [self.attn_q, self.attn_k, self.attn_v],
                              self.attn_q_norm, self.attn_k_norm, c, flat, gated=True)  # fmt: skip
        if front is not None:
            q, k, vx, gate = front
        else:
            qg, kx, vx = project(x, self.attn_q, self.attn_k, self.attn_v, norm=norm)
            qg = qg.view(n, c.n_head, 2, c.head_dim)
            q = self.attn_q_norm(qg[:, :, 0])  # [N, H, Dh]
            gate = dense.unary("sigmoid", qg[:, :, 1].reshape(n, c.n_head * c.head_dim))  # [N, H*Dh]
            k = self.attn_k_norm(kx.view(n, c.n_head_kv, c.head_dim))  # [N, Hkv, Dh]
            q = rope(q, flat, c.n_rot, c.rope_base)
            k = rope(k, flat, c.n_rot, c.rope_base)
        if multi is not None and self.sections is not None:
            assert batch.multi_positions is not None
            idx = multi.to(q.device)
            pos = batch.multi_positions
            q = q.index_copy(0, idx, rope_multi(q[idx], pos, c.n_rot, c.rope_base, self.sections))
            k = k.index_copy(0, idx, rope_multi(k[idx], pos, c.n_rot, c.rope_base, self.sections))
        v = vx.view(n, c.n_head_kv, c.head_dim)  # [N, Hkv, Dh]
        o = attend(q, k, v, batch, caches).reshape(n, c.n_head * c.head_dim)  # [N, H*Dh]
        return project(o, self.attn_output, gate=gate, residual=x)[0]


# ---------------------------------------------------------------------------------------------------
# Helpers


def check_text_rope_sections(sections: Sequence[int], n_rot: int) -> None:
    """Refuse a multi-section RoPE that is not plain NeoX RoPE for text.

    qwen35moe uses interleaved multi-section RoPE (llama.cpp IMROPE): rotary pair i falls in sector
    i % sum(sections); sectors cycle t, h, w while each section lasts, anything else takes the 4th
    ("e") position component. For text the t, h and w positions are all the token's position, so the
    rotation is NeoX on n_rot dims exactly when no pair lands in the 4th component.
    """
    if len(sections) < 3:
        raise GGUFError(f"rope.dimension_sections {list(sections)} has fewer than 3 sections")
    total = sum(sections)
    if total <= 0:
        raise GGUFError(f"rope.dimension_sections {list(sections)} are empty")
    for pair in range(n_rot // 2):
        sector = pair % total
        if not any(sector % 3 == s and sector < 3 * sections[s] for s in range(3)):
            raise GGUFError(
                f"rope.dimension_sections {list(sections)}: rotary pair {pair} of {n_rot // 2} falls outside "
                "the t/h/w sections, so text positions would not be plain NeoX RoPE; this model is not supported"
            )
