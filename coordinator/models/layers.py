"""Building blocks shared by every architecture: RMSNorm, the routed MoE block, the shared expert.

Dimension letters: T tokens, D model width, E experts, K selected per token, F expert width, Fs shared width.
Modules are named after GGUF tensors, so a GGUF's tensors load by name. The one convention: a block
holds its MoE as the child `moe`, a path segment the loader drops (blk.N.moe.ffn_gate_inp.weight is
the GGUF's blk.N.ffn_gate_inp.weight). Only nn.Modules and pure functions: no file I/O, no network.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from swarm.coordinator.experts import ExpertBackend

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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class Linear(nn.Module):
    """A GGUF matrix {in, out}: weight [out, in], optional bias [out]."""

    def __init__(self, d_in: int, d_out: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(d_out), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass(frozen=True)
class MoEConfig:
    n_embd: int  # D
    n_expert: int  # E
    n_expert_used: int  # K
    n_ff_shared: int  # Fs, 0 when the arch has no shared expert
    renormalize: bool  # top-K weights renormalised to sum 1 (all but qwen2moe)
    shared_gate: bool  # shared expert scaled by sigmoid(x . ffn_gate_inp_shexp)


def route(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, K], ids [T, K]): softmax over all E, top-K, optional renorm.

    Ties go to the lower expert index, the same on every device: topk on probabilities is not
    guaranteed stable, so sort by (prob desc, index asc) explicitly.
    """
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    ids = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]  # [T, K]
    weights = probs.gather(-1, ids)  # [T, K]
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(RENORM_MIN)
    return weights, ids


class MoE(nn.Module):
    """Routed experts (computed by an ExpertBackend, in process or on the swarm) plus the shared expert."""

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] (post-attention-normed) -> [T, D]."""
        weights, ids = route(self.ffn_gate_inp(x), self.cfg.n_expert_used, self.cfg.renormalize)
        pending = self.experts.start(self.layer, x, ids)
        shared = self._shared(x)  # overlaps with the experts in flight
        out = pending.wait()  # [T, K, D]
        # Sum over K in slot order: the result does not depend on which holder answered first.
        routed = (out * weights.unsqueeze(-1)).sum(dim=1)
        return routed if shared is None else routed + shared

    def _shared(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.ffn_gate_shexp is None or self.ffn_up_shexp is None or self.ffn_down_shexp is None:
            return None
        y = self.ffn_down_shexp(F.silu(self.ffn_gate_shexp(x)) * self.ffn_up_shexp(x))
        if self.ffn_gate_inp_shexp is not None:
            y = y * torch.sigmoid(self.ffn_gate_inp_shexp(x))
        return y

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: object, **kwargs: object) -> None:
        # GGUF stores ffn_gate_inp_shexp as a vector {D} (or {D, 1}); the module holds it as [1, D].
        key = prefix + "ffn_gate_inp_shexp.weight"
        if key in state_dict and state_dict[key].dim() == 1:
            state_dict[key] = state_dict[key].unsqueeze(0)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
