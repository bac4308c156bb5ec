"""Expert slabs held by one node (or in-process by the coordinator) and the SwiGLU compute over them.

Dimension letters: N rows, D model width, F expert width.
The quantized slab bytes stay memory-mapped; dequantized float32 copies are made on first use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swarm.sharding.gguf_io import dequantize
from swarm.sharding.slabs import SlabKey, SlabTensor


@dataclass
class ExpertWeights:
    """Dequantized weights of one expert: gate/up [F, D], down [D, F]."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate, self.up, self.down))


def dequantize_expert(parts: dict[str, SlabTensor], device: torch.device) -> ExpertWeights:
    def load(kind: str) -> torch.Tensor:
        s = parts[kind]
        return torch.from_numpy(dequantize(s.data, s.qtype, s.shape)).to(device)

    if "ffn_gate_up_exps" in parts:
        gate_up = load("ffn_gate_up_exps")  # [2F, D], gate rows first
        gate, up = gate_up.chunk(2, dim=0)
    else:
        gate, up = load("ffn_gate_exps"), load("ffn_up_exps")
    return ExpertWeights(gate=gate.contiguous(), up=up.contiguous(), down=load("ffn_down_exps"))


def swiglu(w: ExpertWeights, x: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x) for rows x [N, D] -> [N, D], in float32."""
    return F.linear(F.silu(F.linear(x, w.gate)) * F.linear(x, w.up), w.down)


class ExpertStore:
    """The slabs one process holds, computing any of them on request."""

    def __init__(
        self, slabs: dict[SlabKey, dict[str, SlabTensor]], device: str | torch.device = "cpu"
    ) -> None:
        self.slabs = slabs
        self.device = torch.device(device)
        self._weights: dict[SlabKey, ExpertWeights] = {}

    def held(self) -> list[SlabKey]:
        return sorted(self.slabs)

    def weights(self, layer: int, expert: int) -> ExpertWeights:
        key = (layer, expert)
        w = self._weights.get(key)
        if w is None:
            if key not in self.slabs:
                raise KeyError(f"expert {expert} of layer {layer} is not held here")
            w = dequantize_expert(self.slabs[key], self.device)
            self._weights[key] = w
        return w

    def compute(
        self, layer: int, expert_ids: Sequence[int], counts: Sequence[int], rows: torch.Tensor
    ) -> torch.Tensor:
        """Rows packed expert-major (counts[i] rows for expert_ids[i]) -> outputs [N, D] in the same order."""
        x = rows.to(self.device, torch.float32)
        out = torch.empty_like(x)
        start = 0
        for expert, n in zip(expert_ids, counts, strict=True):
            out[start : start + n] = swiglu(self.weights(layer, expert), x[start : start + n])
            start += n
        return out
