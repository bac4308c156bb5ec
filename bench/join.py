"""Decode through joined nodes (`swarm node --join`: the node dials out, the coordinator's calls come back
over its link) against the same node processes dialed directly (--peer), on loopback with 0 ms added and
through the delaying relay (bench/_relay.py) at 5 ms of round trip.

    .venv/bin/python bench/join.py [--layers 2] [--nodes 2] [--reps 20] [--tokens 6] [--workdir DIR]

Model: `swarm synth` at qwen3-30b-a3b's layer shape (bench/_models.py), --layers layers. The nodes hold
disjoint expert ranges and are started once per delay with --join (an invite to a listener of this
process, through the relay at 5 ms); the same processes are also reachable at their own ports, so one
engine takes them as --peer (through the relay at 5 ms: gRPC and compute stream) and another as joined
nodes, both open at once; repetitions alternate which one decodes first. A joined link is TLS (the
swarm key's identity) where the direct path on loopback is plain TCP: the joined figure pays TLS as a link
off loopback would, the direct one does not. Figures go to the `bench:join` section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from _doc import replace_section
from _latency_swarm import quarters
from _models import prepare, prompt_tokens
from _relay import relay

from swarm.coordinator.cli.spawn import spawn_node, stop_nodes
from swarm.coordinator.config import EngineConfig
from swarm.coordinator.decode.one import GenerationStats, SamplingParams, generate
from swarm.coordinator.engine import Engine, open_engine
from swarm.node.auth import SwarmKey, generate_key_text
from swarm.node.client import NodeClient
from swarm.node.invite import make_invite
from swarm.sharding.identity import identity_of
from swarm.sharding.slabs import read_manifest

ROOT = Path(__file__).resolve().parent.parent
RELAY_HOST = "127.0.0.2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call_ms(direct: Engine, joined: Engine, calls: int) -> tuple[float, float]:
    """Median round trip (ms) of a decode-sized Compute call (4 experts, a row each) to the same node over
    its direct client and its joined one, the two alternating call by call so that the load of the moment
    weighs on both alike."""
    layer, _ = direct.experts.needed[0]
    clients = []
    for engine in (direct, joined):
        swarm = engine.experts
        holder = sorted(swarm.placement.holders()[(layer, 0)])[0]
        clients.append(swarm.clients[holder])
    rows = np.ones((4, clients[0].info().hidden_size), np.float32)
    times: list[list[float]] = [[], []]
    for i in range(calls):
        for k in (0, 1) if i % 2 == 0 else (1, 0):
            t0 = time.perf_counter()
            clients[k].compute(layer, [0, 1, 2, 3], [1, 1, 1, 1], rows, timeout=30)
            times[k].append(time.perf_counter() - t0)
    return statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3


def decode_tps(engine: Engine, prompt: list[int], tokens: int) -> float:
    stats = GenerationStats()
    list(generate(engine.model, prompt, SamplingParams(max_tokens=tokens), engine.device, stats))
    return stats.decode_tps


@contextlib.contextmanager
def swarm_at(shard: Path, args: argparse.Namespace, rtt_ms: float, work: Path) -> Iterator[tuple[Engine, Engine]]:
    """(direct engine, joined engine) on one set of node processes, with rtt_ms of round trip added (0: none)."""
    work.mkdir(parents=True, exist_ok=True)
    key_text = generate_key_text()
    key_file = work / "swarm.key"
    key_file.write_text(key_text)
    key = SwarmKey.from_text(key_text)
    port = free_port()
    dial_host = RELAY_HOST if rtt_ms else "127.0.0.1"
    invite = work / "invite.txt"
    invite.write_text(make_invite(key, identity_of(shard), [f"{dial_host}:{port}"]).text())
    ranges = quarters(read_manifest(shard).n_expert, args.nodes)
    env = {"SWARM_KEY_FILE": str(key_file)}
    nodes = [spawn_node(shard, ["--experts", r, "--join", str(invite)], work, f"join{i}", env)
             for i, r in enumerate(ranges)]  # fmt: skip
    try:
        for n in nodes:
            n.wait_ready(600)
        addresses = [n.address for n in nodes]
        streams = []
        for a in addresses:
            with NodeClient(a, key=key) as c:
                streams.append(f"127.0.0.1:{c.info().stream_port}")
        pairs = [(a.replace("127.0.0.1", RELAY_HOST), a) for a in [*addresses, *streams, f"127.0.0.1:{port}"]]
        peers = tuple(a.replace("127.0.0.1", RELAY_HOST) for a in addresses) if rtt_ms else tuple(addresses)
        stack = relay(pairs, rtt_ms) if rtt_ms else contextlib.nullcontext({})
        with stack:
            base = dict(mdns=False, device="cpu", key=key, audit_rate=0.0)
            joined = open_engine(shard, EngineConfig(listen=f"127.0.0.1:{port}", wait=120.0, **base))
            direct = open_engine(shard, EngineConfig(peers=peers, **base))
            try:
                yield direct, joined
            finally:
                direct.close()
                joined.close()
    finally:
        stop_nodes(nodes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tokens", type=int, default=6)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--calls", type=int, default=2000, help="alternating calls for the per-call round trip")
    p.add_argument("--rtts", default="0,5", help="round trips to add, ms (comma-separated)")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--no-doc", action="store_true", help="print the figures, leave docs/BENCHMARKS.md alone")
    args = p.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="swarm-bench-join-"))
    work.mkdir(parents=True, exist_ok=True)
    _, shard = prepare("qwen3moe", args.layers, work)
    rows = []
    load = os.getloadavg()[0]
    for rtt in [float(x) for x in args.rtts.split(",")]:
        with swarm_at(shard, args, rtt, work / f"rtt{rtt:g}") as (direct, joined):
            prompt = prompt_tokens(direct, args.prompt_tokens)
            decode_tps(direct, prompt, 4), decode_tps(joined, prompt, 4)  # warm: slabs read, links open
            got: dict[str, list[float]] = {"direct": [], "joined": []}
            for rep in range(args.reps):
                order = [("direct", direct), ("joined", joined)]
                for name, engine in order if rep % 2 == 0 else order[::-1]:
                    got[name].append(decode_tps(engine, prompt, args.tokens))
            d, j = statistics.median(got["direct"]), statistics.median(got["joined"])
            # each repetition's pair ran seconds apart: its ratio is what the load of the moment moved least
            ratios = sorted(b / a for a, b in zip(got["direct"], got["joined"], strict=True))
            q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
            cd, cj = call_ms(direct, joined, args.calls)
            rows.append((rtt, d, j, q[1], q[0], q[2], cd, cj))
            print(f"rtt {rtt:g} ms: direct {d:.2f} tok/s, joined {j:.2f} tok/s, ratio {q[1]:.3f}x; "
                  f"a call {cd:.2f} / {cj:.2f} ms", flush=True)  # fmt: skip
    table = [
        "| added round trip | direct (--peer) tok/s | joined (--join) tok/s | joined / direct (median of the pairs) "
        "| pairs' quartiles | a call, direct / joined (ms) | direct / joined call speed |",
        "|---|---|---|---|---|---|---|",
        *(f"| {r:g} ms | {d:.2f} | {j:.2f} | {x:.3f}x | {lo:.3f}-{hi:.3f} | {cd:.2f} / {cj:.2f} | {cd / cj:.3f}x |"
          for r, d, j, x, lo, hi, cd, cj in rows),  # fmt: skip
    ]
    text = "\n".join([
        f"`.venv/bin/python bench/join.py --layers {args.layers} --nodes {args.nodes} --reps {args.reps} "
        f"--tokens {args.tokens}`: qwen3-30b-a3b layer shape, {args.layers} layers, {args.nodes} node processes "
        f"on loopback (one compute thread each), {args.reps} alternating repetitions of {args.tokens} decode "
        "tokens each way: tok/s medians, and the median and quartiles of each repetition's joined/direct ratio; "
        f"then {args.calls} decode-sized calls (4 experts, a row each) to one node alternating between its "
        "direct and its joined client, medians; "
        f"{platform.machine()}, {os.cpu_count()} cores shared with other work (load average {load:.1f} at the "
        "start). The joined link is TLS, the direct path on loopback plain TCP.",
        "",
        *table,
    ])  # fmt: skip
    print(text)
    if not args.no_doc:
        replace_section("join", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
