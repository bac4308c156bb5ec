"""The tensor types of a llama.cpp Q4_K_M file: which matrices llama-quantize's Q4_K_M mixture gives more bits.

Read from llama.cpp's quantizer (src/llama-quant.cpp at the commit llama-cpp-python 0.3.36 vendors) and written
anew here. The mixture's base type is Q4_K; per tensor, by its name's category:
- output.weight: Q6_K (Q8_0 when its rows are not whole 256-blocks); token_embd.weight keeps the base type
  (it would follow output.weight only where a model ties the two).
- the "attn_v-like" tensors (attn_v, attn_qkv, attn_kv_b; a DeltaNet block's attn_qkv is one): Q6_K where
  `more_bits(i, n)` holds for their running index i among the n of them (one a block, in block order, so i is
  the block's number), else Q4_K; Q8_0 for every one in a model of exactly 8 experts.
- ffn_down* (experts' and shared expert's): Q6_K where `more_bits(block, n_blocks)` holds, else Q4_K.
- attn_k: Q8_0, attn_output: Q5_K, in a model of exactly 8 experts; else Q4_K.
- everything else quantizable (attn_q, attn_gate, ffn_gate*/ffn_up*, ssm_alpha/ssm_beta/ssm_out, nextn.eh_proj):
  Q4_K.
Not quantized at all (kept as converted, F32 here): tensors of one dimension, names not ending in "weight"
(ssm_a, ssm_dt.bias), norms, the router ffn_gate_inp.weight, and ssm_conv1d.
A matrix whose rows are not whole blocks of its type falls back: Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0, and to
F16 where even 32-blocks do not fit.

`n_blocks` counts every block the file holds (llama.cpp's n_layer_all: an MTP block too).
"""

from __future__ import annotations

import re

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType
MIXES = ("Q4_K_M",)
_BLOCK = re.compile(r"^blk\.(\d+)\.")
_ATTN_V_LIKE = ("attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight")
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def more_bits(i: int, n: int) -> bool:
    """The Q4_K_M mixture's chosen layers: the first and last eighth, and every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether llama-quantize changes this tensor's type at all."""
    dims = len(shape)
    while dims > 1 and shape[dims - 1] == 1:  # ggml counts trailing dimensions of 1 as absent
        dims -= 1
    return (
        dims >= 2
        and name.endswith("weight")
        and "_norm.weight" not in name
        and "ffn_gate_inp.weight" not in name
        and "ssm_conv1d" not in name
    )


def q4_k_m_type(name: str, shape: tuple[int, ...], n_blocks: int, n_expert: int) -> GGMLQuantizationType:
    """The type llama-quantize's Q4_K_M gives a quantizable tensor (`shape` in ggml order, rows first)."""
    m = _BLOCK.match(name)
    block = int(m.group(1)) if m else -1
    eight = n_expert == 8
    if name == "output.weight":
        qtype = Q.Q6_K if shape[0] % GGML_QUANT_SIZES[Q.Q6_K][0] == 0 else Q.Q8_0
    elif name == "token_embd.weight":
        qtype = Q.Q4_K
    elif any(s in name for s in _ATTN_V_LIKE):
        qtype = Q.Q8_0 if eight else Q.Q6_K if more_bits(block, n_blocks) else Q.Q4_K
    elif "attn_k.weight" in name:
        qtype = Q.Q8_0 if eight else Q.Q4_K
    elif "attn_q.weight" in name:
        qtype = Q.Q4_K
    elif "attn_output.weight" in name:
        qtype = Q.Q5_K if eight else Q.Q4_K
    elif "ffn_up" in name or "ffn_gate" in name:
        qtype = Q.Q4_K
    elif "ffn_down" in name:
        if block < 0:
            raise ValueError(f"{name}: an ffn_down tensor outside a block")
        qtype = Q.Q6_K if more_bits(block, n_blocks) else Q.Q4_K
    else:
        qtype = Q.Q4_K
    return fallback(qtype, shape[0])


def fallback(qtype: GGMLQuantizationType, row: int) -> GGMLQuantizationType:
    """The type a row of `row` elements can hold: `qtype`, or its fallback when rows are not whole blocks."""
    if row % GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    smaller = _FALLBACK.get(qtype, qtype)
    return smaller if row % GGML_QUANT_SIZES[smaller][0] == 0 else Q.F16


def mix_type(
    mix: str, name: str, shape: tuple[int, ...], n_blocks: int, n_expert: int
) -> GGMLQuantizationType:
    if mix != "Q4_K_M":
        raise ValueError(f"unknown mixture {mix!r}; use one of {', '.join(MIXES)}")
    return q4_k_m_type(name, shape, n_blocks, n_expert)
