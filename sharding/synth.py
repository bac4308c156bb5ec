"""Random-weight GGUFs with the exact layout llama.cpp's converter gives the Qwen MoE families.

`swarm synth` lets tests, benchmarks, demos and users try a swarm without downloading 20 GB: the file has the
tensor names, shapes, ggml types and metadata keys of a real qwen35moe / qwen3next / qwen2moe / qwen3moe GGUF
(copied from the reference fixtures, which llama.cpp's own converter produced), a small byte-level BPE
tokenizer and the Qwen3.5 chat template, and random weights scaled so a forward pass stays finite and routing
is not uniform. The text such a model writes is meaningless; the machinery that runs it is real.

Public API:
    spec = preset("qwen3.6-35b-a3b", n_layers=4, experts_type="Q4_K")
    synthesize("model.gguf", spec)  # -> Path

Shapes here are ggml `ne` order (fastest first), as the GGUF tensor info stores them: `{D, F, E}` is the torch
array [E, F, D]. Letters: D model width, E experts, K experts used, F expert width, Fs shared-expert width,
V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGMLQuantizationType,
    GGUFValueType,
    GGUFWriter,
    Keys,
    LlamaFileType,
    TokenType,
)
from gguf import quants as gguf_quants
from gguf.utility import size_label

from swarm.sharding.errors import UserError
from swarm.sharding.synth_data import CORPUS, QWEN35_CHAT_TEMPLATE

logger = logging.getLogger(__name__)

Q = GGMLQuantizationType

ARCHS = ("qwen35moe", "qwen3next", "qwen2moe", "qwen3moe")
HYBRID_ARCHS = ("qwen35moe", "qwen3next")
# Expert tensors: float types and gguf's own quantizer types are made from N(0, sigma) values; the K- and
# I-quants (gguf-py cannot quantize them) are written as valid random blocks with scales set for sigma.
EXPERT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ2_XS", "IQ1_M")
DENSE_TYPES = ("F32", "F16", "BF16", "Q8_0")
# gguf.Keys has no constant for this one; llama.cpp reads it for the hybrid archs.
RECURRENT_LAYERS_KEY = "{arch}.attention.recurrent_layers"

SPECIAL_TOKENS = (
    ("<|endoftext|>", TokenType.CONTROL),
    ("<|im_start|>", TokenType.CONTROL),
    ("<|im_end|>", TokenType.CONTROL),
    ("<think>", TokenType.USER_DEFINED),
    ("</think>", TokenType.USER_DEFINED),
)

# general.file_type follows the experts' type, which holds most of the bytes (as llama-quantize's presets do).
FILE_TYPES = {
    "F32": LlamaFileType.ALL_F32,
    "F16": LlamaFileType.MOSTLY_F16,
    "BF16": LlamaFileType.MOSTLY_BF16,
    "Q8_0": LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": LlamaFileType.MOSTLY_Q4_0,
    "Q4_K": LlamaFileType.MOSTLY_Q4_K_M,
    "Q5_K": LlamaFileType.MOSTLY_Q5_K_M,
    "Q6_K": LlamaFileType.MOSTLY_Q6_K,
    "IQ4_XS": LlamaFileType.MOSTLY_IQ4_XS,
    "IQ2_XS": LlamaFileType.MOSTLY_IQ2_XS,
    "IQ1_M": LlamaFileType.MOSTLY_IQ1_M,
}

# Rows of at most this many elements are generated at once: memory stays flat whatever the model size.
CHUNK_ELEMENTS = 1 << 22
PROGRESS_MIN_BYTES = 256 << 20


@dataclass(frozen=True)
class SynthSpec:
    """Everything that decides a synthetic model's layout; `synthesize` writes exactly this.

    Fields that an arch does not use are ignored for it (e.g. the linear-attention ones for qwen3moe).
    """

    arch: str
    n_layers: int  # main-pass blocks; an MTP block (qwen35moe, `mtp=1`) comes on top
    n_embd: int  # D
    n_expert: int  # E
    n_expert_used: int  # K
    expert_ff: int  # F
    shared_ff: int  # Fs (qwen2moe, qwen3next, qwen35moe); 0 for qwen3moe
    n_head: int
    n_head_kv: int
    head_dim: int
    ff: int = 0  # `feed_forward_length` key (qwen2moe, qwen3moe, qwen3next): the HF dense intermediate size
    ssm_k_heads: int = 16  # linear attention key heads (ssm.group_count)
    ssm_v_heads: int = 32  # linear attention value heads (ssm.time_step_rank)
    ssm_head_dim: int = 128  # ssm.state_size (key and value head dim)
    conv_kernel: int = 4
    full_attention_interval: int = 4
    rope_dim: int = 0  # rope.dimension_count for the hybrid archs; 0 = head_dim / 4
    rope_sections: tuple[int, ...] = ()  # qwen35moe; () = rope_dim / 2 split 11:11:10 like Qwen3.5
    rope_base: float = 10_000_000.0
    rms_eps: float = 1e-6
    context_length: int = 4096
    n_vocab: int = 4096
    experts_type: str = "Q4_K"
    dense_type: str = "F16"
    mtp: int = 0  # qwen35moe only: number of multi-token-prediction blocks (0 or 1)
    seed: int = 0
    name: str = "synthetic"

    @property
    def n_blocks(self) -> int:
        return self.n_layers + self.mtp

    @property
    def hybrid(self) -> bool:
        return self.arch in HYBRID_ARCHS

    def recurrent(self, block: int) -> bool:
        """Whether block `block` is a Gated DeltaNet layer (MTP blocks are full attention)."""
        if not self.hybrid or block >= self.n_layers:
            return False
        return (block + 1) % self.full_attention_interval != 0

    @property
    def n_rot(self) -> int:
        return self.rope_dim or self.head_dim // 4

    @property
    def sections(self) -> tuple[int, int, int, int]:
        if self.rope_sections:
            s = tuple(self.rope_sections) + (0,) * (4 - len(self.rope_sections))
            return (s[0], s[1], s[2], s[3])
        half = self.n_rot // 2
        t = round(half * 11 / 32)
        return (t, t, half - 2 * t, 0)

    def check(self) -> None:
        """Raise UserError for a layout llama.cpp (or the expert grain) could not hold."""
        if self.arch not in ARCHS:
            raise UserError(f"unknown arch {self.arch!r}; use one of {', '.join(ARCHS)}")
        if self.experts_type not in EXPERT_TYPES:
            raise UserError(
                f"unknown experts type {self.experts_type!r}; use one of {', '.join(EXPERT_TYPES)}"
            )
        if self.dense_type not in DENSE_TYPES:
            raise UserError(f"unknown dense type {self.dense_type!r}; use one of {', '.join(DENSE_TYPES)}")
        positive = (
            "n_layers",
            "n_embd",
            "n_expert",
            "n_expert_used",
            "expert_ff",
            "n_head",
            "n_head_kv",
            "head_dim",
        )
        for field in positive:
            if getattr(self, field) < 1:
                raise UserError(f"{field} must be at least 1 (got {getattr(self, field)})")
        if self.n_expert_used > self.n_expert:
            raise UserError(f"experts used ({self.n_expert_used}) exceeds the expert count ({self.n_expert})")
        if self.n_head % self.n_head_kv != 0:
            raise UserError(f"heads ({self.n_head}) must be a multiple of kv heads ({self.n_head_kv})")
        if self.arch != "qwen3moe" and self.shared_ff < 1:
            raise UserError(f"{self.arch} has a shared expert: shared_ff must be at least 1")
        if self.mtp not in (0, 1) or (self.mtp and self.arch != "qwen35moe"):
            raise UserError("an MTP block (--mtp 1) is only written for qwen35moe; use --mtp 0")
        if self.hybrid:
            if self.ssm_v_heads % self.ssm_k_heads != 0:
                raise UserError(
                    f"linear-attention value heads ({self.ssm_v_heads}) must be a multiple of key heads "
                    f"({self.ssm_k_heads})"
                )
            if self.n_rot % 2 or self.n_rot > self.head_dim:
                raise UserError(
                    f"rope dims ({self.n_rot}) must be even and at most head_dim ({self.head_dim})"
                )
        min_vocab = 256 + len(SPECIAL_TOKENS)
        if self.n_vocab < min_vocab:
            raise UserError(
                f"vocab {self.n_vocab} is too small: the byte-level tokenizer needs at least {min_vocab}"
            )
        block = GGML_QUANT_SIZES[Q[self.experts_type]][0]
        for what, row in (("embedding width", self.n_embd), ("expert ff", self.expert_ff)):
            if row % block:
                raise UserError(
                    f"{what} {row} is not a whole number of {self.experts_type} blocks of {block}; "
                    f"pick a multiple of {block} or another --experts-type (F16, Q8_0 need 1 or 32)"
                )


# The real models' layer shapes (MODELS.md, the HF configs), small vocab by default, plus tiny ones for tests.
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3.6-35b-a3b": dict(
        arch="qwen35moe", n_layers=40, n_embd=2048, n_expert=256, n_expert_used=8, expert_ff=512,
        shared_ff=512, n_head=16, n_head_kv=2, head_dim=256, ssm_k_heads=16, ssm_v_heads=32,
        ssm_head_dim=128, rope_dim=64, rope_sections=(11, 11, 10, 0), context_length=262144,
    ),
    "qwen3-next-80b-a3b": dict(
        arch="qwen3next", n_layers=48, n_embd=2048, n_expert=512, n_expert_used=10, expert_ff=512,
        shared_ff=512, ff=5120, n_head=16, n_head_kv=2, head_dim=256, ssm_k_heads=16, ssm_v_heads=32,
        ssm_head_dim=128, rope_dim=64, context_length=262144,
    ),
    "qwen3-30b-a3b": dict(
        arch="qwen3moe", n_layers=48, n_embd=2048, n_expert=128, n_expert_used=8, expert_ff=768, shared_ff=0,
        ff=6144, n_head=32, n_head_kv=4, head_dim=128, rope_base=1_000_000.0, context_length=40960,
    ),
    "qwen1.5-moe-a2.7b": dict(
        arch="qwen2moe", n_layers=24, n_embd=2048, n_expert=60, n_expert_used=4, expert_ff=1408,
        shared_ff=5632, ff=5632, n_head=16, n_head_kv=16, head_dim=128, rope_base=1_000_000.0,
        context_length=8192, experts_type="Q8_0",
    ),
    # Tiny layouts for tests: every row a whole 256-wide K-quant super-block, so any --experts-type fits.
    "qwen35moe-tiny": dict(
        arch="qwen35moe", n_layers=4, n_embd=256, n_expert=8, n_expert_used=2, expert_ff=256, shared_ff=256,
        n_head=4, n_head_kv=2, head_dim=64, ssm_k_heads=2, ssm_v_heads=4, ssm_head_dim=32, rope_dim=16,
        n_vocab=768,
    ),
    "qwen3next-tiny": dict(
        arch="qwen3next", n_layers=4, n_embd=256, n_expert=8, n_expert_used=2, expert_ff=256, shared_ff=256,
        ff=512, n_head=4, n_head_kv=2, head_dim=64, ssm_k_heads=2, ssm_v_heads=4, ssm_head_dim=32,
        rope_dim=16, n_vocab=768,
    ),
    "qwen3moe-tiny": dict(
        arch="qwen3moe", n_layers=4, n_embd=256, n_expert=8, n_expert_used=2, expert_ff=256, shared_ff=0,
        ff=512, n_head=4, n_head_kv=2, head_dim=64, rope_base=1_000_000.0, n_vocab=768,
    ),
    "qwen2moe-tiny": dict(
        arch="qwen2moe", n_layers=4, n_embd=256, n_expert=8, n_expert_used=2, expert_ff=256, shared_ff=512,
        ff=512, n_head=4, n_head_kv=2, head_dim=64, rope_base=1_000_000.0, n_vocab=768,
    ),
}  # fmt: skip
PRESETS["qwen3.5-35b-a3b"] = PRESETS["qwen3.6-35b-a3b"]


def preset_names() -> list[str]:
    return sorted(PRESETS)


def preset(name: str, **overrides: Any) -> SynthSpec:
    """The SynthSpec of preset `name`, with any SynthSpec field overridden (None values are ignored)."""
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}; use one of {', '.join(preset_names())}")
    fields = {f.name for f in dataclasses.fields(SynthSpec)}
    unknown = set(overrides) - fields
    if unknown:
        raise TypeError(f"unknown SynthSpec fields: {sorted(unknown)}")
    values = dict(PRESETS[name], name=f"synthetic {name}")
    values.update({k: v for k, v in overrides.items() if v is not None})
    if "rope_sections" in values:
        values["rope_sections"] = tuple(values["rope_sections"])
    spec = SynthSpec(**values)
    spec.check()
    return spec


# --- the tensor plan -------------------------------------------------------------------------------------


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
    D, E, F, Fs, V = spec.n_embd, spec.n_expert, spec.expert_ff, spec.shared_ff, spec.n_vocab
    dense, experts = Q[spec.dense_type], Q[spec.experts_type]
    plan: list[PlannedTensor] = []

    def mat(
        name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType = dense, sigma: float | None = None
    ) -> None:
        block = GGML_QUANT_SIZES[qtype][0]
        if shape[0] % block:
            # llama-quantize does the same: a row that is not whole blocks keeps a float type.
            logger.debug("%s: rows of %d are not whole %s blocks; writing F16", name, shape[0], qtype.name)
            qtype = Q.F16
        # N(0, 1/fan_in): each output of x·W keeps x's scale, so the residual stream stays O(1) per layer.
        init = Init("normal", sigma if sigma is not None else shape[0] ** -0.5)
        plan.append(PlannedTensor(name, shape, qtype, init))

    def vec(name: str, shape: tuple[int, ...], init: Init = NORM) -> None:
        plan.append(PlannedTensor(name, shape, Q.F32, init))

    mat("output.weight", (D, V), sigma=2.0 / D**0.5)
    mat("token_embd.weight", (D, V), sigma=1.0)

    def attention(p: str) -> None:
        hd, nh, nkv = spec.head_dim, spec.n_head, spec.n_head_kv
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

    def linear_attention(p: str) -> None:
        nk, nv, d = spec.ssm_k_heads, spec.ssm_v_heads, spec.ssm_head_dim
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

    def moe(p: str) -> None:
        plan.append(PlannedTensor(p + "ffn_down_exps.weight", (F, D, E), experts, Init("normal", F**-0.5)))
        plan.append(PlannedTensor(p + "ffn_gate_exps.weight", (D, F, E), experts, Init("normal", D**-0.5)))
        plan.append(PlannedTensor(p + "ffn_up_exps.weight", (D, F, E), experts, Init("normal", D**-0.5)))
        # Router logits with std ~3 on a unit-RMS input: clearly preferred experts, not a uniform split.
        vec(p + "ffn_gate_inp.weight", (D, E), Init("normal", 3.0 / D**0.5))
        if spec.arch != "qwen3moe":
            mat(p + "ffn_down_shexp.weight", (Fs, D))
            mat(p + "ffn_gate_shexp.weight", (D, Fs))
            mat(p + "ffn_up_shexp.weight", (D, Fs))
            vec(p + "ffn_gate_inp_shexp.weight", (D, 1), Init("normal", D**-0.5))

    post_norm = "post_attention_norm.weight" if spec.hybrid else "ffn_norm.weight"
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", (D,))
        if spec.recurrent(i):
            linear_attention(p)
        moe(p)
        vec(p + post_norm, (D,))
        if not spec.recurrent(i):
            attention(p)
    vec("output_norm.weight", (D,))
    for i in range(spec.n_layers, spec.n_blocks):
        p = f"blk.{i}."
        mat(p + "nextn.eh_proj.weight", (2 * D, D))
        vec(p + "attn_norm.weight", (D,))
        moe(p)
        vec(p + post_norm, (D,))
        attention(p)
        vec(p + "nextn.shared_head_norm.weight", (D,))
        vec(p + "nextn.enorm.weight", (D,))
        vec(p + "nextn.hnorm.weight", (D,))
    return plan


# --- tokenizer -------------------------------------------------------------------------------------------


class Vocab(NamedTuple):
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    eos_id: int
    pad_id: int


@functools.lru_cache(maxsize=8)
def build_vocab(n_vocab: int) -> Vocab:
    """A byte-level BPE trained deterministically on CORPUS, then specials, then [PAD<i>] up to n_vocab."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    n_bpe = n_vocab - len(SPECIAL_TOKENS)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=n_bpe,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    model = json.loads(tok.to_str())["model"]
    by_id = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in by_id]
    assert [i for _, i in by_id] == list(range(len(tokens))), "BPE ids are not dense"
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [int(TokenType.NORMAL)] * len(tokens)
    first_special = len(tokens)
    for text, kind in SPECIAL_TOKENS:
        tokens.append(text)
        types.append(int(kind))
    for i in range(len(tokens), n_vocab):
        tokens.append(f"[PAD{i}]")
        types.append(int(TokenType.UNUSED))
    return Vocab(tokens, types, merges, eos_id=first_special + 2, pad_id=first_special)


# --- metadata --------------------------------------------------------------------------------------------


def _size_label(spec: SynthSpec, plan: list[PlannedTensor]) -> str:
    """general.size_label as the converter computes it: "{E}x{params of the shared part + one expert}"."""
    shared = sum(t.n_elements for t in plan if "_exps." not in t.name)
    per_expert = sum(t.n_elements // t.shape[-1] for t in plan if "_exps." in t.name)
    return size_label(shared + per_expert * spec.n_expert, shared, per_expert, spec.n_expert)


def _write_metadata(w: GGUFWriter, spec: SynthSpec, plan: list[PlannedTensor]) -> None:
    """The converter's keys, in its order, with its value types (checked against the fixtures' GGUFs)."""
    arch = spec.arch
    LLM, Att, Rope, SSM, Tok = Keys.LLM, Keys.Attention, Keys.Rope, Keys.SSM, Keys.Tokenizer

    def k(key: str) -> str:
        return key.format(arch=arch)

    w.add_string(Keys.General.TYPE, "model")
    w.add_string(Keys.General.NAME, spec.name)
    w.add_string(Keys.General.SIZE_LABEL, _size_label(spec, plan))
    w.add_uint32(k(LLM.BLOCK_COUNT), spec.n_blocks)
    w.add_uint32(k(LLM.CONTEXT_LENGTH), spec.context_length)
    w.add_uint32(k(LLM.EMBEDDING_LENGTH), spec.n_embd)
    if arch != "qwen35moe":
        w.add_uint32(k(LLM.FEED_FORWARD_LENGTH), spec.ff or spec.expert_ff * spec.n_expert_used)
    w.add_uint32(k(Att.HEAD_COUNT), spec.n_head)
    w.add_uint32(k(Att.HEAD_COUNT_KV), spec.n_head_kv)
    if arch == "qwen35moe":
        w.add_key_value(
            k(Rope.DIMENSION_SECTIONS), list(spec.sections), GGUFValueType.ARRAY, GGUFValueType.INT32
        )
    w.add_float32(k(Rope.FREQ_BASE), spec.rope_base)
    w.add_float32(k(Att.LAYERNORM_RMS_EPS), spec.rms_eps)
    w.add_uint32(k(LLM.EXPERT_COUNT), spec.n_expert)
    w.add_uint32(k(LLM.EXPERT_USED_COUNT), spec.n_expert_used)
    if arch != "qwen2moe":
        w.add_uint32(k(Att.KEY_LENGTH), spec.head_dim)
        w.add_uint32(k(Att.VALUE_LENGTH), spec.head_dim)
    w.add_uint32(Keys.General.FILE_TYPE, int(FILE_TYPES[spec.experts_type]))
    w.add_uint32(k(LLM.EXPERT_FEED_FORWARD_LENGTH), spec.expert_ff)
    if arch != "qwen3moe":
        w.add_uint32(k(LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH), spec.shared_ff)
    if spec.mtp:
        w.add_uint32(k(LLM.NEXTN_PREDICT_LAYERS), spec.mtp)
    if spec.hybrid:
        w.add_uint32(k(SSM.CONV_KERNEL), spec.conv_kernel)
        w.add_uint32(k(SSM.STATE_SIZE), spec.ssm_head_dim)
        w.add_uint32(k(SSM.GROUP_COUNT), spec.ssm_k_heads)
        w.add_uint32(k(SSM.TIME_STEP_RANK), spec.ssm_v_heads)
        w.add_uint32(k(SSM.INNER_SIZE), spec.ssm_v_heads * spec.ssm_head_dim)
        recurrent = [spec.recurrent(i) for i in range(spec.n_blocks)]
        w.add_key_value(k(RECURRENT_LAYERS_KEY), recurrent, GGUFValueType.ARRAY, GGUFValueType.BOOL)
        w.add_uint32(k(LLM.FULL_ATTENTION_INTERVAL), spec.full_attention_interval)
        w.add_uint32(k(Rope.DIMENSION_COUNT), spec.n_rot)
    w.add_uint32(Keys.General.QUANTIZATION_VERSION, 2)

    vocab = build_vocab(spec.n_vocab)
    w.add_string(Tok.MODEL, "gpt2")
    w.add_string(Tok.PRE, "qwen35" if arch == "qwen35moe" else "qwen2")
    w.add_key_value(Tok.LIST, vocab.tokens, GGUFValueType.ARRAY, GGUFValueType.STRING)
    w.add_key_value(Tok.TOKEN_TYPE, vocab.token_types, GGUFValueType.ARRAY, GGUFValueType.INT32)
    w.add_key_value(Tok.MERGES, vocab.merges, GGUFValueType.ARRAY, GGUFValueType.STRING)
    w.add_uint32(Tok.EOS_ID, vocab.eos_id)
    w.add_uint32(Tok.PAD_ID, vocab.pad_id)
    w.add_bool(Tok.ADD_BOS, False)
    w.add_bool(Tok.ADD_EOS, False)
    w.add_string(Tok.CHAT_TEMPLATE, QWEN35_CHAT_TEMPLATE)


# --- values ----------------------------------------------------------------------------------------------


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    """One generator per tensor: a tensor's bytes depend only on the seed and its name, not on the order."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _draw(rng: np.random.Generator, init: Init, n: int) -> np.ndarray:
    if init.kind == "normal":
        return rng.standard_normal(n, dtype=np.float32) * np.float32(init.sigma)
    if init.kind == "norm":
        # Norm weights around 1 (the hybrid archs' files store 1 + w already, MODELS.md).
        return 1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)
    if init.kind == "ssm_a":
        # ssm_a = -exp(A_log) with A_log = log(U(0.5, 8)): decays between exp(-8 dt) and exp(-0.5 dt).
        return -rng.uniform(0.5, 8.0, n).astype(np.float32)
    if init.kind == "dt_bias":
        return (rng.standard_normal(n, dtype=np.float32) * 0.5 - 2.5).astype(np.float32)
    raise AssertionError(f"unknown init {init.kind}")


def _encode(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype == Q.F32:
        return values.astype(np.float32, copy=False)
    if qtype == Q.F16:
        return values.astype(np.float16)
    return gguf_quants.quantize(values, qtype)


def _f16_bits(x: float) -> int:
    return int(np.array(x, dtype=np.float16).view(np.uint16))


def _kquant_blocks(
    rng: np.random.Generator, qtype: GGMLQuantizationType, n_blocks: int, sigma: float
) -> np.ndarray:
    """Q4_K / Q5_K blocks whose 8 sub-blocks are zero-mean: value = d*sc*(q - (2^b - 1)/2).

    Each sub-block's 6-bit scale sc is even and its min m = sc/2, with dmin = (2^b - 1) * d, so
    d*sc*q - dmin*m = d*sc*(q - (2^b-1)/2): symmetric around zero, like a trained weight matrix's rows.
    """
    bits = 4 if qtype == Q.Q4_K else 5
    _, size = GGML_QUANT_SIZES[qtype]
    out = np.empty((n_blocks, size), dtype=np.uint8)
    out[:, 16:] = rng.integers(0, 256, (n_blocks, size - 16), dtype=np.uint8)  # qh/qs: uniform q
    half = rng.integers(16, 32, (n_blocks, 8), dtype=np.uint8)  # m in [16, 31], sc = 2m in [32, 62]
    sc, m = half * 2, half
    scales = np.empty((n_blocks, 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    out[:, 4:16] = scales
    levels = (1 << bits) - 1
    q_std = ((levels + 1) ** 2 - 1) ** 0.5 / 12**0.5  # std of a uniform integer on [0, levels]
    sc_rms = float(np.sqrt(np.mean(np.arange(32, 63, 2, dtype=np.float64) ** 2)))
    d = sigma / (sc_rms * q_std)
    hdr = np.array([_f16_bits(d), _f16_bits(d * levels)], dtype=np.uint16).view(np.uint8)
    out[:, 0:4] = hdr
    return out


# Where each random-bytes type keeps its f16 super-block scale d (IQ1_M spreads it, see _set_d).
_D_OFFSET = {Q.Q6_K: 208, Q.IQ4_XS: 0, Q.IQ2_XS: 0}


def _set_d(blocks: np.ndarray, qtype: GGMLQuantizationType, d: float) -> None:
    bits = _f16_bits(d)
    if qtype == Q.IQ1_M:
        # IQ1_M stores d's 16 bits as the top nibbles of its four u16 block-scale words.
        words = blocks[:, 48:56].view(np.uint16)
        for i in range(4):
            words[:, i] = (words[:, i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
        return
    off = _D_OFFSET[qtype]
    blocks[:, off : off + 2] = np.array([bits], dtype=np.uint16).view(np.uint8)


@functools.cache
def _unit_std(qtype: GGMLQuantizationType) -> float:
    """Std of values from uniformly random blocks of `qtype` with d = 1, measured with gguf's dequantizer."""
    _, size = GGML_QUANT_SIZES[qtype]
    blocks = np.random.default_rng(12345).integers(0, 256, (4096, size), dtype=np.uint8)
    _set_d(blocks, qtype, 1.0)
    return float(gguf_quants.dequantize(blocks, qtype).std())


def _random_blocks(
    rng: np.random.Generator, qtype: GGMLQuantizationType, n_blocks: int, sigma: float
) -> np.ndarray:
    """Uniformly random (hence valid) blocks of an I-quant or Q6_K, with d set so values have std ~sigma."""
    _, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    _set_d(blocks, qtype, sigma / _unit_std(qtype))
    return blocks


def _chunks(t: PlannedTensor, seed: int) -> Iterator[np.ndarray]:
    """The tensor's bytes, a few million elements at a time, in file order."""
    rng = tensor_rng(seed, t.name)
    row = t.shape[0]
    n_rows = t.n_elements // row
    rows_per_chunk = max(1, CHUNK_ELEMENTS // row)
    block = GGML_QUANT_SIZES[t.qtype][0]
    for start in range(0, n_rows, rows_per_chunk):
        rows = min(rows_per_chunk, n_rows - start)
        if t.qtype in (Q.Q4_K, Q.Q5_K):
            out = _kquant_blocks(rng, t.qtype, rows * row // block, t.init.sigma)
        elif t.qtype in (Q.Q6_K, Q.IQ4_XS, Q.IQ2_XS, Q.IQ1_M):
            out = _random_blocks(rng, t.qtype, rows * row // block, t.init.sigma)
        else:
            out = _encode(_draw(rng, t.init, rows * row).reshape(rows, row), t.qtype)
        yield np.ascontiguousarray(out).reshape(-1).view(np.uint8)


# --- writing ---------------------------------------------------------------------------------------------


def synthesize(path: str | Path, spec: SynthSpec, progress: bool = False) -> Path:
    """Write the random-weight GGUF `spec` describes to `path` (atomically: temp file, then rename).

    Deterministic for a given spec (seed included). Memory stays flat: tensors are generated and written
    a chunk at a time. With `progress`, a bytes bar goes to stderr for outputs over 256 MiB.
    """
    path = Path(path)
    plan = tensor_plan(spec)
    if not path.parent.is_dir():
        raise UserError(f"{path.parent}: no such directory; create it first")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    total = sum(t.n_bytes for t in plan)
    free = shutil.disk_usage(path.parent).free
    if total > free:
        raise UserError(
            f"{path}: needs {total / 2**30:.1f} GiB but only {free / 2**30:.1f} GiB are free there; "
            "use fewer --layers or --experts, a smaller --experts-type, or another disk"
        )
    logger.info("writing %s: %s, %d tensors, %.1f MiB", path, spec.arch, len(plan), total / 2**20)
    try:
        w = GGUFWriter(tmp, spec.arch)
        _write_metadata(w, spec, plan)
        for t in plan:
            # Byte shape + raw type: the writer converts it to the ggml shape for quantized types.
            w.add_tensor_info(
                t.name, tuple(reversed(t.shape)), np.dtype(np.float32), t.n_bytes, raw_dtype=t.qtype
            )
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        _write_data(w, plan, spec.seed, progress and total >= PROGRESS_MIN_BYTES)
        w.close()
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(
            f"{path}: cannot write ({e.strerror or e}); check the path and free disk space"
        ) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _write_data(w: GGUFWriter, plan: list[PlannedTensor], seed: int, progress: bool) -> None:
    from tqdm import tqdm

    assert w.fout is not None and len(w.fout) == 1
    fout = w.fout[0]
    bar = tqdm(
        total=sum(t.n_bytes for t in plan), unit="B", unit_scale=True, unit_divisor=1024, disable=not progress
    )
    with bar:
        for t in plan:
            # Same layout as GGUFWriter.write_tensor_data, a chunk at a time: align, data, pad to alignment.
            w.write_padding(fout, fout.tell())
            written = 0
            for chunk in _chunks(t, seed):
                chunk.tofile(fout)
                written += chunk.nbytes
                bar.update(chunk.nbytes)
            assert written == t.n_bytes, (t.name, written, t.n_bytes)
            w.write_padding(fout, written)
