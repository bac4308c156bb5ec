"""Checking windows: a decode step that carries drafts checks them all in one pass, and the text is the text
of decoding one token a pass, whatever the drafts were (all right, all wrong, from the conversation), greedy
and sampled with a seed, in both numerics, in process and through nodes, when a node dies in the middle of a
window and when a lying node is caught and the passes are done again."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from conftest import FIXTURES

from swarm.coordinator.cli.spawn import start_nodes, stop_nodes
from swarm.coordinator.config import EngineConfig
from swarm.coordinator.decode.one import GenerationStats, SamplingParams, generate
from swarm.coordinator.drafts.lookup import PromptLookup, Scripted
from swarm.coordinator.engine import open_engine
from swarm.coordinator.experts.remote.discovery import connect
from swarm.proto.numerics import Numerics
from swarm.sharding.shard import shard_model
from swarm.sharding.slabs import read_manifest, slabs_from_shard

# a prompt that repeats itself, so that prompt lookup finds drafts
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20] * 3 + [11, 12, 13]
GREEDY = SamplingParams(max_tokens=14)
SAMPLED = SamplingParams(max_tokens=14, temperature=0.9, top_k=40, seed=1234)


class Wrong:
    """Drafts that are all wrong: the known text's next tokens, each moved to another id."""

    def __init__(self, text: Sequence[int], k: int = 3) -> None:
        self.right = Scripted(tuple(text), k)

    def __call__(self, tokens: Sequence[int]) -> Sequence[int]:
        return [(t + 1) % 200 + 3 for t in self.right(tokens)]


def _run(model, params: SamplingParams, drafter=None, checker=None) -> tuple[list[int], GenerationStats]:  # noqa: ANN001
    stats = GenerationStats()
    return list(generate(model, PROMPT, params, "cpu", stats, checker=checker, drafter=drafter)), stats


@pytest.mark.parametrize(
    ("name", "file", "numerics", "ks"),
    [
        ("qwen35moe-tiny", "model-f32.gguf", Numerics.NATIVE, (1, 3)),
        ("qwen35moe-quant", "model-q4_k_m.gguf", Numerics.NATIVE, (2,)),
        ("qwen35moe-quant", "model-q4_k_m.gguf", Numerics.EXACT, (3,)),
        ("qwen3next-tiny", "model-f32.gguf", Numerics.NATIVE, (2,)),
        ("qwen3moe-tiny", "model-f32.gguf", Numerics.NATIVE, (3,)),
    ],
)
def test_windows_give_the_text_of_one_token_a_pass(
    name: str, file: str, numerics: Numerics, ks: tuple[int, ...]
) -> None:
    engine = open_engine(FIXTURES / name / file, EngineConfig(local=True, device="cpu", numerics=numerics))
    try:
        for params in (GREEDY, SAMPLED):
            plain, _ = _run(engine.model, params)
            text = (*PROMPT, *plain)
            for k in ks:
                right, stats = _run(engine.model, params, Scripted(text, k))
                assert right == plain, f"{params}, {k} drafts known to be right"
                # every draft kept: a window yields k + 1 tokens, so the passes after the prompt's are fewer
                assert stats.extra["accepted"] == stats.extra["drafted"] > 0
                assert stats.extra["windows"] <= -(-(len(plain) - 1) // (k + 1))
                wrong, stats = _run(engine.model, params, Wrong(text, k))
                assert wrong == plain, f"{params}, {k} drafts all wrong"
                assert stats.extra["accepted"] == 0 and stats.extra["drafted"] > 0
            if (
                params is GREEDY
            ):  # drafts from the conversation: right where the text repeats, wrong elsewhere
                assert _run(engine.model, params, PromptLookup(3))[0] == plain, "prompt lookup"
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("numerics", [Numerics.NATIVE, Numerics.EXACT])
def test_windows_through_three_nodes_and_a_node_killed_in_a_window(tmp_path, numerics: Numerics) -> None:
    """Three nodes, each expert on two of them: windows through the swarm give the in-process text of one
    token a pass; then a node is killed while windows go on, and the text is still the same."""
    shard_dir = tmp_path / "m.swarm"
    shard_model(FIXTURES / "qwen35moe-quant" / "model-q4_k_m.gguf", shard_dir)
    manifest = read_manifest(shard_dir)
    n = manifest.n_expert
    ranges = [f"0-{2 * n // 3 - 1}", f"{n // 3}-{n - 1}", f"{2 * n // 3}-{n - 1},0-{n // 3 - 1}"]
    nodes = start_nodes([(shard_dir, ["--no-mdns", "--experts", r]) for r in ranges], tmp_path / "nodes")
    local = open_engine(shard_dir, EngineConfig(local=True, device="cpu", numerics=numerics))
    backend = connect(sorted(slabs_from_shard(shard_dir, verify=False)[0]), manifest.fingerprint, str(shard_dir), EngineConfig(peers=[x.address for x in nodes], mdns=False, timeout=30.0, numerics=numerics))  # fmt: skip
    try:
        for params in (GREEDY, SAMPLED) if numerics is Numerics.NATIVE else (SAMPLED,):
            plain, _ = _run(local.model, params)
            text = (*PROMPT, *plain)
            local.model.set_experts(backend)
            try:
                assert _run(local.model, params, Scripted(text, 3))[0] == plain
                if params is GREEDY:
                    assert _run(local.model, params, PromptLookup(3))[0] == plain
                if params is SAMPLED:  # the node dies after the second window
                    got, calls = [], itertools.count()
                    for token in generate(local.model, PROMPT, params, "cpu", drafter=Scripted(text, 2)):
                        got.append(token)
                        if next(calls) == 5:
                            nodes[1].process.kill()
                    assert got == plain
                    # its calls failed over, or (a busy machine: the dead node's call outlasted its usual time
                    # first) went to a replica as a hedge; either way it is passed over from then on
                    assert backend.failovers + backend.hedge_wins >= 1
                    # it is marked down (passed over for a backoff that grows with its failures in a row, which
                    # only an answer clears); on a busy machine the rest of the text may outlast the first
                    # backoff, and the placement then lists it again until a call to it fails anew
                    assert backend.placement.failures(nodes[1].address) >= 1
            finally:
                local.model.set_experts(local.experts)
    finally:
        backend.close()
        local.close()
        stop_nodes(nodes)


@pytest.mark.slow
def test_a_liar_caught_in_the_middle_of_windows_is_redone_to_the_same_text(tmp_path) -> None:
    """A node whose slabs are damaged after its admission is caught by sampled audits while windows of drafts
    run: the passes since the settled point are done again with their drafts, and the text is the
    in-process text of one token a pass."""
    from test_audit import _swarm, damage, make_rig, read_in_place

    honest_dir, liar_dir, nodes = make_rig(tmp_path)
    n = read_manifest(honest_dir).n_expert
    local = open_engine(honest_dir, EngineConfig(local=True, device="cpu"))
    swarm = _swarm(honest_dir, rate=0.25, seed=3)
    try:
        plain, _ = _run(local.model, SAMPLED)
        _run(swarm.model, SamplingParams(max_tokens=2), checker=swarm.checker)  # both admitted (probed)
        assert not swarm.checker.report.banned
        assert read_in_place(2) and read_in_place(3)
        damage(liar_dir, 2, list(range(n)))
        damage(liar_dir, 3, list(range(n)))
        got, stats = _run(swarm.model, SAMPLED, Scripted((*PROMPT, *plain), 3), checker=swarm.checker)
        assert got == plain
        assert set(swarm.checker.report.banned) == {nodes[1].address}
        assert stats.extra["redone_passes"] >= 1 and stats.extra["accepted"] > 0
    finally:
        swarm.close()
        local.close()
        stop_nodes(nodes)
