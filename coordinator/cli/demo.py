"""`swarm demo`: a whole swarm on this machine, no downloads and no other machines.

Synthesizes a small random-weight model with a real layout, shards it, starts node processes on loopback
(each holding a range of experts, plus one replica holding them all), finds them by mDNS, answers a prompt
through the swarm, answers it again in process, and shows that the two agree bit for bit. Then one node
walks away without warning (SIGKILL) and the swarm answers again, its experts failing over to the replica,
still bit for bit. Every process it started is stopped on the way out, Ctrl-C included.
"""

from __future__ import annotations

import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from swarm.coordinator.decode.one import greedy_trace
from swarm.proto.numerics import Numerics
from swarm.sharding.errors import UserError
from swarm.sharding.manifest import Manifest
from swarm.sharding.ranges import format_ranges

LOOPBACK = "127.0.0.1"


def _say(text: str) -> None:
    print(text, flush=True)


def split_experts(n_expert: int, n_nodes: int) -> list[list[int]]:
    """Disjoint, contiguous expert ranges, one per node, covering 0..n_expert-1."""
    bounds = [round(i * n_expert / n_nodes) for i in range(n_nodes + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(n_nodes)]


def node_walks_away(
    swarm: Any,
    node: Any,
    experts: list[int],
    ids: list[int],
    steps: int,
    expect_tokens: list[int],
    expect_logits: torch.Tensor,
) -> bool:
    """Kill one node without warning, answer again, compare with the in-process answer."""
    _say(f"\n[6/6] the node at {node.address} (experts {format_ranges(experts)}) walks away: killed "
         "without warning; answering the same prompt again ...")  # fmt: skip
    node.process.kill()
    node.process.wait()
    failovers = swarm.experts.failovers
    tokens, logits = greedy_trace(swarm.model, ids, steps, swarm.device, swarm.checker)
    moved = swarm.experts.failovers - failovers
    if tokens == expect_tokens and torch.equal(logits, expect_logits):
        _say(f"agreement after the loss: still bit-identical to in-process; {moved} call(s) failed over to "
             "the replica, and the node was passed over after that")  # fmt: skip
        return True
    diff = float((logits - expect_logits).abs().max())
    _say(f"DISAGREEMENT after the loss (max |logit diff| {diff:.3g}); this is a bug")
    return False


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run_demo(
    like: str = "qwen35moe-tiny",
    experts_type: str = "Q4_K",
    n_nodes: int = 3,
    prompt: str = "Explain what a mixture of experts is.",
    max_tokens: int = 24,
    workdir: str | None = None,
    numerics: Numerics = Numerics.NATIVE,
) -> int:
    if n_nodes < 1:
        raise UserError("--nodes must be at least 1")
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    temp = workdir is None
    work = Path(tempfile.mkdtemp(prefix="swarm-demo-")) if temp else Path(workdir or ".")
    work.mkdir(parents=True, exist_ok=True)
    nodes: list[Any] = []
    engines: list[Any] = []
    try:
        _say("swarm demo: a whole swarm on this machine. The weights are RANDOM, so the text is meaningless;")
        _say("the machinery (sharding, nodes, mDNS, gRPC fan-out, reduction) is real.\n")
        shard_dir, manifest = _make_model(work, like, experts_type)
        same = _run_swarm(shard_dir, manifest, work, n_nodes, prompt, max_tokens, numerics, nodes, engines)
        return 0 if same else 1
    except KeyboardInterrupt:
        _say("\ninterrupted; stopping the nodes")
        return 130
    finally:
        for engine in engines:
            engine.close()
        for node in nodes:
            node.stop()
        if nodes:
            _say(f"stopped {len(nodes)} node processes" + ("" if temp else f"; files kept in {work}"))
        if temp:
            shutil.rmtree(work, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)


def _make_model(work: Path, like: str, experts_type: str) -> tuple[Path, Manifest]:
    """Steps 1 and 2: the synthesized GGUF, cut into shards; (the shard directory, its manifest)."""
    from swarm.sharding.shard import shard_model
    from swarm.sharding.slabs import read_manifest
    from swarm.sharding.synth import synthesize
    from swarm.sharding.synth_spec import preset

    spec = preset(like, experts_type=experts_type)
    gguf_path = work / f"{like}.gguf"
    t0 = time.perf_counter()
    synthesize(gguf_path, spec)
    _say(f"[1/6] synthesized {gguf_path.name}: {spec.arch}, {spec.n_layers} layers, {spec.n_expert} experts "
         f"(top-{spec.n_expert_used}), {experts_type} experts, {gguf_path.stat().st_size / 1e6:.1f} MB "
         f"in {time.perf_counter() - t0:.1f} s")  # fmt: skip

    shard_dir = work / f"{like}.swarm"
    t0 = time.perf_counter()
    shard_model(gguf_path, shard_dir, progress=False)
    manifest = read_manifest(shard_dir)
    _say(f"[2/6] sharded into {len(manifest.slabs)} expert slabs + dense.gguf "
         f"(fingerprint {manifest.fingerprint[:12]}) in {time.perf_counter() - t0:.1f} s")  # fmt: skip
    return shard_dir, manifest


def _run_swarm(
    shard_dir: Path,
    manifest: Manifest,
    work: Path,
    n_nodes: int,
    prompt: str,
    max_tokens: int,
    numerics: str,
    nodes: list[Any],
    engines: list[Any],
) -> bool:
    """Steps 3 to 6: nodes started (into `nodes`), the swarm opened (into `engines`), the answer, its
    agreement with the in-process one before and after a node walks away; whether they all agreed."""
    from swarm.coordinator.cli.spawn import start_nodes
    from swarm.coordinator.cli.terminal import report, stream_answer
    from swarm.coordinator.config import EngineConfig
    from swarm.coordinator.decode.one import SamplingParams
    from swarm.coordinator.engine import open_engine
    from swarm.coordinator.text.chat import prompt_ids
    from swarm.node.auth import KEY_ENV, SwarmKey, generate_key_text

    ranges = split_experts(manifest.n_expert, min(n_nodes, manifest.n_expert))
    ranges.append(list(range(manifest.n_expert)))  # the replica: every expert once more
    # A key of its own: another demo running on this machine (same synthesized model, same fingerprint)
    # keeps its nodes to itself.
    key_text = generate_key_text()
    key = SwarmKey.from_text(key_text)
    specs = [(shard_dir, ["--host", LOOPBACK, "--experts", format_ranges(r)]) for r in ranges]
    t0 = time.perf_counter()
    nodes.extend(start_nodes(specs, work / "nodes", env={KEY_ENV: key_text}))
    _say(f"[3/6] started {len(nodes)} node processes in {time.perf_counter() - t0:.1f} s:")
    for node, r in zip(nodes, ranges, strict=True):
        role = " (a replica: the swarm shares the load with it)" if r is ranges[-1] else ""
        _say(f"      node at {node.address} (pid {node.pid}) holds experts {format_ranges(r)} "
             f"of every layer{role}")  # fmt: skip

    t0 = time.perf_counter()
    swarm = open_engine(
        shard_dir, EngineConfig(mdns_interfaces=[LOOPBACK], wait=10.0, key=key, numerics=Numerics(numerics))
    )
    engines.append(swarm)
    _find_all(swarm, nodes)
    _say(f"[4/6] found {len(swarm.experts.clients)} nodes by mDNS on {LOOPBACK} "
         f"in {time.perf_counter() - t0:.1f} s; every expert has a holder")  # fmt: skip

    ids = prompt_ids(swarm.tokenizer, prompt, chat=True)
    _say(f"[5/6] answering through the swarm ({len(ids)} prompt tokens, chat template from the GGUF):\n")
    params = SamplingParams(max_tokens=max_tokens, stop_ids=frozenset())
    sys.stdout.write("      ")
    generated, stats = stream_answer(swarm, ids, params)
    report(swarm, stats, sys.stdout)

    _say(f"\nchecking against the in-process path (the node's compute code on slabs loaded here, {numerics} "
         "numerics) ...")  # fmt: skip
    local = open_engine(shard_dir, EngineConfig(local=True, numerics=Numerics(numerics)))
    engines.append(local)
    steps = len(generated) - 1
    same, local_tokens, local_logits = _agrees_in_process(swarm, local, ids, steps, generated)
    if same:
        same = node_walks_away(swarm, nodes[0], ranges[0], ids, steps, local_tokens, local_logits)
    _node_report(nodes[1:], manifest.fingerprint, key)
    return same


def _find_all(swarm: Any, nodes: list[Any]) -> None:
    """Coverage came first; the rest of the nodes this demo started are still being announced."""
    deadline = time.monotonic() + 10.0
    while not {n.address for n in nodes} <= set(swarm.experts.clients) and time.monotonic() < deadline:
        time.sleep(0.1)
        swarm.experts.follow_mdns()


def _agrees_in_process(
    swarm: Any, local: Any, ids: list[int], steps: int, generated: list[int]
) -> tuple[bool, list[int], torch.Tensor]:
    """Whether the swarm's greedy trace is bit-identical to the in-process one; (that, the in-process
    tokens and logits)."""
    swarm_tokens, swarm_logits = greedy_trace(swarm.model, ids, steps, swarm.device, swarm.checker)
    local_tokens, local_logits = greedy_trace(local.model, ids, steps, local.device, local.checker)
    same = swarm_tokens == local_tokens == generated[:steps] and torch.equal(swarm_logits, local_logits)
    if same:
        _say(f"agreement: swarm and in-process logits are bit-identical ({swarm_logits.shape[0]} positions x "
             f"{swarm_logits.shape[1]} vocab; prefill and {steps} decode steps), tokens identical")  # fmt: skip
    else:
        diff = float((swarm_logits - local_logits).abs().max())
        _say(f"DISAGREEMENT: swarm and in-process differ (max |logit diff| {diff:.3g}); this is a bug")
    return same, local_tokens, local_logits


def _node_report(nodes: list[Any], fingerprint: str, key: Any) -> None:
    from swarm.node.client import NodeClient

    _say("\nwhat each node did:")
    for node in nodes:
        client = NodeClient(node.address, fingerprint=fingerprint, key=key)
        try:
            s = client.stats()
            _say(f"  {node.address}: {s.calls} calls, {s.rows} rows, busy {s.busy_seconds * 1e3:.0f} ms, "
                 f"cache hits {s.cache_hits} / misses {s.cache_misses}")  # fmt: skip
        finally:
            client.close()
