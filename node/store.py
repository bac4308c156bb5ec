"""Expert slabs held by one node (or in-process by the coordinator) and the SwiGLU compute over them.

Dimension letters: N rows, D model width, F expert width.
The quantized slab bytes stay memory-mapped; dequantized float32 copies are made on first use.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from swarm.sharding.gguf_io import dequantize, expert_tensors, open_gguf


@dataclass(frozen=True)
class SlabTensor:
    """One expert's part of one stacked tensor: raw bytes in the source quant type."""

    kind: str  # ffn_gate_exps | ffn_up_exps | ffn_down_exps | ffn_gate_up_exps (+ ".bias" for biases)
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order
    data: np.ndarray  # uint8 bytes (a view of a memory map)


SlabKey = tuple[int, int]  # (layer, expert)


@dataclass
class ExpertWeights:
    """Dequantized weights of one expert: gate/up [F, D], down [D, F]."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate, self.up, self.down))


def slabs_from_gguf(
    path: str | Path, layers: Iterable[int] | None = None, experts: Iterable[int] | None = None
) -> dict[SlabKey, dict[str, SlabTensor]]:
    """The expert slabs of a whole (unsharded) GGUF, as zero-copy views of its stacked tensors."""
    reader = open_gguf(path)
    want_layers = set(layers) if layers is not None else None
    want_experts = set(experts) if experts is not None else None
    out: dict[SlabKey, dict[str, SlabTensor]] = {}
    for et in expert_tensors(reader, path):
        if want_layers is not None and et.layer not in want_layers:
            continue
        kind = et.kind if et.name.endswith(".weight") else et.kind + ".bias"
        for e in range(et.n_expert):
            if want_experts is not None and e not in want_experts:
                continue
            out.setdefault((et.layer, e), {})[kind] = SlabTensor(kind, et.qtype, et.slab_shape, et.slab(e))
    return out


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
