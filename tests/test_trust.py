"""Answers one can rely on, at default settings: two kinds of liar beside an honest holder of every slab,
on a quiet and on a busy machine. A liar whose shard directory's slab files rot after it started (its own
check is off, so that its answers, not its check, are what is tested), and a liar serving a whole GGUF whose
layer-0 expert weights differ under an identical header (a node on a GGUF is known by its header only: it
cannot see this itself). The logits of a prompt are released only once every answer of the pass is checked,
so they equal the in-process ones bit for bit and the liar is banned; `--verify pair` does the same for
decode. Real node processes on loopback, real files."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
from conftest import FIXTURES, flip_bytes

from swarm.coordinator.cli.spawn import start_nodes, stop_nodes
from swarm.coordinator.config import DEFAULT_AUDIT_RATE, EngineConfig, Verify
from swarm.coordinator.decode.one import SamplingParams, checked_logits, forward_one, generate
from swarm.coordinator.engine import open_engine
from swarm.node.auth import KEY_ENV, SwarmKey, generate_key_text
from swarm.sharding.gguf_io import open_gguf
from swarm.sharding.shard import shard_model

MODEL = FIXTURES / "qwen35moe-quant" / "model-q4_k_m.gguf"  # Q4_K / Q6_K experts
KEY_TEXT = generate_key_text()
KEY = SwarmKey.from_text(KEY_TEXT)
RUNS = 2  # coordinators per case (bench/trust.py runs 20 of each)


def rot(shard_dir, layer: int) -> None:
    for path in sorted((shard_dir / "experts" / str(layer)).glob("*.gguf")):
        flip_bytes(path, open_gguf(path).data_offset)


def other_weights(src, dst, layer: int) -> None:
    """A copy of the GGUF whose layer's expert tensors hold other bytes: the header (metadata and tensor
    infos) is unchanged, so its header hash is the model's."""
    shutil.copy(src, dst)
    for t in open_gguf(dst).tensors:
        if t.name.startswith(f"blk.{layer}.ffn_") and "_exps" in t.name:
            flip_bytes(dst, int(t.data_offset), int(t.data_offset) + int(t.n_bytes), every=13)


@pytest.fixture()
def busy_cores():
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    yield
    for p in procs:
        p.kill()
        p.wait()


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    work = tmp_path_factory.mktemp("trust")
    shard_model(MODEL, work / "honest.swarm")
    local = open_engine(work / "honest.swarm", EngineConfig(local=True, device="cpu"))
    tokens = list(range(3, 15))
    expect = forward_one(local.model, tokens, local.model.new_state(), "cpu")
    text = list(generate(local.model, tokens, SamplingParams(max_tokens=64), "cpu"))
    local.close()
    return work, tokens, expect, text


ROT_LAYER = (
    2  # its down matrices are Q6_K, multiplied where they lie in the files (Q4_K is repacked at start)
)


def _rig(work, tmp_path, kind: str, rot_now: bool = True):
    honest_dir = work / "honest.swarm"
    if kind == "bit-rot":
        liar_src = tmp_path / "liar.swarm"
        shutil.copytree(honest_dir, liar_src)
        liar_args = ["--recheck", "0"]
    else:
        liar_src = tmp_path / "liar.gguf"
        other_weights(MODEL, liar_src, 0)
        liar_args = []
    nodes = start_nodes(
        [(honest_dir, []), (liar_src, liar_args)], tmp_path / "nodes", env={KEY_ENV: KEY_TEXT}
    )
    if kind == "bit-rot":
        nodes[1].wait_prepared(60)  # its slabs hashed before their first use: the rot comes after
    if kind == "bit-rot" and rot_now:
        rot(liar_src, ROT_LAYER)  # after it started
    return honest_dir, nodes, liar_src


def _engine(honest_dir, nodes, seed: int, verify: str = "sample", rate: float = DEFAULT_AUDIT_RATE):
    peers = tuple(n.address for n in nodes)
    config = EngineConfig(peers=peers, mdns=False, device="cpu", key=KEY, audit_rate=rate, audit_seed=seed,
                          verify=Verify(verify))  # fmt: skip
    return open_engine(honest_dir, config)


def _logits_runs(shard, tmp_path, kind: str) -> None:
    work, tokens, expect, _ = shard
    honest_dir, nodes, _ = _rig(work, tmp_path, kind)
    honest, liar = nodes
    try:
        for run in range(RUNS):
            swarm = _engine(honest_dir, nodes, seed=run)
            try:
                got = checked_logits(swarm.model, tokens, swarm.model.new_state(), "cpu", swarm.checker)
                banned = swarm.checker.report.banned
                assert set(banned) == {liar.address}, f"run {run}: banned {banned}"
                assert torch.equal(got, expect), f"run {run}: max diff {float((got - expect).abs().max())}"
            finally:
                swarm.close()
    finally:
        stop_nodes(nodes)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bit-rot", "other-weights"])
def test_a_prompts_logits_are_released_only_once_every_answer_is_checked(shard, tmp_path, kind):
    _logits_runs(shard, tmp_path, kind)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bit-rot", "other-weights"])
def test_the_same_on_a_busy_machine(shard, tmp_path, kind, busy_cores):
    _logits_runs(shard, tmp_path, kind)


@pytest.mark.slow
def test_verify_pair_decodes_the_in_process_text_beside_a_liar(shard, tmp_path):
    """The liar's files rot once the prompt is read; every decode call also goes to the other holder, the
    answers differ where the rotten slabs are used, the coordinator decides, bans the liar and the passes
    since the last settled point are done again: the text is the in-process one."""
    work, tokens, _, text = shard
    honest_dir, nodes, liar_dir = _rig(work, tmp_path, "bit-rot", rot_now=False)
    honest, liar = nodes
    swarm = _engine(honest_dir, nodes, seed=0, verify="pair", rate=0.0)  # only the pairs catch it in decode
    try:
        run = generate(swarm.model, tokens, SamplingParams(max_tokens=64), "cpu", checker=swarm.checker)
        got = [next(run)]
        assert not swarm.checker.report.banned
        rot(liar_dir, ROT_LAYER)
        got += list(run)
        assert got == text
        assert set(swarm.checker.report.banned) == {liar.address}
        assert swarm.experts.twin_calls > 0
    finally:
        swarm.close()
        stop_nodes(nodes)
