"""A serve pass split into groups in flight at once (passes.Passes with serve/groups.py): through real nodes, four
conversations with drafts each get the text they get alone; the automatic choice splits only where a pass
spends most of its time waiting on the nodes."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import FIXTURES
from test_scheduler import _Known

from swarm.coordinator.cli.spawn import start_nodes, stop_nodes
from swarm.coordinator.config import EngineConfig
from swarm.coordinator.decode.one import SamplingParams, generate
from swarm.coordinator.decode.passes import Entry, Seq
from swarm.coordinator.engine import open_engine
from swarm.coordinator.experts.remote.discovery import connect
from swarm.coordinator.serve import scheduler as sched
from swarm.coordinator.serve.groups import REMEASURE_EVERY, WaitShare
from swarm.sharding.shard import shard_model
from swarm.sharding.slabs import read_manifest, slabs_from_shard


@pytest.mark.slow
def test_groups_through_nodes_give_each_conversation_its_text_alone(tmp_path) -> None:
    shard_dir = tmp_path / "m.swarm"
    shard_model(FIXTURES / "qwen35moe-quant" / "model-q4_k_m.gguf", shard_dir)
    manifest = read_manifest(shard_dir)
    n = manifest.n_expert
    cuts = [0, n // 3, 2 * n // 3, n]
    nodes = start_nodes(
        [(shard_dir, ["--no-mdns", "--experts", f"{cuts[i]}-{cuts[i + 1] - 1}"]) for i in range(3)],
        tmp_path / "nodes",
    )
    local = open_engine(shard_dir, EngineConfig(local=True, device="cpu"))
    backend = connect(sorted(slabs_from_shard(shard_dir, verify=False)[0]), manifest.fingerprint, str(shard_dir), EngineConfig(peers=[x.address for x in nodes], mdns=False, timeout=30.0))  # fmt: skip
    prompts = [[5 + i, 9, 40 + 3 * i, *range(60, 60 + 4 * i)] for i in range(4)]
    params = [SamplingParams(max_tokens=8, temperature=0.8 * (i % 2), seed=3 + i) for i in range(4)]
    try:
        alone = [list(generate(local.model, p, q, "cpu")) for p, q in zip(prompts, params, strict=True)]
        local.model.set_experts(backend)
        for groups in (3,):  # groups of unequal size (4 sequences in 3)
            policy = WaitShare(backend, fixed=groups)
            split: list[int] = []
            choose = policy.choose
            policy.choose = lambda entries, c=choose, s=split: s.append(c(entries)) or s[-1]  # type: ignore[method-assign]
            known = _Known([p + a for p, a in zip(prompts, alone, strict=True)], wrong={2})
            s = sched.Scheduler(
                local.model, torch.device("cpu"), None, 4, 256, 4, drafter=known, groups=policy
            )
            s.start()
            try:
                done = [threading.Event() for _ in range(4)]
                outs: list[list[int]] = [[] for _ in range(4)]
                for i in range(4):
                    s.submit(
                        sched.Request(prompts[i], params[i], outs[i].extend, lambda _, d=done[i]: d.set())
                    )
                assert all(d.wait(120) for d in done)
            finally:
                s.stop()
            assert outs == alone, f"{groups} groups"
            assert groups in split, split  # passes did go in groups
    finally:
        local.model.set_experts(local.experts)
        backend.close()
        local.close()
        stop_nodes(nodes)


class _Backend:
    wait_seconds = 0.0


def _pass(policy: WaitShare, backend: _Backend, entries: list[Entry], wait: float, compute: float) -> int:
    n = policy.choose(entries)
    time.sleep(compute)
    time.sleep(wait)
    backend.wait_seconds += wait
    policy.done()
    return n


def test_the_automatic_choice_splits_only_when_the_wait_dominates() -> None:
    entries = [Entry(Seq(None)) for _ in range(8)]
    backend = _Backend()
    fast = WaitShare(backend)
    assert [_pass(fast, backend, entries, 0.001, 0.02) for _ in range(6)] == [1] * 6  # loopback: one
    slow = WaitShare(backend)
    got = [_pass(slow, backend, entries, 0.05, 0.005) for _ in range(2 * REMEASURE_EVERY)]
    assert got[0] == 1 and set(got[1:]) - {1} and min(got[2:]) >= 1
    assert got.count(1) <= 3  # the first, and one remeasuring pass every REMEASURE_EVERY
    assert WaitShare(backend).choose([entries[0]]) == 1  # one sequence: nothing to split
    assert WaitShare(backend, fixed=3).choose(entries) == 3
