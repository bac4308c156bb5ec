"""The swarm of bench/latency.py: `swarm node` processes on loopback, each a disjoint quarter of every layer's
experts, reached directly or through the delaying relay (bench/_relay.py); an engine opened on them in this
process, and one timed greedy generation with or without a drafter."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from _relay import relay

from swarm.coordinator.cli.spawn import LocalNode, start_nodes, stop_nodes
from swarm.coordinator.config import EngineConfig
from swarm.coordinator.decode.one import GenerationStats, SamplingParams, generate
from swarm.coordinator.engine import Engine, open_engine
from swarm.coordinator.experts.remote.dispatch import SwarmExperts
from swarm.node.client import NodeClient
from swarm.sharding.ranges import format_ranges
from swarm.sharding.slabs import read_manifest

log = logging.getLogger("bench.latency")

RELAY_HOST = "127.0.0.2"  # the relay listens here at the nodes' own port numbers (see bench/_relay.py)
Drafter = Callable[[Sequence[int]], Sequence[int]]


@dataclass
class Run:
    """One timed generation: its decode (the steps after the token prefill gives) and what it was spent on."""

    tps: float  # GenerationStats.decode_tps
    tokens: list[int]
    decode_s: float
    passes: int  # decode passes (forward passes after the prompt's)
    drafted: int = 0
    accepted: int = 0
    windows: int = 0
    wait_s: float = 0.0  # the model blocked on node replies during decode (SwarmExperts.wait_seconds)
    node_busy_s: list[float] = field(default_factory=list)  # each node's own compute during the run
    calls: int = 0  # calls the nodes answered during the run, all together
    hedges: int = 0  # calls hedged (sent again to another holder) during the run
    failovers: int = 0


def quarters(n_expert: int, n_nodes: int) -> list[str]:
    """Disjoint, contiguous expert ranges covering 0..n_expert-1, as `--experts` takes them."""
    cuts = [n_expert * i // n_nodes for i in range(n_nodes + 1)]
    return [format_ranges(list(range(cuts[i], cuts[i + 1]))) for i in range(n_nodes)]


class Nodes:
    """`swarm node SHARD --no-mdns --experts RANGE` processes (the node's defaults otherwise, one compute
    thread each as spawn_node starts them), kept for the whole bench."""

    def __init__(self, shard_dir: Path, n_nodes: int, workdir: Path) -> None:
        self.shard_dir = shard_dir
        ranges = quarters(read_manifest(shard_dir).n_expert, n_nodes)
        specs = [(shard_dir, ["--no-mdns", "--experts", r]) for r in ranges]
        self.nodes: list[LocalNode] = start_nodes(specs, workdir, timeout=600.0, prefix="latency-node")
        try:
            self.clients = [NodeClient(n.address, fingerprint=n.fingerprint) for n in self.nodes]
            self.stream_ports = [c.info().stream_port for c in self.clients]
        except BaseException:
            self.close()
            raise

    def direct(self) -> tuple[str, ...]:
        return tuple(n.address for n in self.nodes)

    def relayed(self) -> tuple[tuple[str, ...], list[tuple[str, str]], list[str]]:
        """The relay's gRPC addresses, its (listen, target) pairs (gRPC ports and compute streams) and the
        stream addresses among them."""
        grpc = [f"{RELAY_HOST}:{n.port}" for n in self.nodes]
        streams = [f"{RELAY_HOST}:{p}" for p in self.stream_ports]
        pairs = [(a, a.replace(RELAY_HOST, "127.0.0.1")) for a in grpc + streams]
        return tuple(grpc), pairs, streams

    def busy(self) -> list[tuple[float, int]]:
        """Each node's busy seconds and calls so far (asked directly, not through the relay)."""
        out = []
        for c in self.clients:
            s = c.stats()
            out.append((s.busy_seconds, s.calls))
        return out

    def alive(self) -> bool:
        return all(n.process.poll() is None for n in self.nodes)

    def close(self) -> None:
        for c in getattr(self, "clients", []):
            c.close()
        stop_nodes(self.nodes)


@contextlib.contextmanager
def linked(
    nodes: Nodes, rtt_ms: float | None, threads: int, audit: float, carried: dict[str, object]
) -> Iterator[Engine]:
    """An engine on the nodes: directly (rtt_ms None) or through a relay adding rtt_ms of round trip on
    every connection, gRPC and compute stream both. Once the block ends, `carried` gets what the relay said
    ("carried": bytes per listening address, "late_ms"; see bench/_relay.py) and "streams" (the compute
    streams' listening addresses), for the caller to check that every call crossed it."""
    from swarm.compute.ggml import set_threads

    set_threads(threads)
    if rtt_ms is None:
        stack: contextlib.AbstractContextManager[dict[str, object]] = contextlib.nullcontext({})
        peers, streams = nodes.direct(), []
    else:
        peers, pairs, streams = nodes.relayed()
        stack = relay(pairs, rtt_ms)
    with stack as said:
        engine = open_engine(nodes.shard_dir, EngineConfig(peers=peers, mdns=False, device="cpu", audit_rate=audit))
        try:
            yield engine
        finally:
            engine.close()
    carried.update(said, streams=streams)


def timed(engine: Engine, nodes: Nodes, prompt: Sequence[int], n_decode: int, drafter: Drafter | None) -> Run:
    """One greedy generation of n_decode tokens after `prompt` (no stop tokens: always n_decode), as `swarm
    run` makes it (generate() with the engine's answer checker); bookkeeping outside the timed decode."""
    swarm = engine.experts
    assert isinstance(swarm, SwarmExperts)
    stats = GenerationStats()
    params = SamplingParams(max_tokens=n_decode)
    it = generate(engine.model, list(prompt), params, engine.device, stats, checker=engine.checker,
                  drafter=drafter)  # fmt: skip
    first = next(it)  # the prompt's pass: its token is settled before decode begins
    w0, h0, f0 = swarm.wait_seconds, swarm.hedges, swarm.failovers
    b0 = nodes.busy()
    t0 = time.perf_counter()
    rest = list(it)
    wall = time.perf_counter() - t0
    w1, h1, f1 = swarm.wait_seconds, swarm.hedges, swarm.failovers
    b1 = nodes.busy()
    tokens = [first, *rest]
    accepted = int(stats.extra.get("accepted", 0))
    if abs(wall - stats.decode_seconds) > 0.05 * wall + 0.01:
        log.warning(
            "decode took %.3f s by the bench's clock, %.3f s by generate()'s", wall, stats.decode_seconds
        )
    return Run(
        tps=stats.decode_tps,
        tokens=tokens,
        decode_s=stats.decode_seconds,
        # each pass yields the token after its last kept row, and one more per kept draft
        passes=max(1, len(tokens) - 1 - accepted),
        drafted=int(stats.extra.get("drafted", 0)),
        accepted=accepted,
        windows=int(stats.extra.get("windows", 0)),
        wait_s=w1 - w0,
        node_busy_s=[b[0] - a[0] for a, b in zip(b0, b1, strict=True)],
        calls=sum(b[1] - a[1] for a, b in zip(b0, b1, strict=True)),
        hedges=h1 - h0,
        failovers=f1 - f0,
    )
