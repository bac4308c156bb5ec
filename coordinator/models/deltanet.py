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
  `ssm_in` (per key head [q, k, v, z]) instead of `attn_qkv` + `attn_gate`; metadata does not say
  which, so the loader refines the config from the tensor names (`HybridConfig.for_tensors`).
Module names follow the GGUF tensors (blk.N.ssm_a, blk.N.ssm_dt.bias, ...), so a file loads by name.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Self

import torch
import torch.nn.functional as F
from gguf import Keys
from torch import nn

from swarm.compute import deltanet, dense
from swarm.coordinator.experts import ExpertBackend
from swarm.coordinator.models.layers import (
    Batch,
    DecoderModel,
    KVCache,
    Linear,
    MoE,
    MoEConfig,
    RMSNorm,
    attend,
    ggml_form,
    heads_on_ggml,
    meta_float,
    meta_int,
    n_vocab_of,
    project,
    rope,
)
from swarm.sharding.gguf_io import GGUFError

logger = logging.getLogger(__name__)

# Not (yet) a gguf.Keys constant: a bool per block, true for linear-attention blocks.
RECURRENT_LAYERS_KEY = "{arch}.attention.recurrent_layers"
# The L2 normalisation of q and k in linear attention (HF: 1e-6 fixed; llama.cpp: the rms eps).
L2_EPS = 1e-6
# Chunk length of the prefill form; llama.cpp and transformers use 64 too.
CHUNK = 64
# Prefills up to this many tokens run ggml's (sequential) delta-rule op; longer ones the chunked form,
# whose matmuls beat a token-by-token loop there.
RECURRENT_MAX = 256


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
        )


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
        # Native numerics (the loader sets it): the q/k norms, RoPE and the gate's sigmoid as llama.cpp
        # computes them, in the projections' graph. Exact numerics keep them in torch (RoPE's angles in
        # float64: the oracle against transformers).
        self.native_steps = False

    def new_state(self) -> KVCache:
        return KVCache()

    def forward(self, x: torch.Tensor, norm: RMSNorm, batch: Batch, caches: list[KVCache]) -> torch.Tensor:
        """x [N, D] -> x + attention(norm(x))."""
        c, n = self.cfg, x.shape[0]
        front = heads_on_ggml(self.native_steps, x, norm, [self.attn_q, self.attn_k, self.attn_v],
                              self.attn_q_norm, self.attn_k_norm, c, batch.positions, gated=True)  # fmt: skip
        if front is not None:
            q, k, vx, gate = front
        else:
            qg, kx, vx = project(x, self.attn_q, self.attn_k, self.attn_v, norm=norm)
            qg = qg.view(n, c.n_head, 2, c.head_dim)
            q = self.attn_q_norm(qg[:, :, 0])  # [N, H, Dh]
            gate = dense.unary("sigmoid", qg[:, :, 1].reshape(n, c.n_head * c.head_dim))  # [N, H*Dh]
            k = self.attn_k_norm(kx.view(n, c.n_head_kv, c.head_dim))  # [N, Hkv, Dh]
            q = rope(q, batch.positions, c.n_rot, c.rope_base)
            k = rope(k, batch.positions, c.n_rot, c.rope_base)
        v = vx.view(n, c.n_head_kv, c.head_dim)  # [N, Hkv, Dh]
        o = attend(q, k, v, batch, caches).reshape(n, c.n_head * c.head_dim)  # [N, H*Dh]
        return project(o, self.attn_output, gate=gate, residual=x)[0]


@dataclass
class DeltaNetState:
    """One sequence's memory in one linear-attention layer; None before its first token."""

    conv: torch.Tensor | None = None  # [C, Kc-1] the last Kc-1 inputs of the conv
    # [Hv, Dv, Dk] the recurrent state S per value head, in ggml's layout: ssm[h, j, i] = S_h[i, j]
    ssm: torch.Tensor | None = None
    # (conv, ssm) as they stood at the mark of the last call that had one (Batch.marks): a checkpoint
    marked: tuple[torch.Tensor, torch.Tensor] | None = None

    def checkpoint(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return _clone(self.conv), _clone(self.ssm)

    def take_marked(self, position: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The checkpoint at the last call's mark (`position`: where it is in the sequence; the layer kept
        the state there)."""
        assert self.marked is not None, "no mark in the last call"
        cp, self.marked = self.marked, None
        return cp

    def restore(self, cp: tuple[torch.Tensor | None, torch.Tensor | None]) -> None:
        self.conv, self.ssm = _clone(cp[0]), _clone(cp[1])


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet: causal depthwise conv over [q; k; v] -> SiLU -> L2-normed q, k -> delta rule
    with per-head decay exp(g) and rate beta -> RMSNorm(o; ssm_norm) * silu(z) -> ssm_out.

    On ggml the whole layer is one graph (`_whole`: projections, conv, SiLU, L2 norms, the delta rule with
    each head's state updated in cache, the gated norm, ssm_out, the residual), whatever the mix of
    sequence lengths in the call; files with fused ssm_in / ssm_ba matrices (qwen3next) go op by op: the
    projections' graph, the rule's graph (the sequences of a call that bring one token step together),
    ssm_out's graph. A long prefill (more than RECURRENT_MAX tokens) runs the chunked form in torch.
    """

    GGUF_TRANSPARENT: ClassVar[bool] = True  # tensors are blk.N.attn_qkv, blk.N.ssm_*

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, hk, hv, ds = cfg.n_embd, cfg.n_k_heads, cfg.n_v_heads, cfg.d_state
        if cfg.fused_qkvz:
            self.ssm_in = Linear(d, 2 * hk * ds + 2 * hv * ds)
        else:
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

    def new_state(self) -> DeltaNetState:
        return DeltaNetState()

    def _inputs(self) -> tuple[list[Linear], list[dense.Post | None]]:
        """Every projection of x, and each output's activation where the output is whole: silu(z),
        beta = sigmoid(b), g = softplus(a + dt_bias) * ssm_a."""
        c = self.cfg
        qkvz = [self.ssm_in] if c.fused_qkvz else [self.attn_qkv, self.attn_gate]
        ba = [self.ssm_ba] if c.fused_ba else [self.ssm_beta, self.ssm_alpha]
        post: list[dense.Post | None] = [None] if c.fused_qkvz else [None, ("silu",)]
        post += (
            [None]
            if c.fused_ba
            else [("sigmoid",), (("add", self.ssm_dt.bias), "softplus", ("mul", self.ssm_a))]
        )
        return qkvz + ba, post  # type: ignore[operator]

    def project(
        self, x: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """norm(x) for x [N, D] -> conv input [N, C] = [all q; all k; all v], silu(z) [N, Hv*Dv], beta and g (log decay)
        [N, Hv] (value-head order)."""
        c, n = self.cfg, x.shape[0]
        hk, hv, ds = c.n_k_heads, c.n_v_heads, c.d_state
        r = hv // hk
        linears, post = self._inputs()
        outs = project(x, *linears, post=post, norm=norm)
        if c.fused_qkvz:
            # HF's in_proj_qkvz, interleaved per key head as [q (Dk), k (Dk), v (r*Dv), z (r*Dv)].
            per = outs[0].view(n, hk, 2 * ds + 2 * r * ds)
            q, k, v, z = per.split([ds, ds, r * ds, r * ds], dim=-1)
            mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
            z = dense.unary("silu", z.reshape(n, hv * ds))
        else:
            mixed, z = outs[0], outs[1]
        if c.fused_ba:
            ba_out = outs[-1].view(n, hk, 2, r)  # per key head [b (r), a (r)]
            b, a = ba_out[:, :, 0].reshape(n, hv), ba_out[:, :, 1].reshape(n, hv)
            beta = dense.unary("sigmoid", b)
            g = dense.unary("softplus", a + self.ssm_dt.bias) * self.ssm_a
        else:
            beta, g = outs[-2], outs[-1]
        return mixed, z, beta, g

    def forward(
        self, x: torch.Tensor, norm: RMSNorm, batch: Batch, states: list[DeltaNetState]
    ) -> torch.Tensor:
        """x [N, D] -> x + delta_net(norm(x))."""
        c, n = self.cfg, x.shape[0]
        hv, ds = c.n_v_heads, c.d_state
        for st in states:
            if st.conv is None or st.ssm is None:
                st.conv = x.new_zeros(c.conv_dim, c.conv_kernel - 1)
                st.ssm = x.new_zeros(hv, ds, ds)
        whole = self._whole(x, norm, batch, states)
        if whole is not None:
            return whole
        marks = batch.marks or (0,) * len(states)
        mixed, z, beta, g = self.project(x, norm)  # z activated; g: log of the per-step decay [N, Hv]
        parts = list(zip(batch.split(mixed), batch.split(g), batch.split(beta), states, strict=True))
        outs: list[torch.Tensor | None] = [None] * len(parts)
        # Sequences bringing one token (decode) step together, each longer one on its own; a token's values
        # come out the same either way (deltanet.delta_net_step), so a sequence's bits do not depend on the
        # others in the call nor on how its tokens were split into calls.
        ones = [i for i, p in enumerate(parts) if p[0].shape[0] == 1]
        if ones:
            # one sequence: views of its rows (no copy); several: their rows stacked
            cols = [
                parts[ones[0]][j][None] if len(ones) == 1 else torch.stack([parts[i][j] for i in ones])
                for j in range(3)
            ]
            o = self._steps(*cols, [states[i] for i in ones])
            for j, i in enumerate(ones):
                outs[i] = o[j]
        for i, (m, gi, bi, st) in enumerate(parts):
            if outs[i] is not None:
                continue
            # a mark: its tokens read in two calls, the state kept between them (the same bits, as in one)
            cuts = [0, marks[i], m.shape[0]] if 0 < marks[i] < m.shape[0] else [0, m.shape[0]]
            pieces = []
            for a, b in itertools.pairwise(cuts):
                if a:
                    assert st.conv is not None and st.ssm is not None
                    st.marked = (st.conv.clone(), st.ssm.clone())
                pieces.append(
                    self._chunked(m[a:b], gi[a:b], bi[a:b], st)
                    if b - a > RECURRENT_MAX
                    else self._steps(m[None, a:b], gi[None, a:b], bi[None, a:b], [st])[0]
                )
            outs[i] = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        o = torch.cat(outs).view(n, hv * ds)  # type: ignore[arg-type]
        # ssm_out(ssm_norm(o) * z) per value head, and the residual, in one graph
        return project(o, self.ssm_out, norm=self.ssm_norm, gate=z, residual=x)[0]

    def _rule(self) -> deltanet.DeltaRule:
        c = self.cfg
        return deltanet.DeltaRule(self.ssm_conv1d.weight, c.n_k_heads, not c.v_heads_tiled, L2_EPS)

    def _whole(
        self, x: torch.Tensor, norm: RMSNorm, batch: Batch, states: list[DeltaNetState]
    ) -> torch.Tensor | None:
        """The layer as one ggml graph (deltanet.delta_net_layer: the ops of the path below, so the same
        bits) when every matrix is on ggml, the file has separate q/k/v/z and beta/alpha matrices, and no
        sequence is long enough for the chunked form; else None."""
        c = self.cfg
        if c.fused_qkvz or c.fused_ba or max(batch.lengths) > RECURRENT_MAX:
            return None
        linears, post = self._inputs()
        inputs = ggml_form(linears, post)
        out = ggml_form([self.ssm_out], [None])
        if inputs is None or out is None:
            return None
        y, convs, ssms, marked = deltanet.delta_net_layer(
            x,
            batch.lengths,
            *inputs,
            norm.on_ggml(),
            [st.conv for st in states],  # type: ignore[misc]
            [st.ssm for st in states],  # type: ignore[misc]
            self._rule(),
            self.ssm_norm.on_ggml(),
            out[0][0],
            batch.marks,
        )
        for st, conv, ssm, cp in zip(states, convs, ssms, marked, strict=True):
            st.conv, st.ssm = conv, ssm
            if cp is not None:
                st.marked = cp
        return y

    def _steps(
        self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, states: list[DeltaNetState]
    ) -> list[torch.Tensor]:
        """T new tokens of each of B sequences: mixed [B, T, C], g, beta [B, T, Hv] -> o: B x [T, Hv, Dv]
        (conv, SiLU, L2 norms and the delta rule in one ggml graph); the states advanced (each new state is
        that sequence's own tensor, never a copy of a batch's)."""
        convs = [st.conv for st in states if st.conv is not None]
        ssms = [st.ssm for st in states if st.ssm is not None]
        o, convs, ssms = deltanet.delta_net_step(mixed, convs, g, beta, ssms, self._rule())
        for st, conv, ssm in zip(states, convs, ssms, strict=True):
            st.conv, st.ssm = conv, ssm
        return o

    def _chunked(
        self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, st: DeltaNetState
    ) -> torch.Tensor:
        """A long prefill of one sequence (over RECURRENT_MAX tokens): mixed [T, C], g, beta [T, Hv] ->
        o [T, Hv, Dv] by the chunked form in torch; st advanced."""
        assert st.conv is not None and st.ssm is not None
        conv, st.conv = causal_conv(mixed, st.conv, self.ssm_conv1d.weight)
        q, k, v = self._qkv(dense.unary("silu", conv))  # [T, Hv, D], q unscaled
        scale = 1.0 / math.sqrt(self.cfg.d_state)
        o, s = gated_delta_chunked(
            (q * scale).transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            g.transpose(0, 1),
            beta.transpose(0, 1),
            st.ssm.transpose(-1, -2),
        )
        st.ssm = s.transpose(-1, -2).contiguous()
        return o.transpose(0, 1)

    def _qkv(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Activated conv output [..., T, C] -> q, k (L2-normed; q not yet scaled by 1/sqrt(D)), v, each
        [..., T, Hv, D] (key heads repeated to the value head each one serves)."""
        c = self.cfg
        hk, hv, ds = c.n_k_heads, c.n_v_heads, c.d_state
        lead = conv.shape[:-1]
        q = l2_norm(conv[..., : hk * ds].reshape(*lead, hk, ds))
        k = l2_norm(conv[..., hk * ds : 2 * hk * ds].reshape(*lead, hk, ds))
        v = conv[..., 2 * hk * ds :].reshape(*lead, hv, ds)
        return self._expand_k_heads(q), self._expand_k_heads(k), v

    def _expand_k_heads(self, t: torch.Tensor) -> torch.Tensor:
        """[..., Hk, Dk] -> [..., Hv, Dk]: the key head each value head reads."""
        r = self.cfg.n_v_heads // self.cfg.n_k_heads
        if r == 1:
            return t
        if self.cfg.v_heads_tiled:
            return t.repeat(*([1] * (t.dim() - 2)), r, 1)  # value head h <- key head h % Hk
        return t.repeat_interleave(r, dim=-2)  # value head h <- key head h // r


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
    """The gated delta rule one step at a time: the definition, which tests hold ggml's op and the chunked
    form to (the model runs ggml's op, deltanet.delta_net_step).

    q, k [..., T, Dk] (q already scaled), v [..., T, Dv], g, beta [..., T], state S [..., Dk, Dv].
    Per step: S <- S * exp(g_t); delta = (v_t - S^T k_t) * beta_t; S <- S + k_t delta^T; o_t = S^T q_t.
    Returns (o [..., T, Dv], final S).
    """
    decay = dense.unary("exp", g)[..., None, None]  # [..., T, 1, 1]; ggml's: the same for B rows or one
    s = state * decay[..., 0, :, :]  # a private copy: later steps update it in place
    outs = []
    for t in range(q.shape[-2]):
        if t:
            s.mul_(decay[..., t, :, :])
        kt = k[..., t, :]
        delta = (v[..., t, :] - (kt.unsqueeze(-2) @ s).squeeze(-2)) * beta[..., t, None]
        s.addcmul_(kt.unsqueeze(-1), delta.unsqueeze(-2))
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
