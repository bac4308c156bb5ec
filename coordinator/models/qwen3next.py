"""qwen3next: Qwen3-Next (80B-A3B) as llama.cpp's converter writes it.

The same hybrid stack as qwen35moe (deltanet.py), with this arch's file layout:
- linear-attention value heads stay grouped by key head: value head h reads key head h // (Hv/Hk);
- beta and alpha come from one matrix `ssm_ba`, laid out per key head as [b (Hv/Hk), a (Hv/Hk)];
- older files carry HF's fused `ssm_in` (per key head [q, k, v, z]) instead of `attn_qkv` + `attn_gate`;
  the loader picks that layout from the tensor names (`refine_config`);
- plain NeoX RoPE on `rope.dimension_count` dims.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from swarm.coordinator.models.hybrid import HybridConfig, HybridModel

ARCH = "qwen3next"


@dataclass(frozen=True)
class Config(HybridConfig):
    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> Config:
        return cls.parse(meta, ARCH, v_heads_tiled=False, fused_ba=True)


def refine_config(cfg: Config, tensor_names: Collection[str]) -> HybridConfig:
    """What the metadata cannot say: the tensor layout of this particular file."""
    return cfg.for_tensors(tensor_names)


Model = HybridModel
