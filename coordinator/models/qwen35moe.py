"""qwen35moe: Qwen3.5 / Qwen3.6 MoE (35B-A3B, 122B-A10B) as llama.cpp's converter writes it.

Three Gated DeltaNet blocks to each gated full-attention block, every block followed by a routed MoE
with a sigmoid-gated shared expert. What is particular to this arch's files (the rest is in deltanet):
- the converter re-tiles the linear-attention value heads, so value head h reads key head h % Hk;
- beta and alpha come from two matrices, `ssm_beta` and `ssm_alpha`;
- RoPE is tagged multi-section (`rope.dimension_sections`); for text it is NeoX on `rope.dimension_count`
  dims, which the config checks against the file's own sections;
- files may end in MTP (next-token prediction) blocks, `nextn_predict_layers` of them, not run here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swarm.coordinator.models.hybrid import HybridConfig, HybridModel

ARCH = "qwen35moe"


@dataclass(frozen=True)
class Config(HybridConfig):
    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> Config:
        return cls.parse(meta, ARCH, v_heads_tiled=True, fused_ba=False)


Model = HybridModel
