"""Our engine, timed: `swarm run GGUF --local` in process, or `swarm run SHARD_DIR` over loopback nodes, each
pass in a fresh process as a user meets it."""

from __future__ import annotations

import gc
import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from _loopback import LOOPBACK
from _timing import Run, run_engine

from swarm.compute.ggml import set_threads
from swarm.compute.openmp import wait_policy_env
from swarm.coordinator.cli.spawn import SWARM_CLI, LocalNode, start_nodes, stop_nodes
from swarm.coordinator.config import EngineConfig
from swarm.coordinator.engine import open_engine
from swarm.coordinator.experts.remote.dispatch import SwarmExperts
from swarm.node.client import NodeClient
from swarm.sharding.ranges import format_ranges
from swarm.sharding.slabs import read_manifest

# Nodes that answer zeros (the transport's floor): the real `swarm node` under bench/zero_node.py.
ZERO_NODE: tuple[str, ...] = (str(Path(__file__).resolve().parent / "zero_node.py"),)


def run_inprocess(gguf: Path, n_prompt: int, n_decode: int, threads: int, numerics: str) -> Run:
    """`swarm run GGUF --local`: the whole file, experts in this process."""
    set_threads(threads)
    # exact: no cap on the float32 copies (all of them, 13 GB, fit this machine; the default half-RAM budget
    # would thrash by a few experts and time the LRU, not the numerics)
    budget = 0 if numerics == "exact" else None
    engine = open_engine(gguf, EngineConfig(local=True, device="cpu", numerics=numerics, memory_budget=budget))
    try:
        return run_engine(engine, n_prompt, n_decode)
    finally:
        engine.close()
        del engine
        gc.collect()


def split(n: int, parts: int) -> list[list[int]]:
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def run_swarm(
    shard_dir: Path,
    n_nodes: int,
    node_threads: int,
    n_prompt: int,
    n_decode: int,
    workdir: Path,
    threads: int,
    numerics: str,
    audit: float | None = None,
    program: Sequence[str] = SWARM_CLI,
    by_layer: bool = False,
    stream: bool = True,
) -> Run:
    """`swarm run` over loopback nodes; `audit`: the share of node answers checked (None: the default);
    `program`: what runs the nodes' CLI (ZERO_NODE: nodes that answer zeros, the transport's floor);
    `by_layer`: each node holds every expert of a range of the MoE layers (llama.cpp's RPC placement: one call
    per layer and step) instead of a range of every layer's experts (a call to every node per layer); `stream`:
    Compute calls over the nodes' compute streams (the default) or, with False, over gRPC (`--no-stream`)."""
    set_threads(threads)
    manifest = read_manifest(shard_dir)
    if by_layer:
        held = [["--layers", format_ranges([manifest.moe_layers[i] for i in r])]
                for r in split(len(manifest.moe_layers), n_nodes)]  # fmt: skip
    else:
        held = [["--experts", format_ranges(r)] for r in split(manifest.n_expert, n_nodes)]
    specs = [
        (shard_dir, ["--host", LOOPBACK, *h, "--threads", str(node_threads), "--no-verify",
                     *(() if stream else ("--no-stream",))])
        for h in held
    ]  # fmt: skip
    nodes: list[LocalNode] = start_nodes(specs, workdir / "nodes", timeout=120.0, program=program)
    engine = None
    clients: list[NodeClient] = []
    try:
        engine = open_engine(
            shard_dir,
            EngineConfig(mdns_interfaces=[LOOPBACK], wait=20.0, device="cpu", numerics=numerics,
                         **{} if audit is None else {"audit_rate": audit}),
        )  # fmt: skip
        assert isinstance(engine.experts, SwarmExperts)
        if len(engine.experts.clients) != n_nodes:
            raise RuntimeError(f"found {len(engine.experts.clients)} nodes by mDNS, started {n_nodes}")
        clients = [NodeClient(n.address, fingerprint=n.fingerprint) for n in nodes]
        return run_engine(engine, n_prompt, n_decode, clients)
    finally:
        for c in clients:
            c.close()
        if engine is not None:
            engine.close()
        stop_nodes(nodes)


def _call(fn: Callable[[], Run]) -> Run:
    return fn()


def in_child(fn: Callable[[], Run], experts_remote: bool) -> Callable[[], Run]:
    """fn in a fresh process whose OpenMP wait policy is the one `swarm run` would pick (set before the
    child loads torch, which is the only time it counts)."""

    def run() -> Run:
        env = wait_policy_env(experts_remote)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                return pool.submit(_call, fn).result()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    return run
