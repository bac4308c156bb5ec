"""What qwen35moe and qwen3next share: Gated DeltaNet layers, gated full attention, the hybrid model.

Dimension letters: N tokens of all sequences in a call, T tokens of one sequence, D model width,
V vocabulary, C = 2*Hk*Dk + Hv*Dv conv channels, Hk / Hv linear-attention key / value heads,
Dk = Dv their head width, H / Hkv full-attention query / key-value heads, Dh their head width,
Kc conv kernel, L chunk length.

The two archs differ only in how a file lays out the linear attention (see `HybridConfig`):
- value head h uses key head h % Hk (qwen35moe: the converter re-tiles value heads) or h // (Hv/Hk)
  (qwen3next: value heads stay grouped by key head);
- beta and alpha come from two matrices (`ssm_beta`, `ssm_alpha`; qwen35moe) or one `ssm_ba` laid
  out per key head as [b (Hv/Hk), a (Hv/Hk)] (qwen3next); old qwen3next files carry the raw fused
  `ssm_in` (per key head [q, k, v, z]) instead of `attn_qkv` + `attn_gate`, split at load time.
Module names follow the GGUF tensors (blk.N.ssm_a, blk.N.ssm_dt.bias, ...), so a file loads by name.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from gguf import Keys
from torch import nn

from swarm.coordinator.experts import ExpertBackend
from swarm.coordinator.models.layers import Linear, MoE, MoEConfig, RMSNorm

logger = logging.getLogger(__name__)

# Not (yet) a gguf.Keys constant: a bool per block, true for linear-attention blocks.
RECURRENT_LAYERS_KEY = "{arch}.attention.recurrent_layers"
# The L2 normalisation of q and k in linear attention (HF: 1e-6 fixed; llama.cpp: the rms eps).
L2_EPS = 1e-6
# Chunk length of the prefill form; llama.cpp and transformers use 64 too.
CHUNK = 64


class ConfigError(ValueError):
    """The GGUF's metadata describes a model this code cannot run; the message says why."""


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

    @property
    def conv_dim(self) -> int:
        return 2 * self.n_k_heads * self.d_state + self.n_v_heads * self.d_state

    @classmethod
    def parse(cls, meta: dict[str, Any], arch: str, v_heads_tiled: bool, fused_ba: bool) -> HybridConfig:
        """Build the config from GGUF metadata (the one place that reads it)."""

        def get(key: str, default: Any = None) -> Any:
            name = key.format(arch=arch)
            value = meta.get(name, default)
            if value is None:
                raise ConfigError(f"GGUF metadata lacks {name}, which a {arch} model needs")
            return value

        n_block = int(get(Keys.LLM.BLOCK_COUNT))
        n_nextn = int(get(Keys.LLM.NEXTN_PREDICT_LAYERS, 0))
        n_layer = n_block - n_nextn
        recurrent_flags = meta.get(RECURRENT_LAYERS_KEY.format(arch=arch))
        if recurrent_flags is not None:
            if len(recurrent_flags) != n_block:
                raise ConfigError(
                    f"{RECURRENT_LAYERS_KEY.format(arch=arch)} has {len(recurrent_flags)} entries "
                    f"for {n_block} blocks"
                )
            recurrent = tuple(bool(b) for b in recurrent_flags[:n_layer])
        else:
            interval = int(get(Keys.LLM.FULL_ATTENTION_INTERVAL, 4))
            recurrent = tuple((i + 1) % interval != 0 for i in range(n_layer))

        n_embd = int(get(Keys.LLM.EMBEDDING_LENGTH))
        n_head = int(get(Keys.Attention.HEAD_COUNT))
        head_dim = int(get(Keys.Attention.KEY_LENGTH, n_embd // n_head))
        if int(get(Keys.Attention.VALUE_LENGTH, head_dim)) != head_dim:
            raise ConfigError(f"{arch}: attention key_length and value_length differ; not supported")
        n_rot = int(get(Keys.Rope.DIMENSION_COUNT, head_dim))
        if n_rot % 2 or n_rot > head_dim:
            raise ConfigError(f"{arch}: rope.dimension_count {n_rot} is not an even number <= {head_dim}")
        sections = meta.get(Keys.Rope.DIMENSION_SECTIONS.format(arch=arch))
        if sections is not None:
            check_text_rope_sections([int(s) for s in sections], n_rot)

        n_k = int(get(Keys.SSM.GROUP_COUNT))
        n_v = int(get(Keys.SSM.TIME_STEP_RANK))
        d_state = int(get(Keys.SSM.STATE_SIZE))
        d_inner = int(get(Keys.SSM.INNER_SIZE))
        if n_v % n_k:
            raise ConfigError(
                f"{arch}: {n_v} linear-attention value heads are not a multiple of {n_k} key heads"
            )
        if d_inner != n_v * d_state:
            raise ConfigError(
                f"{arch}: ssm.inner_size {d_inner} != {n_v} value heads x state size {d_state}; "
                "value and key head widths must be equal"
            )

        if Keys.LLM.VOCAB_SIZE.format(arch=arch) in meta:
            n_vocab = int(meta[Keys.LLM.VOCAB_SIZE.format(arch=arch)])
        else:
            n_vocab = len(get(Keys.Tokenizer.LIST))

        n_expert = int(get(Keys.LLM.EXPERT_COUNT))
        moe = MoEConfig(
            n_embd=n_embd,
            n_expert=n_expert,
            n_expert_used=int(get(Keys.LLM.EXPERT_USED_COUNT)),
            n_ff_shared=int(get(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0)),
            renormalize=True,
            shared_gate=True,
        )
        return cls(
            arch=arch,
            n_vocab=n_vocab,
            n_embd=n_embd,
            n_layer=n_layer,
            n_nextn=n_nextn,
            eps=float(get(Keys.Attention.LAYERNORM_RMS_EPS)),
            recurrent=recurrent,
            n_head=n_head,
            n_head_kv=int(get(Keys.Attention.HEAD_COUNT_KV, n_head)),
            head_dim=head_dim,
            n_rot=n_rot,
            rope_base=float(get(Keys.Rope.FREQ_BASE, 10000.0)),
            conv_kernel=int(get(Keys.SSM.CONV_KERNEL)),
            n_k_heads=n_k,
            n_v_heads=n_v,
            d_state=d_state,
            v_heads_tiled=v_heads_tiled,
            fused_ba=fused_ba,
            moe=moe,
        )


def check_text_rope_sections(sections: Sequence[int], n_rot: int) -> None:
    """Refuse a multi-section RoPE that is not plain NeoX RoPE for text.

    qwen35moe uses interleaved multi-section RoPE (llama.cpp IMROPE): rotary pair i falls in sector
    i % sum(sections); sectors cycle t, h, w while each section lasts, anything else takes the 4th
    ("e") position component. For text the t, h and w positions are all the token's position, so the
    rotation is NeoX on n_rot dims exactly when no pair lands in the 4th component.
    """
    if len(sections) < 3:
        raise ConfigError(f"rope.dimension_sections {list(sections)} has fewer than 3 sections")
    total = sum(sections)
    if total <= 0:
        raise ConfigError(f"rope.dimension_sections {list(sections)} are empty")
    for pair in range(n_rot // 2):
        sector = pair % total
        if not any(sector % 3 == s and sector < 3 * sections[s] for s in range(3)):
            raise ConfigError(
                f"rope.dimension_sections {list(sections)}: rotary pair {pair} of {n_rot // 2} falls outside "
                "the t/h/w sections, so text positions would not be plain NeoX RoPE; this model is not supported"
            )


# ---------------------------------------------------------------------------------------------------
# Per-sequence state


@dataclass
class HybridState:
    """One sequence's memory: position, per linear-attention layer the conv inputs and the recurrent
    state, per full-attention layer the keys and values. Entries are None until the first token."""

    pos: int = 0
    conv: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [C, Kc-1]
    ssm: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [Hv, Dk, Dv]
    keys: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [Hkv, P, Dh]
    values: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [Hkv, P, Dh]


# ---------------------------------------------------------------------------------------------------
# Model


class Embedding(nn.Module):
    def __init__(self, n_vocab: int, n_embd: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_vocab, n_embd), requires_grad=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)


class HybridModel(nn.Module):
    """Embedding -> blocks (Gated DeltaNet or gated full attention, each followed by the MoE) -> head."""

    def __init__(self, cfg: HybridConfig, experts: ExpertBackend) -> None:
        super().__init__()
        self.cfg = cfg
        self.token_embd = Embedding(cfg.n_vocab, cfg.n_embd)
        self.blk = nn.ModuleList(
            [
                DeltaNetBlock(cfg, i, experts) if cfg.recurrent[i] else AttentionBlock(cfg, i, experts)
                for i in range(cfg.n_layer)
            ]
        )
        self.output_norm = RMSNorm(cfg.n_embd, cfg.eps)
        self.output = Linear(cfg.n_embd, cfg.n_vocab)

    def new_state(self) -> HybridState:
        return HybridState()

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, states: Sequence[HybridState], lengths: Sequence[int]
    ) -> torch.Tensor:
        """tokens [N] (sequences concatenated, lengths[i] tokens of states[i]) -> logits [N, V].

        Attention and recurrence run per sequence; every MoE layer sees all N tokens at once.
        """
        if len(states) != len(lengths) or sum(lengths) != tokens.numel():
            raise ValueError(f"{tokens.numel()} tokens do not split into lengths {list(lengths)}")
        x = self.token_embd(tokens)  # [N, D]
        for block in self.blk:
            x = block(x, states, lengths)
        for state, n in zip(states, lengths, strict=True):
            state.pos += n
        return self.output(self.output_norm(x))


class _Block(nn.Module):
    """x + mixer(attn_norm(x)), then h + moe(post_attention_norm(h))."""

    def __init__(self, cfg: HybridConfig, layer: int, experts: ExpertBackend) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer = layer
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.eps)
        self.post_attention_norm = RMSNorm(cfg.n_embd, cfg.eps)
        self.moe = MoE(cfg.moe, layer, experts)

    def mix(self, x: torch.Tensor, states: Sequence[HybridState], lengths: Sequence[int]) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, states: Sequence[HybridState], lengths: Sequence[int]) -> torch.Tensor:
        h = x + self.mix(self.attn_norm(x), states, lengths)
        return h + self.moe(self.post_attention_norm(h))


class AttentionBlock(_Block):
    """Gated full attention: attn_q rows per head [q_h, gate_h]; per-head q/k RMSNorm; partial NeoX
    RoPE; out = attn_output(softmax attention * sigmoid(gate))."""

    def __init__(self, cfg: HybridConfig, layer: int, experts: ExpertBackend) -> None:
        super().__init__(cfg, layer, experts)
        d, h, hkv, dh = cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim
        self.attn_q = Linear(d, 2 * h * dh)
        self.attn_k = Linear(d, hkv * dh)
        self.attn_v = Linear(d, hkv * dh)
        self.attn_q_norm = RMSNorm(dh, cfg.eps)
        self.attn_k_norm = RMSNorm(dh, cfg.eps)
        self.attn_output = Linear(h * dh, d)

    def mix(self, x: torch.Tensor, states: Sequence[HybridState], lengths: Sequence[int]) -> torch.Tensor:
        cfg = self.cfg
        n = x.shape[0]
        qg = self.attn_q(x).view(n, cfg.n_head, 2, cfg.head_dim)
        q = self.attn_q_norm(qg[:, :, 0])  # [N, H, Dh]
        gate = qg[:, :, 1].reshape(n, cfg.n_head * cfg.head_dim)  # [N, H*Dh]
        k = self.attn_k_norm(self.attn_k(x).view(n, cfg.n_head_kv, cfg.head_dim))  # [N, Hkv, Dh]
        v = self.attn_v(x).view(n, cfg.n_head_kv, cfg.head_dim)  # [N, Hkv, Dh]

        outs = []
        start = 0
        for state, t in zip(states, lengths, strict=True):
            sl = slice(start, start + t)
            start += t
            pos = torch.arange(state.pos, state.pos + t, device=x.device)
            cos, sin = rope_cos_sin(pos, cfg.n_rot, cfg.rope_base, x.dtype)
            qs = apply_rope(q[sl], cos, sin).transpose(0, 1)  # [H, T, Dh]
            ks = apply_rope(k[sl], cos, sin).transpose(0, 1)  # [Hkv, T, Dh]
            vs = v[sl].transpose(0, 1)
            if self.layer in state.keys:
                ks = torch.cat([state.keys[self.layer], ks], dim=1)
                vs = torch.cat([state.values[self.layer], vs], dim=1)
            state.keys[self.layer], state.values[self.layer] = ks, vs
            outs.append(causal_attention(qs, ks, vs, state.pos).transpose(0, 1).reshape(t, -1))
        attn = torch.cat(outs, dim=0)  # [N, H*Dh]
        return self.attn_output(attn * torch.sigmoid(gate))


class DeltaNetBlock(_Block):
    """Gated DeltaNet: causal depthwise conv over [q; k; v] -> SiLU -> L2-normed q, k -> delta rule
    with per-head decay exp(g) and rate beta -> RMSNorm(o; ssm_norm) * silu(z) -> ssm_out."""

    def __init__(self, cfg: HybridConfig, layer: int, experts: ExpertBackend) -> None:
        super().__init__(cfg, layer, experts)
        d, hv, ds = cfg.n_embd, cfg.n_v_heads, cfg.d_state
        self.attn_qkv = Linear(d, cfg.conv_dim)
        self.attn_gate = Linear(d, hv * ds)  # z
        if cfg.fused_ba:
            self.ssm_ba = Linear(d, 2 * hv)
        else:
            self.ssm_beta = Linear(d, hv)
            self.ssm_alpha = Linear(d, hv)
        self.ssm_conv1d = _Weight(cfg.conv_dim, cfg.conv_kernel)  # [C, Kc]
        self.ssm_dt = _Bias(hv)
        self.ssm_a = nn.Parameter(torch.empty(hv), requires_grad=False)  # already -exp(A_log)
        self.ssm_norm = RMSNorm(ds, cfg.eps)  # not "+1"-shifted
        self.ssm_out = Linear(hv * ds, d)

    def beta_alpha(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw b and a [N, Hv] in value-head order."""
        cfg = self.cfg
        if not cfg.fused_ba:
            return self.ssm_beta(x), self.ssm_alpha(x)
        r = cfg.n_v_heads // cfg.n_k_heads
        ba = self.ssm_ba(x).view(x.shape[0], cfg.n_k_heads, 2, r)  # per key head [b (r), a (r)]
        return ba[:, :, 0].reshape(x.shape[0], -1), ba[:, :, 1].reshape(x.shape[0], -1)

    def mix(self, x: torch.Tensor, states: Sequence[HybridState], lengths: Sequence[int]) -> torch.Tensor:
        cfg = self.cfg
        n = x.shape[0]
        hk, hv, ds = cfg.n_k_heads, cfg.n_v_heads, cfg.d_state
        mixed = self.attn_qkv(x)  # [N, C]
        z = self.attn_gate(x).view(n, hv, ds)
        b, a = self.beta_alpha(x)
        beta = torch.sigmoid(b)  # [N, Hv]
        g = F.softplus(a + self.ssm_dt.bias) * self.ssm_a  # [N, Hv], log of the per-step decay

        outs = []
        start = 0
        for state, t in zip(states, lengths, strict=True):
            sl = slice(start, start + t)
            start += t
            conv_prev = state.conv.get(self.layer)
            if conv_prev is None:
                conv_prev = x.new_zeros(cfg.conv_dim, cfg.conv_kernel - 1)
            conv_out, state.conv[self.layer] = causal_conv(mixed[sl], conv_prev, self.ssm_conv1d.weight)
            conv_out = F.silu(conv_out)  # [T, C]
            q = conv_out[:, : hk * ds].view(t, hk, ds)
            k = conv_out[:, hk * ds : 2 * hk * ds].view(t, hk, ds)
            v = conv_out[:, 2 * hk * ds :].view(t, hv, ds)
            q = l2_norm(q) * (1.0 / math.sqrt(ds))
            k = l2_norm(k)
            q, k = self.expand_k_heads(q), self.expand_k_heads(k)  # [T, Hv, Dk]
            s = state.ssm.get(self.layer)
            if s is None:
                s = x.new_zeros(hv, ds, ds)
            rule = gated_delta_recurrent if t == 1 else gated_delta_chunked
            o, state.ssm[self.layer] = rule(
                q.transpose(0, 1),
                k.transpose(0, 1),
                v.transpose(0, 1),
                g[sl].transpose(0, 1),
                beta[sl].transpose(0, 1),
                s,
            )
            outs.append(o.transpose(0, 1))  # [T, Hv, Dv]
        o = torch.cat(outs, dim=0)  # [N, Hv, Dv]
        o = self.ssm_norm(o) * F.silu(z)
        return self.ssm_out(o.reshape(n, hv * ds))

    def expand_k_heads(self, t: torch.Tensor) -> torch.Tensor:
        """[T, Hk, Dk] -> [T, Hv, Dk]: the key head each value head reads."""
        r = self.cfg.n_v_heads // self.cfg.n_k_heads
        if r == 1:
            return t
        if self.cfg.v_heads_tiled:
            return t.repeat(1, r, 1)  # value head h <- key head h % Hk
        return t.repeat_interleave(r, dim=1)  # value head h <- key head h // r

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: object, **kwargs: object) -> None:
        # Old qwen3next files carry HF's fused in_proj_qkvz as ssm_in, interleaved per key head as
        # [q (Dk), k (Dk), v (r*Dv), z (r*Dv)]; split it into attn_qkv = [all q; all k; all v] and
        # attn_gate = all z, which is the layout newer files store.
        key = prefix + "ssm_in.weight"
        if key in state_dict:
            w = state_dict.pop(key)
            cfg = self.cfg
            hk, ds, r = cfg.n_k_heads, cfg.d_state, cfg.n_v_heads // cfg.n_k_heads
            per = w.view(hk, 2 * ds + 2 * r * ds, -1)
            q, k, v, z = per.split([ds, ds, r * ds, r * ds], dim=1)
            d = w.shape[-1]
            state_dict[prefix + "attn_qkv.weight"] = torch.cat(
                [q.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, d)], dim=0
            )
            state_dict[prefix + "attn_gate.weight"] = z.reshape(-1, d).clone()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class _Weight(nn.Module):
    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape), requires_grad=False)


class _Bias(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.empty(n), requires_grad=False)


# ---------------------------------------------------------------------------------------------------
# Pure functions


def rope_cos_sin(
    pos: torch.Tensor, n_rot: int, base: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, n_rot/2] for positions pos [T]; angles in float64 so long contexts stay exact."""
    inv_freq = base ** (-torch.arange(0, n_rot, 2, dtype=torch.float64, device=pos.device) / n_rot)
    angles = pos.to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX RoPE on the first 2*cos.shape[-1] dims of x [T, heads, Dh]; the rest pass through."""
    half = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int) -> torch.Tensor:
    """q [H, T, Dh] at positions q_start.., k/v [Hkv, P, Dh] at 0..P-1 -> [H, T, Dh] (GQA, causal)."""
    h, t, dh = q.shape
    group = h // k.shape[0]
    k = k.repeat_interleave(group, dim=0)  # query head h reads kv head h // group
    v = v.repeat_interleave(group, dim=0)
    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(dh))  # [H, T, P]
    qpos = torch.arange(q_start, q_start + t, device=q.device)[:, None]
    kpos = torch.arange(k.shape[1], device=q.device)[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def l2_norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def causal_conv(
    x: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of x [T, C] after the Kc-1 past inputs prev [C, Kc-1] with weight [C, Kc].

    Returns (out [T, C], the new past inputs [C, Kc-1]). weight[:, -1] multiplies the current input.
    """
    inp = torch.cat([prev, x.transpose(0, 1)], dim=1)  # [C, Kc-1+T]
    out = F.conv1d(inp.unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0]).squeeze(0)  # [C, T]
    return out.transpose(0, 1), inp[:, inp.shape[1] - (weight.shape[1] - 1) :].clone()


def gated_delta_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one step at a time (the decode form and the definition).

    q, k [..., T, Dk] (q already scaled), v [..., T, Dv], g, beta [..., T], state S [..., Dk, Dv].
    Per step: S <- S * exp(g_t); delta = (v_t - S^T k_t) * beta_t; S <- S + k_t delta^T; o_t = S^T q_t.
    Returns (o [..., T, Dv], final S).
    """
    s = state
    outs = []
    for t in range(q.shape[-2]):
        s = s * torch.exp(g[..., t])[..., None, None]
        kt = k[..., t, :]
        delta = (v[..., t, :] - (kt.unsqueeze(-2) @ s).squeeze(-2)) * beta[..., t, None]
        s = s + kt.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append((q[..., t, :].unsqueeze(-2) @ s).squeeze(-2))
    return torch.stack(outs, dim=-2), s


def gated_delta_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule as gated_delta_recurrent, computed chunk by chunk with matrix products.

    Within a chunk, with G_t the cumulative log decay since the chunk start and S0 the state before it,
    unrolling the recurrence gives delta_t = beta_t (v_t - exp(G_t) S0^T k_t
    - sum_{j<t} exp(G_t - G_j) (k_t . k_j) delta_j), a unit lower-triangular system (I + A) delta =
    beta V - beta exp(G) K S0 solved once per chunk. Then
    o_t = exp(G_t) S0^T q_t + sum_{j<=t} exp(G_t - G_j) (q_t . k_j) delta_j and
    S_end = exp(G_L) S0 + sum_j exp(G_L - G_j) k_j delta_j^T. Every exponent is <= 0: nothing overflows.
    """
    n = q.shape[-2]
    s = state
    outs = []
    for c0 in range(0, n, chunk):
        qc, kc, vc = q[..., c0 : c0 + chunk, :], k[..., c0 : c0 + chunk, :], v[..., c0 : c0 + chunk, :]
        gc = g[..., c0 : c0 + chunk].cumsum(-1)  # G [..., L]
        bc = beta[..., c0 : c0 + chunk]
        length = qc.shape[-2]
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        decay = torch.exp(
            (gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, float("-inf"))
        )  # [.., L, L]
        strict = torch.ones(length, length, dtype=torch.bool, device=q.device).tril(-1)
        # A[t, j] = beta_t exp(G_t - G_j) (k_t . k_j) for j < t; the solver takes the unit diagonal as given.
        a = ((kc @ kc.transpose(-1, -2)) * decay * bc[..., :, None]).masked_fill(~strict, 0.0)
        u = torch.linalg.solve_triangular(a, vc * bc[..., None], upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(
            a, kc * (bc * torch.exp(gc))[..., None], upper=False, unitriangular=True
        )
        delta = u - w @ s  # [..., L, Dv]
        o = (qc * torch.exp(gc)[..., None]) @ s + ((qc @ kc.transpose(-1, -2)) * decay) @ delta
        g_last = gc[..., -1]
        s = (
            s * torch.exp(g_last)[..., None, None]
            + (kc * torch.exp(g_last[..., None] - gc)[..., None]).transpose(-1, -2) @ delta
        )
        outs.append(o)
    return torch.cat(outs, dim=-2), s
