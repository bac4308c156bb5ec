"""The Gated DeltaNet layer of the hybrid archs (models.hybrid): its per-sequence state, the layer on
ggml (one graph, or its projections, rule and output op by op), and the chunked form of a long prefill.

Dimension letters: N tokens of all sequences in a call, T tokens of one sequence, D model width,
C = 2*Hk*Dk + Hv*Dv conv channels, Hk / Hv key / value heads, Dk = Dv their head width, Kc conv kernel,
L chunk length.
"""

from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from swarm.compute import deltanet, dense
from swarm.coordinator.models.base import Batch
from swarm.coordinator.models.linear import Linear, RMSNorm, ggml_form, project


class DeltaNetShape(Protocol):
    """What a Gated DeltaNet layer reads of its architecture's config (models/hybrid.py HybridConfig has it)."""

    n_embd: int
    n_k_heads: int
    n_v_heads: int
    d_state: int
    conv_kernel: int
    eps: float
    fused_qkvz: bool  # older files: the raw fused qkvz projection
    fused_ba: bool  # qwen3next: beta and alpha fused per K head
    v_heads_tiled: bool  # qwen35moe: V head p reads K head p % n_k

    @property
    def conv_dim(self) -> int: ...

# The L2 normalisation of q and k in linear attention (HF: 1e-6 fixed; llama.cpp: the rms eps).
L2_EPS = 1e-6
# Chunk length of the prefill form; llama.cpp and transformers use 64 too.
CHUNK = 64
# Prefills up to this many tokens run ggml's (sequential) delta-rule op; longer ones the chunked form,
# whose matmuls beat a token-by-token loop there.
RECURRENT_MAX = 256


@dataclass
class DeltaNetState:
    """One sequence's memory in one linear-attention layer; None before its first token.

    A checkpoint costs no copy of the recurrent state (megabytes a layer at a real model's shape, taken
    after every pass whose answers are checked): it refers to the state where it lies, and while it does
    the next step writes its result into another buffer (`buffer`): one that an earlier checkpoint, now
    forgotten, referred to, so that two buffers take turns and no page is allocated again.
    """

    conv: torch.Tensor | None = None  # [C, Kc-1] the last Kc-1 inputs of the conv
    # [Hv, Dv, Dk] the recurrent state S per value head, in ggml's layout: ssm[h, j, i] = S_h[i, j]
    ssm: torch.Tensor | None = None
    # (conv, ssm) as they stood at each mark of the last call that had some (Batch.marks): checkpoints
    marked: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # the buffers checkpoints refer to: (the buffer's address, the whole buffer, the checkpoint's view of the
    # state in it, weakly: once the checkpoint is forgotten the buffer may be written again)
    _kept: list[tuple[int, torch.Tensor, weakref.ref[torch.Tensor]]] = field(default_factory=list, repr=False)
    _spare: torch.Tensor | None = field(default=None, repr=False)  # a buffer no one refers to

    def checkpoint(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.ssm is None:
            return _clone(self.conv), None
        view = self.ssm.view(self.ssm.shape)  # an object of its own, for the weak reference
        whole = self.ssm.as_strided((self.ssm.untyped_storage().nbytes() // 4,), (1,), 0)
        self._kept.append((_address(self.ssm), whole, weakref.ref(view)))
        return _clone(self.conv), view  # (the conv's inputs are small: copied)

    def buffer(self, n: int) -> torch.Tensor | None:
        """Where the next step's result ([outputs, then the new state], n floats) may go: the buffer the state
        lies at the end of, unless a checkpoint refers to it; else a spare one of that size; None: a new one."""
        own = _address(self.ssm) if self.ssm is not None else None
        kept = []
        for entry in self._kept:
            if entry[2]() is not None:
                kept.append(entry)
            elif entry[0] != own:
                self._spare = entry[1]  # forgotten: free to be written
        self._kept = kept
        if self.ssm is not None and all(a != own for a, _, _ in kept):
            mine = deltanet.own_buffer(self.ssm, n)
            if mine is not None:
                return mine
        if self._spare is not None and self._spare.numel() == n:
            spare, self._spare = self._spare, None
            return spare
        return None

    def take_marked(self, position: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The checkpoint at the last call's next mark, in order (`position`: where it is in the sequence;
        the layer kept the state there)."""
        assert self.marked, "no mark left from the last call"
        return self.marked.pop(0)

    def restore(self, cp: tuple[torch.Tensor | None, torch.Tensor | None]) -> None:
        self.conv, self.ssm = _clone(cp[0]), _clone(cp[1])


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


def _address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


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

    def __init__(self, cfg: DeltaNetShape) -> None:
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
        marks = batch.marks or ((),) * len(states)
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
            # marks: its tokens read as in separate calls, the state kept between them (the same bits)
            cuts = [0, *marks[i], m.shape[0]]
            pieces = []
            for a, b in itertools.pairwise(cuts):
                if a:
                    assert st.conv is not None and st.ssm is not None
                    st.marked.append((st.conv.clone(), st.ssm.clone()))
                    # a stretch as long as the one before updates the state where that one's output lies
                    # (deltanet._rule_results): keep the output before it is written over
                    pieces[-1] = pieces[-1].clone()
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
            lambda i, n: states[i].buffer(n),
        )
        for st, conv, ssm, cps in zip(states, convs, ssms, marked, strict=True):
            st.conv, st.ssm = conv, ssm
            st.marked.extend(cps)
        return y

    def _steps(
        self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, states: list[DeltaNetState]
    ) -> list[torch.Tensor]:
        """T new tokens of each of B sequences: mixed [B, T, C], g, beta [B, T, Hv] -> o: B x [T, Hv, Dv]
        (conv, SiLU, L2 norms and the delta rule in one ggml graph); the states advanced (each new state is
        that sequence's own tensor, never a copy of a batch's)."""
        convs = [st.conv for st in states if st.conv is not None]
        ssms = [st.ssm for st in states if st.ssm is not None]
        o, convs, ssms = deltanet.delta_net_step(
            mixed, convs, g, beta, ssms, self._rule(), lambda i, n: states[i].buffer(n)
        )
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
