"""What a synthetic model is: its layout (SynthSpec), checked as llama.cpp (or the expert grain) needs it,
and the presets copied from the real Qwen MoE models. swarm.sharding.synth writes the file a SynthSpec
describes.

    spec = preset("qwen3.6-35b-a3b", n_layers=4, experts_type="Q4_K")

Letters: D model width, E experts, K experts used, F expert width, Fs shared-expert width, V vocab.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, TokenType

from swarm.sharding.errors import UserError

Q = GGMLQuantizationType

ARCHS = ("qwen35moe", "qwen3next", "qwen2moe", "qwen3moe")
HYBRID_ARCHS = ("qwen35moe", "qwen3next")
# Expert tensors: float types and gguf's own quantizer types are made from N(0, sigma) values; the K- and
# I-quants (gguf-py cannot quantize them) are written as valid random blocks with scales set for sigma.
# Q4_K_M is llama-quantize's mixture (swarm.sharding.synth_mix): Q4_K with Q6_K/Q8_0/Q5_K where it gives more bits.
EXPERT_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "IQ4_XS",
    "IQ2_XS",
    "IQ1_M",
    "Q4_K_M",
)
DENSE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_K_M")
# The vocabulary's special tokens, after the byte-level BPE pieces (synth.build_vocab): --vocab must hold both.
SPECIAL_TOKENS = (
    ("<|endoftext|>", TokenType.CONTROL),
    ("<|im_start|>", TokenType.CONTROL),
    ("<|im_end|>", TokenType.CONTROL),
    ("<think>", TokenType.USER_DEFINED),
    ("</think>", TokenType.USER_DEFINED),
)


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
        base = "Q4_K" if self.experts_type == "Q4_K_M" else self.experts_type  # the mixture's rows are Q4_K's
        block = GGML_QUANT_SIZES[Q[base]][0]
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
