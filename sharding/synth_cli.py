"""`swarm synth`: write a random-weight GGUF with a real model's layout (see swarm.sharding.synth)."""

from __future__ import annotations

import argparse
import sys

# Flag -> SynthSpec field, for the explicit dimensions that override a preset.
DIM_FLAGS = (
    ("--arch", "arch", str, "GGUF architecture: qwen35moe, qwen3next, qwen2moe or qwen3moe"),
    ("--embd", "n_embd", int, "model width D"),
    ("--experts", "n_expert", int, "experts per layer E"),
    ("--used", "n_expert_used", int, "experts used per token K"),
    ("--expert-ff", "expert_ff", int, "expert FFN width F"),
    ("--shared-ff", "shared_ff", int, "shared-expert FFN width (qwen2moe, qwen3next, qwen35moe)"),
    ("--ff", "ff", int, "the feed_forward_length key (qwen2moe, qwen3moe, qwen3next)"),
    ("--heads", "n_head", int, "attention heads"),
    ("--kv-heads", "n_head_kv", int, "key/value heads"),
    ("--head-dim", "head_dim", int, "attention head width"),
    ("--linear-k-heads", "ssm_k_heads", int, "Gated DeltaNet key heads (hybrid archs)"),
    ("--linear-v-heads", "ssm_v_heads", int, "Gated DeltaNet value heads (hybrid archs)"),
    ("--linear-head-dim", "ssm_head_dim", int, "Gated DeltaNet head width (hybrid archs)"),
    ("--rope-dims", "rope_dim", int, "rotary dims per head (hybrid archs; default head-dim/4)"),
    ("--context", "context_length", int, "context_length key"),
)


def register(sub: argparse._SubParsersAction) -> None:
    """Add this part's subcommands to the `swarm` parser."""
    from swarm.sharding.synth_spec import DENSE_TYPES, EXPERT_TYPES, PRESETS

    p = sub.add_parser(
        "synth",
        help="write a random-weight GGUF with a real model's layout (for tests, benchmarks, trying a swarm)",
        description=(
            "Write a GGUF whose tensor names, shapes, types and metadata are those llama.cpp's converter gives "
            "the chosen model, with RANDOM weights (the text it generates is meaningless; every part of the "
            "machinery that runs it is real). The vocabulary is a small byte-level BPE trained on a built-in "
            "English text and padded with unused [PAD] tokens to --vocab entries: a real 151k/248k vocabulary "
            "would make token_embd and output dominate a small file. The Qwen3.5 chat template is included."
        ),
    )
    p.add_argument("output", metavar="OUT.gguf", help="file to write (written to a temp name, then renamed)")
    p.add_argument(
        "--like",
        required=True,
        choices=sorted(PRESETS),
        help="preset layout to copy; the real ones have all their layers (qwen3.6-35b-a3b: 40 layers, "
        "about 20 GB at Q4_K) unless --layers says fewer; the *-tiny ones are small enough for tests",
    )
    p.add_argument(
        "--layers", type=int, help="number of layers (default: the preset's; real models have 24-48)"
    )
    p.add_argument(
        "--experts-type",
        choices=EXPERT_TYPES,
        help="ggml type of the expert tensors (default Q4_K; Q8_0 for qwen1.5-moe-a2.7b, whose expert width 1408 is not a multiple of 256)",
    )
    p.add_argument(
        "--dense-type",
        choices=DENSE_TYPES,
        help="ggml type of the other matrices (default F16; norms, routers and ssm vectors stay F32); Q4_K_M: "
        "each matrix the type llama-quantize's Q4_K_M gives it (Q4_K, Q6_K in its chosen layers, Q8_0/Q5_K where "
        "it wants them), as a real Q4_K_M file has; --experts-type Q4_K_M does the same for the experts",
    )
    p.add_argument("--vocab", type=int, help="vocabulary size (default 4096, 768 for the tiny presets)")
    p.add_argument("--mtp", type=int, help="qwen35moe: 1 adds a multi-token-prediction block (default 0)")
    p.add_argument("--seed", type=int, default=0, help="random seed; the same seed gives the same file")
    dims = p.add_argument_group("explicit dimensions (override the preset)")
    for flag, _, typ, text in DIM_FLAGS:
        dims.add_argument(flag, type=typ, help=text)
    p.set_defaults(func=run_synth)


def run_synth(args: argparse.Namespace) -> int:
    from swarm.sharding.synth import synthesize
    from swarm.sharding.synth_spec import preset

    overrides = {field: getattr(args, field_attr(flag)) for flag, field, _, _ in DIM_FLAGS}
    spec = preset(
        args.like,
        n_layers=args.layers,
        experts_type=args.experts_type,
        dense_type=args.dense_type,
        n_vocab=args.vocab,
        mtp=args.mtp,
        seed=args.seed,
        **overrides,
    )
    path = synthesize(args.output, spec, progress=sys.stderr.isatty())
    size = path.stat().st_size
    print(
        f"wrote {path} ({size / 2**20:,.1f} MiB): {spec.arch}, {spec.n_layers} layers, {spec.n_expert} experts "
        f"({spec.experts_type}), D {spec.n_embd}, seed {spec.seed}. The weights are RANDOM: the machinery is "
        "real, the text it generates is not."
    )
    return 0


def field_attr(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")
