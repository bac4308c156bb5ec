"""Chaos: 4 nodes, every slab on 2 of them; while greedy 128-token generations run, a node is SIGKILLed (and
restarted on its port) every 2 s. No generation fails and every text equals the fault-free one."""

from __future__ import annotations

import signal
import threading
import time

import pytest
from conftest import FIXTURES

from swarm.coordinator.cli.spawn import spawn_node, start_nodes, stop_nodes
from swarm.coordinator.config import EngineConfig
from swarm.coordinator.decode.one import GenerationStats, SamplingParams, generate
from swarm.coordinator.engine import open_engine
from swarm.node.auth import KEY_ENV, SwarmKey, generate_key_text
from swarm.sharding.shard import shard_model

KEY_TEXT = generate_key_text()
KILL_EVERY = 2.0
GENERATIONS = 6
TOKENS = 128


@pytest.mark.slow
def test_nodes_killed_every_two_seconds_cost_time_not_tokens(tmp_path):
    shard_dir = tmp_path / "m.swarm"
    shard_model(FIXTURES / "qwen3moe-tiny" / "model-f32.gguf", shard_dir)  # 4 layers x 32 experts
    halves = ["0-15", "16-31", "0-15", "16-31"]  # replication 2: nodes i and i+2 hold the same slabs
    env = {KEY_ENV: KEY_TEXT}
    nodes = start_nodes([(shard_dir, ["--experts", h]) for h in halves], tmp_path / "nodes", env=env)
    ports = [n.port for n in nodes]
    local = open_engine(shard_dir, EngineConfig(local=True, device="cpu"))
    prompts = [[(7 * g + 3 * i) % 700 + 20 for i in range(6 + g)] for g in range(GENERATIONS)]
    params = SamplingParams(max_tokens=TOKENS)
    expect = [list(generate(local.model, p, params, "cpu")) for p in prompts]
    local.close()

    swarm = open_engine(
        shard_dir, EngineConfig(mdns_interfaces=["127.0.0.1"], wait=10.0, device="cpu", key=SwarmKey.from_text(KEY_TEXT)))
    stop = threading.Event()
    kills: list[tuple[int, float]] = []
    errors: list[str] = []

    def chaos() -> None:
        victim = 0
        while not stop.wait(KILL_EVERY):
            i = victim % len(nodes)
            victim += 1
            try:
                nodes[i].process.send_signal(signal.SIGKILL)
                nodes[i].process.wait(60)  # a killed process may take a while to exit on a loaded machine
                kills.append((i, time.monotonic()))
                args = ["--experts", halves[i], "--port", str(ports[i])]
                nodes[i] = spawn_node(shard_dir, args, tmp_path / "nodes", f"again{victim}", env)
                nodes[i].wait_ready(30)
            except Exception as e:  # noqa: BLE001 - reported below: the rig itself must not fail silently
                errors.append(repr(e))

    killer = threading.Thread(target=chaos)
    got: list[list[int]] = []
    try:
        killer.start()
        t0 = time.monotonic()
        # until 3 nodes were killed (a restart takes a few seconds, so that is not a fixed time) and every
        # prompt was generated at least once
        while (len(kills) < 3 and time.monotonic() - t0 < 30 * KILL_EVERY) or len(got) < GENERATIONS:
            g = len(got) % GENERATIONS
            stats = GenerationStats()
            tokens = list(generate(swarm.model, prompts[g], params, "cpu", stats, checker=swarm.checker))
            assert tokens == expect[g], f"generation {len(got)} differs after kills {kills}"
            got.append(tokens)
    finally:
        stop.set()
        killer.join()
        swarm.close()
        stop_nodes(nodes)
    assert not errors, errors
    assert len(kills) >= 3, f"only {len(kills)} kills happened during {len(got)} generations"
    assert swarm.experts.failovers > 0, "no call ever met a killed node"
