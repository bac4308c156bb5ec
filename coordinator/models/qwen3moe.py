"""Qwen3-MoE (GGUF arch `qwen3moe`): GQA attention with per-head q/k RMSNorm, routed experts, no shared expert.

The model is models.standard's; what qwen3moe is: per-head q/k RMSNorm, no biases, top-K weights
renormalised to sum 1 (with llama.cpp's 2^-14 clamp), no shared expert.
"""

from __future__ import annotations

from typing import Any

from swarm.coordinator.models import standard

ARCH = "qwen3moe"


class Config(standard.Config):
    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> standard.Config:
        return cls.read(meta, ARCH, shared_expert=False, renormalize=True, qk_norm=True)


Model = standard.Model
