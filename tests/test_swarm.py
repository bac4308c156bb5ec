"""The coordinator against real node processes on loopback, found by mDNS.

Swarm logits must be bit-identical to the in-process backend's at the same wire precision (the in-process
backend is checked against transformers and llama.cpp in test_models*.py), and stay so when a node dies
and its experts fail over to a replica.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import FIXTURES
from reference import assert_logits_close

from swarm.compute.store import ROWS_PER_MATMUL, ExpertStore
from swarm.coordinator.cli.spawn import start_nodes
from swarm.coordinator.config import EngineConfig, Wire
from swarm.coordinator.decode.one import forward_one, greedy_trace
from swarm.coordinator.engine import open_engine
from swarm.coordinator.experts.backend import LocalExperts, WithoutExperts
from swarm.coordinator.experts.remote.calls import Part, split_parts
from swarm.coordinator.experts.remote.discovery import connect
from swarm.coordinator.experts.remote.placement import Placement
from swarm.node.auth import KEY_ENV, SwarmKey, generate_key_text
from swarm.sharding.errors import UserError
from swarm.sharding.shard import shard_model
from swarm.sharding.slabs import read_manifest, slabs_from_gguf, slabs_from_shard

LOOPBACK = ["127.0.0.1"]
# This run's swarm key: nodes of another test run on this machine (same fixture models, same fingerprints,
# also on loopback mDNS) have another key, so coordinators here never take them.
KEY_TEXT = generate_key_text()
KEY = SwarmKey.from_text(KEY_TEXT)
KEYED = {KEY_ENV: KEY_TEXT}  # the nodes' environment: the key never goes on a command line
MODELS = ["qwen3moe-tiny", "qwen2moe-tiny", "qwen35moe-tiny", "qwen3next-tiny"]
# A quantized model too (Q4_K/Q6_K experts, Q4_K/Q5_K/Q6_K/Q8_0 dense): there the two numerics differ.
QUANT = "qwen35moe-quant"
FILES = {**{name: "model-f32.gguf" for name in MODELS}, QUANT: "model-q4_k_m.gguf"}


@pytest.fixture(scope="module")
def swarms(tmp_path_factory):
    """Per model: a shard dir and 3 nodes holding disjoint expert ranges (all started at once)."""
    work = tmp_path_factory.mktemp("swarm")
    dirs, specs = {}, []
    for name in FILES:
        d = work / f"{name}.swarm"
        shard_model(FIXTURES / name / FILES[name], d)
        dirs[name] = d
        n = read_manifest(d).n_expert
        cuts = [0, n // 3, 2 * n // 3, n]
        specs += [(d, ["--experts", f"{cuts[i]}-{cuts[i + 1] - 1}"]) for i in range(3)]
    nodes = start_nodes(specs, work / "nodes", env=KEYED)
    yield {name: (dirs[name], nodes[3 * i : 3 * i + 3]) for i, name in enumerate(FILES)}
    for node in nodes:
        node.stop()


def _prompts(name: str) -> tuple[np.lib.npyio.NpzFile, list[list[int]]]:
    ref = np.load(FIXTURES / name / "reference.npz")
    return ref, [ref[f"tokens_{i}"].tolist() for i in range(4)]


def _greedy(engine, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the decode steps' logits, through the decode core and its answer checks."""
    tokens, logits = greedy_trace(engine.model, prompt, steps, "cpu", engine.checker)
    return tokens, logits[1:]


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_swarm_is_bit_identical_to_in_process(swarms, name):
    shard_dir, nodes = swarms[name]
    mine = {n.address for n in nodes}  # other runs' nodes of the same model may be on loopback too
    ref, prompts = _prompts(name)
    swarm = open_engine(shard_dir, EngineConfig(mdns_interfaces=LOOPBACK, wait=10.0, device="cpu", key=KEY))
    local = open_engine(shard_dir, EngineConfig(local=True, device="cpu"))
    try:
        assert mine <= set(swarm.experts.clients), "all three nodes found by mDNS"
        for i, tokens in enumerate(prompts):
            a = forward_one(swarm.model, tokens, swarm.model.new_state(), "cpu")
            b = forward_one(local.model, tokens, local.model.new_state(), "cpu")
            assert torch.equal(a, b), f"prompt {i}: prefill differs, max {float((a - b).abs().max()):.3g}"
            assert_logits_close(a, ref[f"hf_logits_{i}"], f"{name} swarm prompt {i} vs transformers")
        # decode: 16 greedy steps through the KV cache, one fan-out per step
        tokens_s, logits_s = _greedy(swarm, prompts[0], 16)
        tokens_l, logits_l = _greedy(local, prompts[0], 16)
        assert tokens_s == tokens_l == ref["llama_f32_greedy_0"].tolist()
        assert torch.equal(logits_s, logits_l)
        assert sum(swarm.experts.calls_per_node.values()) > 0
        assert mine <= set(swarm.experts.calls_per_node), "every node got calls"
    finally:
        swarm.close()
        local.close()


@pytest.mark.slow
def test_f16_wire_matches_in_process_at_the_same_precision(swarms):
    shard_dir, _ = swarms["qwen3moe-tiny"]
    _, prompts = _prompts("qwen3moe-tiny")
    swarm = open_engine(shard_dir, EngineConfig(mdns_interfaces=LOOPBACK, wait=10.0, wire=Wire.F16, device="cpu", key=KEY))
    local = open_engine(shard_dir, EngineConfig(local=True, wire=Wire.F16, device="cpu"))
    f32 = open_engine(shard_dir, EngineConfig(local=True, device="cpu"))
    try:
        a = forward_one(swarm.model, prompts[1], swarm.model.new_state(), "cpu")
        b = forward_one(local.model, prompts[1], local.model.new_state(), "cpu")
        c = forward_one(f32.model, prompts[1], f32.model.new_state(), "cpu")
        assert torch.equal(a, b)
        assert not torch.equal(a, c), "the f16 wire really rounds"
    finally:
        for e in (swarm, local, f32):
            e.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "numerics"), [("qwen3moe-tiny", "native"), (QUANT, "native"), (QUANT, "exact")]
)
def test_two_sequences_share_one_fan_out_per_layer(swarms, name, numerics):
    """Two sequences in one step: one fan-out per layer, and each sequence's logits are its bits alone."""
    shard_dir, _ = swarms[name]
    _, prompts = _prompts(name)
    swarm = open_engine(
        shard_dir, EngineConfig(mdns_interfaces=LOOPBACK, wait=10.0, device="cpu", key=KEY, numerics=numerics))
    try:
        model = swarm.model
        alone = [forward_one(model, p, model.new_state(), "cpu") for p in prompts[:2]]
        before = sum(swarm.experts.calls_per_node.values())
        ids = torch.tensor(prompts[0] + prompts[1])
        both = model(ids, [model.new_state(), model.new_state()], [len(prompts[0]), len(prompts[1])])
        calls = sum(swarm.experts.calls_per_node.values()) - before
        n_layers = len(model.blk)
        n_nodes = len(swarm.experts.clients)
        assert calls <= n_nodes * n_layers, f"{calls} calls for {n_layers} layers x {n_nodes} nodes"
        assert torch.equal(both, torch.cat(alone)), (
            f"max |diff| {float((both - torch.cat(alone)).abs().max()):.3g}"
        )
        # decode: a step carrying one token of each sequence equals each sequence's own step
        states = [model.new_state(), model.new_state()]
        model(ids, states, [len(prompts[0]), len(prompts[1])])
        step = model(torch.tensor([5, 9]), states, [1, 1])
        for j, (p, t) in enumerate(zip(prompts[:2], (5, 9), strict=True)):
            s = model.new_state()
            model.run(p, s)
            assert torch.equal(step[j], model.run([t], s)[0]), f"decode of sequence {j} differs"
    finally:
        swarm.close()


@pytest.mark.slow
@pytest.mark.parametrize("numerics", ["native", "exact"])
def test_quantized_swarm_is_bit_identical_to_in_process_in_both_numerics(swarms, numerics):
    """Q4_K/Q6_K slabs on 3 nodes: native (ggml on the stored blocks) and exact agree with in-process bit
    for bit, and the two numerics really differ."""
    shard_dir, nodes = swarms[QUANT]
    ref, prompts = _prompts(QUANT)
    kw = {"device": "cpu", "numerics": numerics}
    swarm = open_engine(shard_dir, EngineConfig(mdns_interfaces=LOOPBACK, wait=10.0, key=KEY, **kw))
    local = open_engine(shard_dir, EngineConfig(local=True, **kw))
    try:
        assert {n.address for n in nodes} <= set(swarm.experts.clients)
        for i, tokens in enumerate(prompts):
            a = forward_one(swarm.model, tokens, swarm.model.new_state(), "cpu")
            b = forward_one(local.model, tokens, local.model.new_state(), "cpu")
            assert torch.equal(a, b), f"prompt {i}: max |diff| {float((a - b).abs().max()):.3g}"
        tokens_s, logits_s = _greedy(swarm, prompts[2], 8)
        tokens_l, logits_l = _greedy(local, prompts[2], 8)
        assert tokens_s == tokens_l and torch.equal(logits_s, logits_l)
        if numerics == "exact":
            assert_logits_close(
                a, ref["llama_q4_k_m_deq_logits_3"], "exact swarm vs llama.cpp on dequantized"
            )
        else:
            assert not torch.allclose(a, torch.from_numpy(ref["llama_q4_k_m_deq_logits_3"]), atol=1e-4)
    finally:
        swarm.close()
        local.close()


@pytest.mark.slow
def test_a_dead_node_fails_over_to_a_replica(swarms, tmp_path):
    shard_dir, nodes = swarms["qwen2moe-tiny"]
    _, prompts = _prompts("qwen2moe-tiny")
    manifest = read_manifest(shard_dir)
    slabs, _ = slabs_from_shard(shard_dir)
    local = LocalExperts(ExpertStore(slabs))
    # a fourth node replicating everything, plus the three disjoint ones; then one of those dies
    (replica,) = start_nodes([(shard_dir, ["--no-mdns"])], tmp_path, env=KEYED)
    needed = sorted(slabs)
    backend = connect(needed, manifest.fingerprint, str(shard_dir), EngineConfig(peers=[n.address for n in nodes] + [replica.address], mdns=False, timeout=10.0, key=KEY,
                                   call_bytes=3 * manifest.n_embd * 4))  # 3 rows a call: the dead node's parts go as several calls  # fmt: skip
    try:
        engine = open_engine(shard_dir, EngineConfig(local=True, device="cpu"))
        model = engine.model
        expect = forward_one(model, prompts[0], model.new_state(), "cpu")
        model.set_experts(backend)
        victim = nodes[1]
        victim.process.kill()
        victim.process.wait()
        got = forward_one(model, prompts[0], model.new_state(), "cpu")
        assert torch.equal(got, expect)
        assert backend.failovers >= 1
        assert victim.address not in backend.placement.addresses()
        model.set_experts(local)
    finally:
        backend.close()
        replica.stop()


@pytest.mark.slow
def test_a_long_prompt_goes_to_a_node_as_several_calls(swarms):
    shard_dir, _ = swarms["qwen3moe-tiny"]
    _, prompts = _prompts("qwen3moe-tiny")
    d = read_manifest(shard_dir).n_embd
    five_rows = 5 * d * 4  # 5 f32 rows a call
    swarm = open_engine(
        shard_dir, EngineConfig(mdns_interfaces=LOOPBACK, wait=10.0, device="cpu", key=KEY, call_bytes=five_rows)
    )
    local = open_engine(shard_dir, EngineConfig(local=True, device="cpu"))
    try:
        tokens = prompts[1]  # 40 tokens x K 4 = 160 pairs a layer
        a = forward_one(swarm.model, tokens, swarm.model.new_state(), "cpu")
        b = forward_one(local.model, tokens, local.model.new_state(), "cpu")
        assert torch.equal(a, b)
        calls = sum(swarm.experts.calls_per_node.values())
        assert calls > 2 * 3 * len(swarm.model.blk), f"{calls} calls: not several per node and layer"
    finally:
        swarm.close()
        local.close()


def test_split_parts_keeps_experts_whole_and_cuts_big_ones_at_matmul_blocks():
    def calls(parts, max_rows, unit):
        return [[(p.index, p.start, p.rows) for p in c] for c in split_parts(parts, max_rows, unit)]

    parts = [Part(0, 0, 7), Part(1, 0, 2), Part(2, 0, 4)]
    assert calls(parts, 100, 1024) == [[(0, 0, 7), (1, 0, 2), (2, 0, 4)]]
    assert calls(parts, 5, 1024) == [[(0, 0, 7)], [(1, 0, 2)], [(2, 0, 4)]]  # 7 rows: one block, not cut
    assert calls(parts, 5, 2) == [[(0, 0, 4)], [(0, 4, 3), (1, 0, 2)], [(2, 0, 4)]]
    assert calls([Part(3, 4, 5)], 1, 2) == [[(3, 4, 2)], [(3, 6, 2)], [(3, 8, 1)]]


def test_an_expert_cut_at_matmul_blocks_gives_the_same_bits():
    """What lets a coordinator cut one expert's rows over several calls without changing a bit."""
    slabs = slabs_from_gguf(FIXTURES / "qwen3moe-tiny" / "model-f32.gguf", [0], [5])
    store = ExpertStore(slabs)
    n = 2 * ROWS_PER_MATMUL + 300
    rows = torch.randn(n, store.hidden_size, generator=torch.Generator().manual_seed(0))
    whole = store.compute(0, [5], [n], rows)
    cut = 2 * ROWS_PER_MATMUL
    pieces = torch.cat(
        [store.compute(0, [5], [cut], rows[:cut]), store.compute(0, [5], [n - cut], rows[cut:])]
    )
    assert torch.equal(whole, pieces)


def test_missing_experts_are_named(tmp_path):
    shard_dir = tmp_path / "m.swarm"
    shard_model(FIXTURES / "qwen3moe-tiny" / "model-f32.gguf", shard_dir)
    manifest = read_manifest(shard_dir)
    (node,) = start_nodes([(shard_dir, ["--experts", "0-15", "--no-mdns"])], tmp_path / "n")
    try:
        needed = [(layer, e) for layer in manifest.moe_layers for e in range(manifest.n_expert)]
        with pytest.raises(UserError, match=r"layer 0: experts 16-31"):
            connect(needed, manifest.fingerprint, str(shard_dir), EngineConfig(peers=[node.address], mdns=False))
        with pytest.raises(UserError, match="another model"):
            connect(needed, "0" * 64, str(shard_dir), EngineConfig(peers=[node.address], mdns=False))
    finally:
        node.stop()


def test_no_nodes_says_how_to_start_one(tmp_path):
    shard_dir = tmp_path / "m.swarm"
    shard_model(FIXTURES / "qwen3moe-tiny" / "model-f32.gguf", shard_dir)
    with pytest.raises(UserError, match="swarm node"):
        open_engine(shard_dir, EngineConfig(mdns=False, device="cpu"))


def test_placement_passes_over_a_failed_node_for_a_while():
    now = [0.0]
    p = Placement(clock=lambda: now[0])
    p.add("a:1", [(0, 0), (0, 1)])
    p.add("b:1", [(0, 0)])
    assert {p.pick(0, 0), p.pick(0, 1)} <= {"a:1", "b:1"}
    assert p.pick(0, 0, avoid=["a:1"]) == "b:1"
    p.mark_down("a:1", seconds=5.0)
    assert p.pick(0, 0) == "b:1"
    assert p.pick(0, 1) is None
    assert p.pick(0, 1, include_down=True) == "a:1"
    assert p.missing([(0, 0), (0, 1), (1, 0)]) == {0: [1], 1: [0]}
    now[0] = 6.0
    assert p.pick(0, 1) == "a:1"
    assert p.addresses() == ["a:1", "b:1"]
    # failures in a row back off exponentially (0.5 s, 1 s, 2 s, ... at most 30 s); an answer resets it
    for n, wait in enumerate([0.5, 1.0, 2.0, 4.0], start=1):
        p.mark_down("b:1")
        assert p.failures("b:1") == n and p.pick(0, 0, avoid=["a:1"]) is None
        now[0] += wait - 0.01
        assert p.pick(0, 0, avoid=["a:1"]) is None
        now[0] += 0.02
        assert p.pick(0, 0, avoid=["a:1"]) == "b:1"
    for _ in range(20):
        p.mark_down("b:1")
    now[0] += 30.01
    assert p.pick(0, 0, avoid=["a:1"]) == "b:1"
    p.mark_up("b:1")
    p.mark_down("b:1")
    now[0] += 0.51
    assert p.failures("b:1") == 1 and p.pick(0, 0, avoid=["a:1"]) == "b:1"
    p.ban("b:1")
    assert p.pick(0, 0, avoid=["a:1"]) is None and p.pick(0, 0, include_down=True) == "a:1"


@pytest.mark.slow
def test_qwen36_35b_layer_shape_runs_through_four_nodes(tmp_path):
    """The real Qwen3.6-35B-A3B layer (D 2048, 256 experts of F 512, K 8, shared F 512, gated attention 16/2
    heads of 256, Gated DeltaNet 16/32 heads of 128), 4 layers of Q4_K experts, across 4 node processes."""
    from swarm.sharding.synth import synthesize
    from swarm.sharding.synth_spec import preset

    gguf, shard_dir = tmp_path / "q36.gguf", tmp_path / "q36.swarm"
    synthesize(gguf, preset("qwen3.6-35b-a3b", n_layers=4, experts_type="Q4_K"))
    shard_model(gguf, shard_dir)
    m = read_manifest(shard_dir)
    assert (m.arch, m.n_embd, m.n_expert, m.n_expert_used, m.n_ff_exp) == ("qwen35moe", 2048, 256, 8, 512)
    nodes = start_nodes(
        [
            (
                shard_dir,
                [
                    "--experts",
                    f"{64 * i}-{64 * i + 63}",
                    "--threads",
                    "1",
                    "--memory",
                    "256MiB",
                ],
            )
            for i in range(4)
        ],
        tmp_path / "nodes",
        env=KEYED,
    )
    swarm = local = None
    try:
        swarm = open_engine(shard_dir, EngineConfig(mdns_interfaces=LOOPBACK, wait=10.0, device="cpu", key=KEY))
        # Small expert budgets (here and on the nodes): a 12.6 MB float32 working copy per expert of this
        # shape would otherwise add up to gigabytes per process; evicted experts decode to the same bits.
        local = open_engine(shard_dir, EngineConfig(local=True, device="cpu", memory_budget=256 << 20))
        cfg = swarm.model.cfg
        assert (cfg.n_head, cfg.n_head_kv, cfg.head_dim) == (16, 2, 256)
        assert (cfg.n_k_heads, cfg.n_v_heads, cfg.d_state, cfg.moe.n_ff_shared) == (16, 32, 128, 512)
        assert cfg.recurrent == (True, True, True, False)
        prompt = swarm.tokenizer.encode("Experts of one layer live on different machines.")
        tokens_s, logits_s = _greedy(swarm, prompt, 3)
        tokens_l, logits_l = _greedy(local, prompt, 3)
        assert tokens_s == tokens_l
        assert torch.equal(logits_s, logits_l)
        assert {n.address for n in nodes} <= set(swarm.experts.calls_per_node), "every node got calls"
        assert not swarm.experts.failovers
    finally:
        for e in (swarm, local):
            if e is not None:
                e.close()
        for node in nodes:
            node.stop()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", "stalled"])
def test_answer_survives_a_node_leaving_mid_generation(tmp_path, how):
    """Two replicas of every expert; one of them dies (SIGKILL) or stalls (SIGSTOP: a phone gone to sleep)
    after the fourth token. The answer goes on through the other and is the in-process answer, token for
    token; a stalled node costs a hedge delay, not the 30 s call deadline."""
    import os
    import signal
    import time

    from swarm.coordinator.decode.one import SamplingParams, generate

    name = "qwen3moe-tiny"
    shard_dir = tmp_path / "m.swarm"
    shard_model(FIXTURES / name / "model-f32.gguf", shard_dir)
    manifest = read_manifest(shard_dir)
    _, prompts = _prompts(name)
    nodes = start_nodes([(shard_dir, ["--no-mdns"]), (shard_dir, ["--no-mdns"])], tmp_path / "nodes")
    local = open_engine(shard_dir, EngineConfig(local=True, device="cpu"))
    backend = connect(sorted(slabs_from_shard(shard_dir, verify=False)[0]), manifest.fingerprint, str(shard_dir), EngineConfig(peers=[n.address for n in nodes], mdns=False, timeout=30.0))  # fmt: skip
    victim = nodes[1]
    try:
        params = SamplingParams(max_tokens=12)
        expect = list(generate(local.model, prompts[0], params))
        local.model.set_experts(backend)
        got = []
        t0 = time.perf_counter()
        for token in generate(local.model, prompts[0], params):
            got.append(token)
            if len(got) == 4:
                t0 = time.perf_counter()
                assert len(backend.calls_per_node) == 2, "both replicas were in use before"
                if how == "killed":
                    victim.process.kill()
                else:
                    os.kill(victim.process.pid, signal.SIGSTOP)
        after = time.perf_counter() - t0
        assert got == expect
        if how == "killed":
            # passed over by a failed call's failover or, on a busy machine, by a hedge that answered first
            assert backend.failovers + backend.hedge_wins >= 1
        else:
            assert backend.hedge_wins >= 1 and after < 15.0, f"{after:.1f} s after the stall"
        assert victim.address not in backend.placement.addresses()
    finally:
        if how == "stalled":
            os.kill(victim.process.pid, signal.SIGCONT)
        backend.close()
        local.close()
        for n in nodes:
            n.stop()


@pytest.mark.slow
def test_nodes_joining_and_leaving_are_followed_by_mdns(tmp_path):
    """After connect, mDNS keeps watching: a node that joins takes a share of the calls from the next layer
    on; a node that leaves (stopped: it says goodbye) is dropped before any call to it can fail."""
    import time

    name = "qwen3moe-tiny"
    shard_dir = tmp_path / "m.swarm"
    shard_model(FIXTURES / name / "model-f32.gguf", shard_dir)
    _, prompts = _prompts(name)
    first = start_nodes(
        [(shard_dir, ["--experts", "0-15"]), (shard_dir, ["--experts", "16-31"])], tmp_path / "a", env=KEYED
    )
    swarm = open_engine(shard_dir, EngineConfig(mdns_interfaces=LOOPBACK, wait=10.0, device="cpu", key=KEY))
    local = open_engine(shard_dir, EngineConfig(local=True, device="cpu"))
    late: list = []
    try:
        expect = forward_one(local.model, prompts[0], local.model.new_state(), "cpu")
        assert torch.equal(forward_one(swarm.model, prompts[0], swarm.model.new_state(), "cpu"), expect)
        assert {n.address for n in first} <= set(swarm.experts.calls_per_node)

        late = start_nodes([(shard_dir, [])], tmp_path / "b", env=KEYED)  # holds every expert
        browser = swarm.experts.browser
        assert browser is not None
        assert browser.wait_for(lambda ns: late[0].address in {n.address for n in ns}, 10.0) is not None
        before = swarm.experts.calls_per_node[late[0].address]
        assert torch.equal(forward_one(swarm.model, prompts[1], swarm.model.new_state(), "cpu"),
                           forward_one(local.model, prompts[1], local.model.new_state(), "cpu"))  # fmt: skip
        assert swarm.experts.calls_per_node[late[0].address] > before, "the new node took a share"

        gone = first[0]
        gone.stop()  # SIGTERM: the node unregisters from mDNS on its way out
        assert browser.wait_for(lambda ns: gone.address not in {n.address for n in ns}, 10.0) is not None
        time.sleep(0.1)
        calls_to_gone = swarm.experts.calls_per_node[gone.address]
        assert torch.equal(forward_one(swarm.model, prompts[2], swarm.model.new_state(), "cpu"),
                           forward_one(local.model, prompts[2], local.model.new_state(), "cpu"))  # fmt: skip
        assert swarm.experts.calls_per_node[gone.address] == calls_to_gone, (
            "no call went to the node that left"
        )
        assert swarm.experts.failovers == 0
    finally:
        swarm.close()
        local.close()
        for n in first + late:
            n.stop()


@pytest.mark.slow
def test_two_swarms_of_one_model_on_one_network_keep_to_their_keys(tmp_path):
    """A keyed swarm and an open one, same model, same network: each coordinator takes only its own nodes
    (instead of calling the others' and being refused)."""
    name = "qwen3moe-tiny"
    shard_dir = tmp_path / "m.swarm"
    shard_model(FIXTURES / name / "model-f32.gguf", shard_dir)
    _, prompts = _prompts(name)
    text = generate_key_text()
    key = SwarmKey.from_text(text)
    (keyed,) = start_nodes([(shard_dir, [])], tmp_path / "nodes", env={KEY_ENV: text})
    (open_,) = start_nodes([(shard_dir, [])], tmp_path / "nodes", prefix="open")
    engines = []
    try:
        for k, mine, other in ((key, keyed, open_), (None, open_, keyed)):
            engine = open_engine(shard_dir, EngineConfig(mdns_interfaces=LOOPBACK, wait=10.0, device="cpu", key=k))
            engines.append(engine)
            forward_one(engine.model, prompts[3], engine.model.new_state(), "cpu")  # no call refused
            if k is not None:  # a fresh key: that node is the only one of its swarm
                assert set(engine.experts.clients) == {mine.address}
            assert other.address not in engine.experts.clients
            assert set(engine.experts.calls_per_node) <= set(engine.experts.clients)
    finally:
        for e in engines:
            e.close()
        keyed.stop()
        open_.stop()


def test_a_node_answering_the_wrong_shape_is_failed_over(tmp_path):
    """A node whose answers do not fit the call (a bug, another version) is treated as broken: its rows go to
    another holder, and nothing of its answer reaches the sum."""
    from swarm.node.server import NodeServer

    class ShortStore(ExpertStore):
        def compute(self, layer, expert_ids, counts, rows):  # one row short
            return super().compute(layer, expert_ids, counts, rows)[:-1]

    name = "qwen3moe-tiny"
    shard_dir = tmp_path / "m.swarm"
    shard_model(FIXTURES / name / "model-f32.gguf", shard_dir)
    manifest = read_manifest(shard_dir)
    slabs, _ = slabs_from_shard(shard_dir, verify=False)
    _, prompts = _prompts(name)
    bad = NodeServer(ShortStore(slabs), manifest.fingerprint).start()
    good = NodeServer(ExpertStore(slabs), manifest.fingerprint).start()
    backend = connect(sorted(slabs), manifest.fingerprint, str(shard_dir), EngineConfig(peers=[bad.address, good.address], mdns=False))  # fmt: skip
    try:
        engine = open_engine(shard_dir, EngineConfig(local=True, device="cpu"))
        expect = forward_one(engine.model, prompts[0], engine.model.new_state(), "cpu")
        engine.model.set_experts(backend)
        got = forward_one(engine.model, prompts[0], engine.model.new_state(), "cpu")
        assert torch.equal(got, expect)
        assert backend.failovers >= 1
        assert bad.address not in backend.placement.addresses()
    finally:
        backend.close()
        bad.stop(0)
        good.stop(0)


@pytest.mark.slow
def test_degraded_mode_renormalizes_over_the_experts_that_answered(tmp_path):
    name = "qwen3moe-tiny"
    shard_dir = tmp_path / "m.swarm"
    shard_model(FIXTURES / name / "model-f32.gguf", shard_dir)
    _, prompts = _prompts(name)
    text = generate_key_text()  # a swarm of its own: the module's other nodes of this model hold 24-31 too
    kept, gone = start_nodes([(shard_dir, ["--experts", "0-23"]), (shard_dir, ["--experts", "24-31"])],
                             tmp_path / "nodes", env={KEY_ENV: text})  # fmt: skip
    open_ = dict(
        mdns_interfaces=LOOPBACK, wait=10.0, device="cpu", key=SwarmKey.from_text(text), timeout=10.0
    )
    strict = open_engine(shard_dir, EngineConfig(**open_))
    degraded = open_engine(shard_dir, EngineConfig(degraded=True, **open_))
    local = open_engine(shard_dir, EngineConfig(local=True, device="cpu"))
    try:
        full = forward_one(local.model, prompts[0], local.model.new_state(), "cpu")
        assert torch.equal(forward_one(degraded.model, prompts[0], degraded.model.new_state(), "cpu"), full)
        assert degraded.experts.dropped_pairs == 0
        gone.stop()  # no other node holds experts 24-31
        with pytest.raises(UserError, match=r"no node holds layer \d+: experts|every holder failed"):
            forward_one(strict.model, prompts[0], strict.model.new_state(), "cpu")
        got = forward_one(degraded.model, prompts[0], degraded.model.new_state(), "cpu")
        assert degraded.experts.dropped_pairs > 0
        local.model.set_experts(WithoutExperts(local.experts, set(range(24, 32))))
        expect = forward_one(local.model, prompts[0], local.model.new_state(), "cpu")
        assert torch.equal(got, expect)
        assert not torch.equal(got, full)
    finally:
        for e in (strict, degraded, local):
            e.close()
        kept.stop()
