"""Qwen2-MoE (GGUF arch `qwen2moe`): GQA attention with q/k/v biases, routed experts plus a gated shared expert.

The model is models.standard's; what qwen2moe is: q/k/v biases (read from the file: llama.cpp also runs
files without them), no q/k norm, the top-K softmax probabilities as weights without renormalising, and the
shared expert scaled by sigmoid(x . ffn_gate_inp_shexp).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace
from typing import Any

from swarm.coordinator.models import standard

ARCH = "qwen2moe"


class Config(standard.Config):
    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> standard.Config:
        return cls.read(meta, ARCH, shared_expert=True, renormalize=False, qk_norm=False, attn_bias=True)


def refine_config(cfg: standard.Config, tensor_names: Collection[str]) -> standard.Config:
    """What the metadata cannot say: whether this file's attention projections carry biases."""
    return replace(cfg, attn_bias="blk.0.attn_q.bias" in tensor_names)


Model = standard.Model
