"""Exact-numerics experts on a GPU (`--device cuda` / `mps`): torch's float32 matmuls there. The one room of
the compute floor that needs torch for the experts; a CPU node never imports it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from swarm.compute.expert_weights import ExpertWeights
from swarm.proto.arrays import to_torch


def to_device(w: ExpertWeights, device: str) -> ExpertWeights:
    """The float32 working weights moved to `device` as torch tensors."""

    def move(a: Any) -> Any:
        return to_torch(a).to(device) if a is not None else None

    return ExpertWeights(move(w.gate_up), move(w.down), move(w.gate_up_bias), move(w.down_bias))


def swiglu(w: ExpertWeights, x: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x) for rows x [N, D] on the weights' device -> [N, D] float32."""
    h = F.linear(x, w.gate_up, w.gate_up_bias)  # [N, 2F]
    gate, up = h.chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w.down, w.down_bias)


def compute_on_device(
    w_of: Any, device: str, expert_ids: list[int], counts: list[int], rows: Any
) -> torch.Tensor:
    """Rows packed expert-major through each expert's weights (`w_of(expert)`) on `device`: [N, D] float32."""
    x = (to_torch(rows) if not isinstance(rows, torch.Tensor) else rows).to(device, torch.float32)
    out = torch.empty_like(x)
    start = 0
    for expert, n in zip(expert_ids, counts, strict=True):
        if n:
            out[start : start + n] = swiglu(w_of(expert), x[start : start + n])
        start += n
    return out
