"""The tensor plan of a synthetic model: every tensor llama.cpp's converter writes for the spec's arch, in
its order, with its ggml shape, type and how its values are drawn.

Shapes here are ggml `ne` order (fastest first), as the GGUF tensor info stores them: `{D, F, E}` is the torch
array [E, F, D]. Letters: D model width, E experts, F expert width, Fs shared-expert width, V vocab.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from swarm.sharding.synth_mix import MIXES, mix_type
from swarm.sharding.synth_spec import SynthSpec

logger = logging.getLogger(__name__)

Q = GGMLQuantizationType


class Init(NamedTuple):
    """How a tensor's values are drawn: kind in normal | norm | ssm_a | dt_bias; sigma for normal."""

    kind: str
    sigma: float = 0.0


class PlannedTensor(NamedTuple):
    name: str
    shape: tuple[int, ...]  # ggml ne order, fastest first
    qtype: GGMLQuantizationType
    init: Init

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))

    @property
    def n_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return self.n_elements // block * size


NORM = Init("norm")


def tensor_plan(spec: SynthSpec) -> list[PlannedTensor]:
    """Every tensor of the model in the converter's order, with its ggml shape, type and init."""
    spec.check()
    D = spec.n_embd
    p = _Planner(spec)
    p.mat("output.weight", (D, spec.n_vocab), sigma=2.0 / D**0.5)
    p.mat("token_embd.weight", (D, spec.n_vocab), sigma=1.0)
    post_norm = "post_attention_norm.weight" if spec.hybrid else "ffn_norm.weight"
    for i in range(spec.n_layers):
        blk = f"blk.{i}."
        p.vec(blk + "attn_norm.weight", (D,))
        if spec.recurrent(i):
            p.linear_attention(blk)
        p.moe(blk)
        p.vec(blk + post_norm, (D,))
        if not spec.recurrent(i):
            p.attention(blk)
    p.vec("output_norm.weight", (D,))
    for i in range(spec.n_layers, spec.n_blocks):
        blk = f"blk.{i}."
        p.mat(blk + "nextn.eh_proj.weight", (2 * D, D))
        p.vec(blk + "attn_norm.weight", (D,))
        p.moe(blk)
        p.vec(blk + post_norm, (D,))
        p.attention(blk)
        p.vec(blk + "nextn.shared_head_norm.weight", (D,))
        p.vec(blk + "nextn.enorm.weight", (D,))
        p.vec(blk + "nextn.hnorm.weight", (D,))
    return p.plan


class _Planner:
    """Appends one spec's tensors to `plan`: matrices, vectors, and the parts of a block."""

    def __init__(self, spec: SynthSpec) -> None:
        self.spec = spec
        self.plan: list[PlannedTensor] = []

    def _typed(self, kind: str, name: str, shape: tuple[int, ...]) -> GGMLQuantizationType:
        """A tensor's type from `kind` (the spec's dense or experts type): one type, or a mixture's per tensor."""
        if kind in MIXES:
            return mix_type(kind, name, shape, self.spec.n_blocks, self.spec.n_expert)
        return Q[kind]

    def mat(
        self,
        name: str,
        shape: tuple[int, ...],
        qtype: GGMLQuantizationType | None = None,
        sigma: float | None = None,
    ) -> None:
        """A matrix of the dense type (unless `qtype`), drawn N(0, sigma), sigma 1/sqrt(fan_in) by default."""
        qtype = self._typed(self.spec.dense_type, name, shape) if qtype is None else qtype
        block = GGML_QUANT_SIZES[qtype][0]
        if shape[0] % block:  # (a mixture's type already fell back as llama-quantize's does)
            # llama-quantize does the same: a row that is not whole blocks keeps a float type.
            logger.debug("%s: rows of %d are not whole %s blocks; writing F16", name, shape[0], qtype.name)
            qtype = Q.F16
        # N(0, 1/fan_in): each output of x·W keeps x's scale, so the residual stream stays O(1) per layer.
        init = Init("normal", sigma if sigma is not None else shape[0] ** -0.5)
        self.plan.append(PlannedTensor(name, shape, qtype, init))

    def vec(self, name: str, shape: tuple[int, ...], init: Init = NORM) -> None:
        self.plan.append(PlannedTensor(name, shape, Q.F32, init))

    def attention(self, p: str) -> None:
        spec, mat, vec = self.spec, self.mat, self.vec
        D, hd, nh, nkv = spec.n_embd, spec.head_dim, spec.n_head, spec.n_head_kv
        if spec.arch == "qwen2moe":
            vec(p + "attn_k.bias", (nkv * hd,), Init("normal", 0.3))
            mat(p + "attn_k.weight", (D, nkv * hd))
            mat(p + "attn_output.weight", (nh * hd, D))
            vec(p + "attn_q.bias", (nh * hd,), Init("normal", 0.3))
            mat(p + "attn_q.weight", (D, nh * hd))
            vec(p + "attn_v.bias", (nkv * hd,), Init("normal", 0.3))
            mat(p + "attn_v.weight", (D, nkv * hd))
            return
        # The hybrid archs' attn_q holds a q head and an output-gate head per head: 2 * nh * hd rows.
        q_rows = 2 * nh * hd if spec.hybrid else nh * hd
        vec(p + "attn_k_norm.weight", (hd,))
        mat(p + "attn_k.weight", (D, nkv * hd))
        mat(p + "attn_output.weight", (nh * hd, D))
        vec(p + "attn_q_norm.weight", (hd,))
        mat(p + "attn_q.weight", (D, q_rows))
        mat(p + "attn_v.weight", (D, nkv * hd))

    def linear_attention(self, p: str) -> None:
        spec, mat, vec = self.spec, self.mat, self.vec
        D, nk, nv, d = spec.n_embd, spec.ssm_k_heads, spec.ssm_v_heads, spec.ssm_head_dim
        conv_dim = 2 * nk * d + nv * d
        vec(p + "ssm_a", (nv,), Init("ssm_a"))
        vec(p + "ssm_conv1d.weight", (spec.conv_kernel, conv_dim), Init("normal", spec.conv_kernel**-0.5))
        vec(p + "ssm_dt.bias", (nv,), Init("dt_bias"))
        if spec.arch == "qwen3next":
            mat(p + "ssm_ba.weight", (D, 2 * nv))
        else:
            mat(p + "ssm_alpha.weight", (D, nv))
            mat(p + "ssm_beta.weight", (D, nv))
        mat(p + "attn_qkv.weight", (D, conv_dim))
        mat(p + "attn_gate.weight", (D, nv * d))
        vec(p + "ssm_norm.weight", (d,))
        mat(p + "ssm_out.weight", (nv * d, D))

    def moe(self, p: str) -> None:
        spec, mat, vec = self.spec, self.mat, self.vec
        D, E, F, Fs = spec.n_embd, spec.n_expert, spec.expert_ff, spec.shared_ff

        def experts(name: str, shape: tuple[int, int, int], fan_in: int) -> None:
            qtype = self._typed(spec.experts_type, p + name, shape)
            self.plan.append(PlannedTensor(p + name, shape, qtype, Init("normal", fan_in**-0.5)))

        experts("ffn_down_exps.weight", (F, D, E), F)
        experts("ffn_gate_exps.weight", (D, F, E), D)
        experts("ffn_up_exps.weight", (D, F, E), D)
        # Router logits with std ~3 on a unit-RMS input: clearly preferred experts, not a uniform split.
        vec(p + "ffn_gate_inp.weight", (D, E), Init("normal", 3.0 / D**0.5))
        if spec.arch != "qwen3moe":
            mat(p + "ffn_down_shexp.weight", (Fs, D))
            mat(p + "ffn_gate_shexp.weight", (D, Fs))
            mat(p + "ffn_up_shexp.weight", (D, Fs))
            vec(p + "ffn_gate_inp_shexp.weight", (D, 1), Init("normal", D**-0.5))
