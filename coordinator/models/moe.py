"""The routed MoE block with its shared expert: the router, top-K selection, the experts (computed by an
ExpertBackend, in process or on the swarm), the shared expert overlapping them, and the weighted sum.

Dimension letters: T tokens, D model width, E experts, K selected per token, F expert width, Fs shared width.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from swarm.compute import ffn, ggml
from swarm.coordinator.experts.backend import ExpertBackend
from swarm.coordinator.models.linear import GGMLMatrix, Linear, RMSNorm, project

# llama.cpp clamps the sum of the selected routing weights before renormalising (build_moe_ffn).
RENORM_MIN = 2.0**-14


@dataclass(frozen=True)
class MoEConfig:
    n_embd: int  # D
    n_expert: int  # E
    n_expert_used: int  # K
    n_ff_shared: int  # Fs, 0 when the arch has no shared expert
    renormalize: bool  # top-K weights renormalised to sum 1 (all but qwen2moe)
    shared_gate: bool  # shared expert scaled by sigmoid(x . ffn_gate_inp_shexp)


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
        with ggml.one_thread() if pending.in_flight else contextlib.nullcontext():
            shared = self._shared(x, gate_value)
        out = pending.wait()  # [T, K, D]
        dropped = pending.dropped  # [T, K] bool: degraded mode left these pairs out
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
        below, the same bits) when the backend hands the experts over as one stack (this process's own,
        stacked where they lie in the file) and every shared matrix is on ggml; else None."""
        if h.device.type != "cpu":
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


def route(probs: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router probabilities [T, E] (the softmax of its logits over all E) -> (weights [T, K], ids [T, K]):
    top-K, optional renorm, as llama.cpp's build_moe_ffn: the K weights summed in double one after the other
    (ggml_sum_rows; a cumulative sum keeps that order), the sum clamped, then each weight divided by it.

    Ties go to the lower expert index, the same on every device. topk is not guaranteed stable, but where
    its K+1 largest are all distinct the choice and the order are unique; rows with a tie among them (or a
    NaN) are sorted by (prob desc, index asc) explicitly. topk costs far less than sorting all E
    (docs/BENCHMARKS.md, the prompt path).
    """
    n_expert = probs.shape[-1]
    if probs.shape[0] <= FEW_ROWS and probs.device.type == "cpu" and probs.dtype == torch.float32:
        few = _route_few(probs.detach().numpy(), k, renormalize)
        if few is not None:
            return few
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


# Rows up to which `route` sorts in numpy: a decode step's or a draft window's, where the dozen torch ops of
# the general path (each a dispatch of several microseconds, at every layer) cost more than the sort.
FEW_ROWS = 16


def _route_few(probs: np.ndarray, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`route` for a few rows without NaN (None where one has: the general path's order for those): a stable
    sort by -p is the order by (prob desc, index asc); the renormalization the same float operations."""
    if np.isnan(probs).any():
        return None
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]  # [T, K]
    weights = np.take_along_axis(probs, ids, axis=-1)  # [T, K]
    if renormalize:
        total = np.maximum(np.cumsum(weights, axis=-1, dtype=np.float64)[:, -1:].astype(np.float32), RENORM_MIN)
        weights = weights / total
    return torch.from_numpy(np.ascontiguousarray(weights)), torch.from_numpy(ids.astype(np.int64))
