"""A sequence's bits do not depend on how its tokens are split into calls, nor on the other sequences
sharing a call: one pass over a prompt, chunks of it, a token at a time (decode), or chunks read beside
other sequences' decode steps all give the same logits, in both numerics. `swarm serve` builds on this:
prompts are read in chunks between other requests' decode steps, and a resent conversation continues
from its held state instead of a fresh read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from swarm.compute.slabs import load_slabs
from swarm.compute.store import ExpertStore
from swarm.coordinator.config import Wire
from swarm.coordinator.experts.backend import LocalExperts
from swarm.coordinator.loader import load_model

FIXTURES = Path(__file__).parent / "fixtures"
MODELS = [
    "qwen35moe-quant/model-q4_k_m.gguf",
    "qwen35moe-tiny/model-bf16.gguf",
    "qwen3next-tiny/model-f32.gguf",
    "qwen2moe-tiny/model-f32.gguf",
    "qwen3moe-tiny/model-f32.gguf",
]


def open_model(path: Path, numerics: str):  # noqa: ANN201
    loaded = load_slabs(path)
    experts = LocalExperts(ExpertStore(loaded.slabs, torch.device("cpu"), 1 << 30), Wire.F32, numerics)
    model, _ = load_model(path, experts, torch.device("cpu"), numerics=numerics)
    return model


def feed(model, tokens: list[int], split: list[int]) -> torch.Tensor:  # noqa: ANN001
    state, outs, i = model.new_state(), [], 0
    for n in split:
        outs.append(model(torch.tensor(tokens[i : i + n]), [state], [n]))
        i += n
    assert i == len(tokens)
    return torch.cat(outs)


@pytest.mark.parametrize("numerics", ["native", "exact"])
@pytest.mark.parametrize("name", MODELS)
def test_any_split_of_a_sequence_gives_its_bits(name: str, numerics: str) -> None:
    model = open_model(FIXTURES / name, numerics)
    tokens = [int(t) for t in np.load(FIXTURES / name.split("/")[0] / "reference.npz")["tokens_1"]]
    t = len(tokens)
    whole = feed(model, tokens, [t])
    for split in ([1] * t, [7] * (t // 7) + [t % 7], [3, t - 3], [t - 1, 1]):
        split = [n for n in split if n]
        got = feed(model, tokens, split)
        assert torch.equal(got, whole), (
            f"{name} {numerics}: split {split[:5]}...: max |diff| {(got - whole).abs().max()}"
        )


@pytest.mark.parametrize("numerics", ["native", "exact"])
def test_a_chunk_read_beside_decode_steps_gives_each_sequence_its_bits(numerics: str) -> None:
    """Sequence A's prompt is read in chunks in the same calls as B's and C's decode steps: every sequence
    gets the logits it gets alone."""
    name = "qwen35moe-quant/model-q4_k_m.gguf"
    model = open_model(FIXTURES / name, numerics)
    ref = np.load(FIXTURES / "qwen35moe-quant" / "reference.npz")
    a = [int(x) for x in ref["tokens_1"]]  # 40 tokens, read 16 at a time
    b = [int(x) for x in ref["tokens_0"]]
    c = [int(x) for x in ref["tokens_3"]]
    alone = {k: feed(model, seq, [len(seq) - 3, 1, 1, 1]) for k, seq in (("b", b), ("c", c))}
    alone["a"] = feed(model, a, [len(a)])

    sa, sb, sc = model.new_state(), model.new_state(), model.new_state()
    got = {"a": [], "b": [], "c": []}
    got["b"].append(model(torch.tensor(b[:-3]), [sb], [len(b) - 3]))
    got["c"].append(model(torch.tensor(c[:-3]), [sc], [len(c) - 3]))
    chunks = [a[0:16], a[16:32], a[32:40]]
    for step, chunk in enumerate(chunks):
        tb, tc = b[len(b) - 3 + step], c[len(c) - 3 + step]
        out = model(torch.tensor([tb, *chunk, tc]), [sb, sa, sc], [1, len(chunk), 1])
        got["b"].append(out[:1])
        got["a"].append(out[1 : 1 + len(chunk)])
        got["c"].append(out[1 + len(chunk) :])
    for k in "abc":
        assert torch.equal(torch.cat(got[k]), alone[k]), f"sequence {k} ({numerics}) differs from alone"
