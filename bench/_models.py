"""The bench models: `swarm synth` at a real model's layer shape (Q4_K experts, Q8_0 dense, like the real UD
files), sharded for the nodes, and the fixed prompt the benches feed them."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from swarm.coordinator.engine import Engine
from swarm.sharding.shard import shard_model
from swarm.sharding.synth import synthesize
from swarm.sharding.synth_spec import preset

log = logging.getLogger("bench.models")

MODELS: dict[str, dict[str, Any]] = {
    "qwen3moe": {"preset": "qwen3-30b-a3b", "issue": 4, "llama": False},
    "qwen35moe": {"preset": "qwen3.6-35b-a3b", "issue": 9, "llama": True},
}

# A fixed English prompt (the synth tokenizer is trained on English text); repeated and cut to --prompt-tokens.
PROMPT = (
    "A mixture of experts model keeps many small feed-forward networks in every layer and sends each token "
    "to only a few of them, chosen by a router. Most of the weights sit in the experts, so a swarm of "
    "ordinary devices can hold them between them while one coordinator runs the attention and the router. "
)


def prepare(
    model: str, layers: int, workdir: Path, experts: int | None = None, vocab: int | None = None,
    dense: str = "Q8_0",
) -> tuple[Path, Path]:  # fmt: skip
    """The synthesized GGUF and its shard directory (reused when already in workdir: synth is deterministic).
    `experts` / `vocab`: fewer experts a layer than the real model (where disk and memory do not hold all of
    them at the real depth) and the real vocabulary's size (the output head is part of the dense cost);
    `dense`: the dense tensors' type (synth's --dense-type: Q4_K_M the mixture llama.cpp's quantizer makes)."""
    spec = preset(
        MODELS[model]["preset"], n_layers=layers, experts_type="Q4_K", dense_type=dense, n_expert=experts,
        n_vocab=vocab,
    )  # fmt: skip
    tag = f"{model}-{layers}l" + (f"-{experts}e" if experts else "") + (f"-v{vocab}" if vocab else "")
    kind = "q4k-" + dense.lower().replace("_", "")
    gguf = workdir / f"{tag}-{kind}.gguf"
    shard_dir = workdir / f"{tag}-{kind}.swarm"
    if not gguf.exists():
        log.info("synthesizing %s ...", gguf.name)
        synthesize(gguf, spec)
        shutil.rmtree(shard_dir, ignore_errors=True)
    if not (shard_dir / "manifest.json").exists():
        log.info("sharding into %s ...", shard_dir.name)
        shard_model(gguf, shard_dir, progress=False)
    return gguf, shard_dir


def prompt_tokens(engine: Engine, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += engine.tokenizer.encode(PROMPT)
    return ids[:n]
