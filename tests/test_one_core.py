"""`swarm run`, `swarm logits` and `swarm serve` are clients of one decode core: for the same prompt and seed
they give the same tokens, drafts on or off, in process and through nodes.

`swarm run` prints text; the tokens behind it are those of decode/one.py's generate (the function it calls),
whose decoded text must be what the command printed. `swarm logits` over the prompt and those tokens gives
the rows each token was drawn from: the sampler, keyed by (seed, position), draws every token again from
them. `swarm serve` answers the same prompt and seed over HTTP with the same text."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from conftest import FIXTURES, node_swarm

from swarm.coordinator.cli import main
from swarm.coordinator.cli.launch import spawn_server
from swarm.coordinator.config import EngineConfig
from swarm.coordinator.decode.core import DecodeCore, StopStrings
from swarm.coordinator.decode.one import generate
from swarm.coordinator.decode.sampling import Sampler, SamplingParams
from swarm.coordinator.drafts.lookup import PromptLookup
from swarm.coordinator.engine import open_engine

MODEL = FIXTURES / "qwen35moe-quant" / "model-q4_k_m.gguf"
# repeats itself, so that prompt lookup finds drafts
PROMPT = "def add(a, b): return a + b\ndef add(a, b): return a + b\ndef add(a,"
TEMPERATURE, SEED, MAX_TOKENS = 0.7, 11, 24

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory):
    with node_swarm(MODEL, tmp_path_factory.mktemp("one-core"), ["0-3", "4-7"]) as found:
        yield found


@pytest.mark.parametrize("where", ["in-process", "nodes"])
def test_run_logits_and_serve_give_the_same_tokens(where: str, swarm, tmp_path: Path, capsys) -> None:
    shard, peers = swarm
    source, flags = (MODEL, ["--local"]) if where == "in-process" else (shard, ["--no-mdns", *peers])
    sampling = ["--temperature", str(TEMPERATURE), "--seed", str(SEED), "--max-tokens", str(MAX_TOKENS)]

    # the tokens, from the function `swarm run` calls, on the same engine
    config = (
        EngineConfig(local=True)
        if where == "in-process"
        else EngineConfig(peers=tuple(peers[1::2]), mdns=False)
    )
    engine = open_engine(source, config)
    try:
        prompt = engine.tokenizer.encode(PROMPT, parse_special=False)
        params = SamplingParams(MAX_TOKENS, TEMPERATURE, seed=SEED, stop_ids=engine.tokenizer.eos_ids)
        tokens = list(generate(engine.model, prompt, params, engine.device, checker=engine.checker))
        drafted = list(
            generate(
                engine.model, prompt, params, engine.device, checker=engine.checker, drafter=PromptLookup(3)
            )
        )
        assert drafted == tokens
        text = engine.tokenizer.decode([t for t in tokens if t not in params.stop_ids], skip_control=True)
    finally:
        engine.close()
    assert len(set(tokens)) > 3, "it samples"

    # swarm run, drafts off and on
    for draft in ("none", "ngram"):
        assert main(["run", str(source), "--prompt", PROMPT, *sampling, "--draft", draft, *flags]) == 0
        assert capsys.readouterr().out == text + "\n", f"swarm run --draft {draft}"

    # swarm logits over the prompt and the tokens: each token drawn again from its row
    out = tmp_path / "logits.npy"
    ids = ",".join(str(t) for t in prompt + tokens[:-1])
    assert main(["logits", str(source), "--tokens", ids, "-o", str(out), *flags]) == 0
    rows = torch.from_numpy(np.load(out))
    sampler = Sampler(params)
    redrawn = [sampler(rows[len(prompt) - 1 + i], len(prompt) + i) for i in range(len(tokens))]
    assert redrawn == tokens

    # swarm serve, drafts off and on
    for draft in ("none", "ngram"):
        server = spawn_server(
            source, [*flags, "--draft", draft, "--model-id", "m"], tmp_path, f"serve-{draft}"
        ).wait_ready(120)
        try:
            c = openai.OpenAI(base_url=server.ready["url"], api_key="-", max_retries=0)
            r = c.completions.create(
                model="m", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=TEMPERATURE, seed=SEED
            )
            assert r.choices[0].text == text, f"swarm serve --draft {draft}"
            assert r.usage is not None and r.usage.completion_tokens == len(tokens)
        finally:
            assert server.stop() == 0, server.log_tail()


def test_the_cores_hooks_a_logits_processor_and_stop_strings() -> None:
    """What the next front ends build on: a processor sees each row before its token is picked (here it
    bans the token greedy decoding picks first), and a stop string ends a conversation at the token that
    completes it."""
    engine = open_engine(MODEL, EngineConfig(local=True, device="cpu"))
    try:
        tok = engine.tokenizer
        prompt = tok.encode(PROMPT, parse_special=False)
        params = SamplingParams(max_tokens=12, stop_ids=frozenset())
        plain = list(generate(engine.model, prompt, params, "cpu"))
        seen: list[int] = []

        def ban(logits: torch.Tensor, position: int, before: list[int]) -> torch.Tensor:
            assert before == [*prompt, *banned_so_far(position)]
            seen.append(position)
            out = logits.clone()
            out[plain[0]] = float("-inf")
            return out

        picked: list[int] = []

        def banned_so_far(position: int) -> list[int]:
            return picked[: position - len(prompt)]

        def keep(logits: torch.Tensor, position: int, before: list[int]) -> torch.Tensor:
            return logits

        banned = []
        for t in generate(engine.model, prompt, params, "cpu", processors=(ban, keep)):
            banned.append(t)
            picked.append(t)
        assert plain[0] not in banned and len(banned) == 12
        assert seen == list(range(len(prompt), len(prompt) + 12))  # one row per token, in position order

        k = next(i for i in range(1, 12) if tok.decode(plain[i : i + 1], skip_control=True).strip())
        stop = tok.decode(plain[k : k + 1], skip_control=True).strip()
        core = DecodeCore(engine.model, "cpu")
        conv = core.open(prompt, params, stop_text=StopStrings(tok.stream(skip_control=True), [stop]))
        while conv.finish is None:
            core.step(core.plan([conv])[0])
            core.collect(conv)
        assert conv.finish == "stop" and conv.out == plain[: len(conv.out)]
        assert stop in tok.decode(conv.out, skip_control=True)
        assert stop not in tok.decode(conv.out[:-1], skip_control=True)
    finally:
        engine.close()


def test_a_stop_string_is_found_across_the_pieces_that_bring_it() -> None:
    class Pieces:
        def push(self, token: int) -> str:
            return ["ab", "cd", "e", "xyz"][token]

    stop = StopStrings(Pieces(), ["bcde"])
    assert [stop.push(t) for t in range(4)] == [False, False, True, False]
    assert len(stop.tail) <= 3  # what a stop string could still end in, not the whole text
    assert stop.found == "bcde"
    first = StopStrings(Pieces(), ["de", "cd"])
    assert [first.push(t) for t in range(3)] == [False, True, True] and first.found == "de"
    assert not StopStrings(Pieces(), []).push(0)
