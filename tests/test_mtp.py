"""The MTP head's drafts against llama.cpp's own MTP (tests/fixtures/mtp, see its README): teacher-forced
through the drafter's API with our trunk's hidden rows, the drafts and 3-token chains are llama.cpp's, the
head's h_mtp and logits are close to its; the catch-up in windows of several tokens, several sequences in one
step and a checkpoint taken back change nothing; through three nodes the drafts are the in-process ones bit
for bit; a file without an MTP block asked for one says so."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from conftest import FIXTURES
from gguf import GGMLQuantizationType

from swarm.coordinator.cli import main
from swarm.coordinator.cli.spawn import start_nodes, stop_nodes
from swarm.coordinator.config import EngineConfig
from swarm.coordinator.decode.one import forward_one
from swarm.coordinator.drafts.mtp import MTPDrafter
from swarm.coordinator.engine import Engine, open_engine
from swarm.coordinator.experts.backend import ExpertBackend, PendingExperts
from swarm.coordinator.experts.remote.dispatch import SwarmExperts
from swarm.coordinator.models.base import Batch
from swarm.coordinator.models.linear import GGMLMatrix
from swarm.coordinator.models.mtp import MTPHead
from swarm.proto.numerics import Numerics
from swarm.sharding.errors import UserError
from swarm.sharding.gguf_io import GGUFError
from swarm.sharding.shard import shard_model
from swarm.sharding.slabs import read_manifest
from swarm.sharding.synth import synthesize
from swarm.sharding.synth_spec import preset

Q8_0, F32 = int(GGMLQuantizationType.Q8_0), int(GGMLQuantizationType.F32)

MODEL = FIXTURES / "qwen35moe-tiny"
REFS = FIXTURES / "mtp"
VARIANTS = ("f32", "bf16")
# bf16: llama.cpp rounds the matmuls' activations to bf16 and our trunk's h differs from its by up to 4e-3, so
# a draft may differ where the reference's two highest logits are closer than this (the README: gaps down
# to 2.5e-4); every other draft must be equal. f32 drafts must all be equal (the smallest gap is 1.7e-3).
NEAR_TIE = 1e-2


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, Engine]]:
    opened = {v: open_engine(MODEL / f"model-{v}.gguf", EngineConfig(local=True, device="cpu", mtp_head=True)) for v in VARIANTS}
    yield opened
    for e in opened.values():
        e.close()


def _refs(variant: str) -> np.lib.npyio.NpzFile:
    return np.load(REFS / f"qwen35moe-tiny-{variant}.npz", allow_pickle=False)


def _trunk_h(engine: Engine, tokens: np.ndarray) -> torch.Tensor:
    """Our trunk's h rows (after output_norm) of a whole sequence, in one pass."""
    _, h = engine.model(
        torch.tensor(tokens, dtype=torch.long), [engine.model.new_state()], [len(tokens)], hidden=True
    )
    return h


def _cut(n: int, first: int, sizes: list[int]) -> list[int]:
    """Windows of a sequence of n tokens: `first` tokens, then `sizes` over and over; the last window ends at
    n, so that every step but the last has a token after it to draft from."""
    out, j = [first], 0
    while sum(out) < n:
        out.append(min(sizes[j % len(sizes)], n - sum(out)))
        j += 1
    return out


def _forced(
    drafter: MTPDrafter, seqs: list[tuple[np.ndarray, torch.Tensor]], windows: list[list[int]], k: int = 3
) -> list[dict[int, tuple[tuple[int, ...], tuple[float, ...]]]]:
    """Teacher-forced steps of several sequences together: in step j sequence i commits windows[i][j] more
    of its tokens (the seed of the step before among them) and drafts from the token after them. -> per
    sequence, position of the seed -> (drafts, their top-10 probabilities)."""
    states = [drafter.new_state() for _ in seqs]
    done = [0] * len(seqs)
    got: list[dict[int, tuple[tuple[int, ...], tuple[float, ...]]]] = [{} for _ in seqs]
    for j in range(max(len(w) for w in windows)):
        live = [i for i, w in enumerate(windows) if j < len(w)]
        ends = [done[i] + windows[i][j] for i in live]
        lasts = [int(seqs[i][0][e]) if e < len(seqs[i][0]) else None for i, e in zip(live, ends, strict=True)]
        drafts = drafter.step(
            [states[i] for i in live],
            [seqs[i][0][done[i] : e].tolist() for i, e in zip(live, ends, strict=True)],
            [done[i] for i in live],
            [seqs[i][1][done[i] : e] for i, e in zip(live, ends, strict=True)],
            lasts,
            k,
        )
        for n, (i, e) in enumerate(zip(live, ends, strict=True)):
            if lasts[n] is not None:
                got[i][e] = (drafts[n], drafter.confidence[n])
            done[i] = e
    return got


def _check_chains(variant: str, refs: np.lib.npyio.NpzFile, i: int, got: dict) -> int:
    """Each drafted chain against the reference's; -> how many drafts were let differ at a near-tie."""
    ties = 0
    for p, (chain, conf) in got.items():
        want = refs[f"chain_{i}"][p].tolist()
        gaps = refs[f"chain_top5_logit_{i}"][p][:, 0] - refs[f"chain_top5_logit_{i}"][p][:, 1]
        for step, (a, b) in enumerate(zip(chain, want, strict=True)):
            if a != b:
                assert variant == "bf16" and gaps[step] < NEAR_TIE, (
                    f"prompt {i} position {p} chain step {step}: drafted {a}, llama.cpp {b} "
                    f"(its top-2 gap {gaps[step]:.2e})"
                )
                ties += 1
                break  # the chain goes on from another token
            tol = 1e-4 if variant == "f32" else 2e-2
            assert conf[step] == pytest.approx(refs[f"chain_p_top10_{i}"][p][step], abs=tol)
        if p < len(refs[f"draft_{i}"]) and chain[0] == refs[f"draft_{i}"][p]:
            continue
        assert variant == "bf16" and gaps[0] < NEAR_TIE, f"prompt {i} position {p}: first draft differs"
    return ties


@pytest.mark.parametrize("variant", VARIANTS)
def test_drafts_and_chains_are_llama_cpps(engines: dict[str, Engine], variant: str) -> None:
    """Four sequences in one step each time, one token committed a step: every position's 3-chain."""
    engine, refs = engines[variant], _refs(variant)
    assert engine.mtp_head is not None
    seqs = []
    for i in range(4):
        tokens = refs[f"tokens_{i}"]
        h = _trunk_h(engine, tokens)
        # our trunk is what the drafts read; it is llama.cpp's within the numerics' noise
        assert torch.allclose(
            h, torch.from_numpy(refs[f"tgt_h_{i}"]), atol=1e-4 if variant == "f32" else 1e-2
        )
        seqs.append((tokens, h))
    got = _forced(MTPDrafter(engine.mtp_head, k=3), seqs, [_cut(len(t), 0, [1]) for t, _ in seqs])
    ties = 0
    for i in range(4):
        assert sorted(got[i]) == list(range(len(seqs[i][0])))
        ties += _check_chains(variant, refs, i, got[i])
    assert ties <= (0 if variant == "f32" else 2), f"{ties} drafts differ at near-ties"


@pytest.mark.parametrize("variant", VARIANTS)
def test_head_rows_are_close_to_llama_cpps(engines: dict[str, Engine], variant: str) -> None:
    """Each whole sequence through the head in one pass, every row's output (llama.cpp's batched decode):
    h_mtp, the top-5 logits and the log-sum-exp of every row, and its draft."""
    engine, refs = engines[variant], _refs(variant)
    head = engine.mtp_head
    assert isinstance(head, MTPHead)
    tol = 1e-4 if variant == "f32" else 0.1
    for i in range(4):
        tokens = refs[f"tokens_{i}"]
        h = _trunk_h(engine, tokens)
        paired = torch.cat([torch.zeros(1, h.shape[1]), h[:-1]])
        n = len(tokens)
        state = head.new_state()
        batch = Batch((n,), (0,), torch.arange(n))
        with torch.inference_mode():
            h_mtp, logits = head(torch.tensor(tokens), paired, batch, [state.kv], torch.arange(n))
        assert state.length == n
        np.testing.assert_allclose(h_mtp.numpy(), refs[f"mtp_h_{i}"], atol=1e-4 if variant == "f32" else 0.05)
        top = torch.topk(logits, 5, dim=-1).values.numpy()
        np.testing.assert_allclose(top, refs[f"draft_top5_logit_{i}"], atol=tol)
        np.testing.assert_allclose(torch.logsumexp(logits, -1).numpy(), refs[f"draft_lse_{i}"], atol=tol)
        gaps = refs[f"draft_top5_logit_{i}"][:, 0] - refs[f"draft_top5_logit_{i}"][:, 1]
        same = logits.argmax(-1).numpy() == refs[f"draft_{i}"]
        assert (same | (gaps < NEAR_TIE) if variant == "bf16" else same).all()


def test_windows_of_several_tokens_and_a_taken_back_step_change_nothing(engines: dict[str, Engine]) -> None:
    """The prompt caught up in one step, then windows of 1-4 tokens (what verify passes commit), give the
    same drafts as a token a step, bit for bit; a step taken back with checkpoint/restore leaves no trace."""
    engine, refs = engines["f32"], _refs("f32")
    assert engine.mtp_head is not None
    drafter = MTPDrafter(engine.mtp_head, k=3)
    seqs = [(refs[f"tokens_{i}"], _trunk_h(engine, refs[f"tokens_{i}"])) for i in range(4)]
    one = _forced(drafter, seqs, [_cut(len(t), 0, [1]) for t, _ in seqs])
    # the prompt less its last token (llama.cpp's prefill), then windows of 1-4 tokens, a pattern per sequence
    windows = [
        _cut(len(t), len(t) - 17, [1, 2, 3, 4][i:] + [1, 2, 3, 4][:i]) for i, (t, _) in enumerate(seqs)
    ]
    several = _forced(drafter, seqs, windows)
    for i in range(4):
        assert several[i] and all(one[i][p] == d for p, d in several[i].items())

    tokens, h = seqs[0]
    state = drafter.new_state()
    drafter.step([state], [tokens[:10].tolist()], [0], [h[:10]], [None])
    cp = state.checkpoint()
    drafter.step([state], [[7, 8, 9]], [10], [torch.randn(3, h.shape[1])], [11])
    state.restore(cp)
    after = drafter.step([state], [tokens[10:12].tolist()], [10], [h[10:12]], [int(tokens[12])])
    assert after[0] == one[0][12][0]
    with pytest.raises(ValueError, match="holds 12 positions"):
        drafter.step([state], [[1]], [11], [h[:1]], [None])


class _Counting:
    """Passes the work on, counting each fan-out (start) of the MTP layer and its rows."""

    def __init__(self, inner: ExpertBackend, layer: int) -> None:
        self.inner, self.layer = inner, layer
        self.calls: list[int] = []  # rows of each fan-out
        self.pairs: list[int] = []  # (row, expert) pairs of each

    def stack(self, layer: int, ids: torch.Tensor) -> None:
        return None  # every fan-out goes through start()

    def start(self, layer: int, x: torch.Tensor, ids: torch.Tensor) -> PendingExperts:
        if layer == self.layer:
            self.calls.append(int(ids.shape[0]))
            self.pairs.append(int(ids.numel()))
        return self.inner.start(layer, x, ids)


def test_one_fan_out_per_pass_for_every_sequence(engines: dict[str, Engine]) -> None:
    """Catch-up rows of three sequences and their seed rows: one fan-out of the seed rows only (the catch-up
    rows only fill the caches); then one fan-out per chain step. The warm-up sends every expert one row."""
    engine = engines["f32"]
    head = engine.mtp_head
    assert head is not None
    counting = _Counting(engine.experts, head.layer)
    head.set_experts(counting)
    try:
        drafter = MTPDrafter(head, k=3)
        states = [drafter.new_state() for _ in range(3)]
        h = torch.randn(9, 64)
        drafts = drafter.step(states, [[5, 6, 7], [8, 9], [10, 11, 12, 13]], [0, 0, 0],
                              [h[:3], h[3:5], h[5:9]], [20, 21, None])  # fmt: skip
        head.warm_up()  # one row, every expert of the layer
    finally:
        head.set_experts(engine.experts)
    assert [len(d) for d in drafts] == [3, 3, 0]
    assert counting.calls == [2, 2, 2, 1] and counting.pairs[-1] == head.block.moe.cfg.n_expert
    assert [s.length for s in states] == [3, 2, 4]


def test_p_min_ends_a_chain(engines: dict[str, Engine]) -> None:
    """A draft whose top-10 probability is below p_min is not drafted, and ends the chain."""
    engine, refs = engines["f32"], _refs("f32")
    assert engine.mtp_head is not None
    tokens = refs["tokens_0"]
    h = _trunk_h(engine, tokens)
    conf = refs["chain_p_top10_0"]
    p = next(p for p in range(len(tokens)) if conf[p][0] > conf[p][1] + 0.02)
    for p_min, want in ((float(conf[p][0] + conf[p][1]) / 2, refs["chain_0"][p][:1]), (1.0, [])):
        drafter = MTPDrafter(engine.mtp_head, k=3, p_min=p_min)
        state = drafter.new_state()
        got = drafter.step([state], [tokens[:p].tolist()], [0], [h[:p]], [int(tokens[p])])
        assert got == [tuple(int(t) for t in want)]
        assert state.length == p


def test_a_file_without_an_mtp_block_says_so() -> None:
    with pytest.raises(GGUFError, match="has no MTP block"):
        open_engine(FIXTURES / "qwen35moe-quant" / "model-q4_k_m.gguf", EngineConfig(local=True, device="cpu", mtp_head=True))
    with pytest.raises(GGUFError, match="no MTP head"):
        open_engine(FIXTURES / "qwen3moe-tiny" / "model-f32.gguf", EngineConfig(local=True, device="cpu", mtp_head=True))


def test_a_quantized_mtp_block_is_multiplied_in_its_file_types(tmp_path) -> None:
    """A qwen35moe with Q8_0 dense matrices and Q4_K experts: in native numerics the head's matrices stay in
    the file's types (ggml multiplies them as llama.cpp does), and both numerics draft from the same rows
    within the quantization's noise."""
    path = synthesize(tmp_path / "q.gguf", preset("qwen35moe-tiny", mtp=1, dense_type="Q8_0"))
    tokens = torch.arange(30) * 7 + 3
    out = {}
    for numerics in (Numerics.NATIVE, Numerics.EXACT):
        engine = open_engine(path, EngineConfig(local=True, device="cpu", numerics=numerics, mtp_head=True))
        try:
            head = engine.mtp_head
            assert head is not None
            matrix = head.nextn.eh_proj.matrix
            assert isinstance(matrix, GGMLMatrix)
            assert matrix.weight.qtype == (Q8_0 if numerics == Numerics.NATIVE else F32)
            if not out:  # both heads read the same hidden rows: what differs is the head's own numerics
                _, h = engine.model(tokens, [engine.model.new_state()], [30], hidden=True)
            paired = torch.cat([torch.zeros(1, h.shape[1]), h[:-1]])
            with torch.inference_mode():
                out[numerics] = head(tokens, paired, Batch((30,), (0,), torch.arange(30)), [head.new_state().kv],
                                     torch.arange(30))  # fmt: skip
            drafter = MTPDrafter(head)
            assert (
                len(drafter.step([drafter.new_state()], [tokens[:20].tolist()], [0], [h[:20]], [20])[0]) == 3
            )
        finally:
            engine.close()
    native, exact = out[Numerics.NATIVE], out[Numerics.EXACT]
    assert 0 < (native[1] - exact[1]).abs().max() < 0.5
    assert (native[1].argmax(-1) == exact[1].argmax(-1)).float().mean() > 0.8


@pytest.mark.slow
def test_drafts_through_three_nodes_are_the_in_process_ones(tmp_path, engines: dict[str, Engine]) -> None:
    """A shard directory (its dense file holds the MTP block, its slabs layer 4's experts), three nodes each
    holding a third of the experts: the head's rows and the drafts of every position are the in-process ones
    bit for bit."""
    shard_dir = tmp_path / "m.swarm"
    shard_model(MODEL / "model-f32.gguf", shard_dir)
    manifest = read_manifest(shard_dir)
    assert 4 in manifest.moe_layers
    n = manifest.n_expert
    cuts = [0, n // 3, 2 * n // 3, n]
    nodes = start_nodes([(shard_dir, ["--no-mdns", "--experts", f"{cuts[i]}-{cuts[i + 1] - 1}"]) for i in range(3)],
                        tmp_path / "nodes")  # fmt: skip
    local = open_engine(shard_dir, EngineConfig(local=True, device="cpu", mtp_head=True))
    swarm = None
    try:
        swarm = open_engine(
            shard_dir, EngineConfig(peers=tuple(x.address for x in nodes), mdns=False, device="cpu", mtp_head=True))
        refs = _refs("f32")
        seqs = [(refs[f"tokens_{i}"], _trunk_h(local, refs[f"tokens_{i}"])) for i in range(4)]
        windows = [_cut(len(t), 0, [1, 3, 2]) for t, _ in seqs]
        outs = []
        assert isinstance(swarm.experts, SwarmExperts) and swarm.mtp_head is not None
        counting = _Counting(swarm.experts, swarm.mtp_head.layer)  # the MTP layer's fan-outs do go to the nodes
        swarm.mtp_head.set_experts(counting)
        outs = []
        for engine in (local, swarm):
            head = engine.mtp_head
            assert head is not None
            outs.append(_forced(MTPDrafter(head, k=3), seqs, windows))
            tokens, h = seqs[1]
            n = len(tokens)
            paired = torch.cat([torch.zeros(1, 64), h[:-1]])
            with torch.inference_mode():
                rows = head(torch.tensor(tokens), paired, Batch((n,), (0,), torch.arange(n)), [head.new_state().kv],
                            torch.arange(n))  # fmt: skip
            outs.append(rows)
        assert counting.calls
        assert outs[0] == outs[2] and all(len(d) for d in outs[0])
        assert torch.equal(outs[1][0], outs[3][0]) and torch.equal(outs[1][1], outs[3][1])
    finally:
        if swarm is not None:
            swarm.close()
        local.close()
        stop_nodes(nodes)


def test_nodes_without_the_mtp_layer_serve_a_run_without_drafts(tmp_path, capsys) -> None:
    """The MTP block's experts are asked for only with --mtp: a swarm holding the main layers alone runs the
    model (the logits the in-process run gives), refuses --mtp naming the layer it lacks, and `swarm status`
    calls it covered, naming what --mtp would need."""
    shard_dir = tmp_path / "m.swarm"
    shard_model(MODEL / "model-f32.gguf", shard_dir)
    (node,) = start_nodes([(shard_dir, ["--no-mdns", "--layers", "0-3"])], tmp_path / "nodes")
    local = open_engine(shard_dir, EngineConfig(local=True, device="cpu"))
    assert {layer for layer, _ in local.experts.store.held()} == {0, 1, 2, 3}  # (in process too)
    try:
        swarm = open_engine(shard_dir, EngineConfig(peers=(node.address,), mdns=False, device="cpu", wait=0.5))
        try:
            tokens = _refs("f32")["tokens_0"].tolist()
            got, expect = (forward_one(e.model, tokens, e.model.new_state(), "cpu") for e in (swarm, local))
            assert torch.equal(got, expect)
        finally:
            swarm.close()
        with pytest.raises(UserError, match="layer 4"):
            open_engine(shard_dir, EngineConfig(peers=(node.address,), mdns=False, device="cpu", mtp_head=True, wait=0.5))
        capsys.readouterr()
        assert main(["status", str(shard_dir), "--no-mdns", "--peer", node.address]) == 0  # it can run
        out = capsys.readouterr().out
        assert "every expert a run without --mtp uses" in out and "has a holder" in out, out
        assert "for --mtp (the MTP block's layer" in out and "no node holds layer 4: experts 0-31" in out, out
    finally:
        local.close()
        stop_nodes([node])
