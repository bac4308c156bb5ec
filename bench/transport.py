"""What one Compute call costs beside its compute: the compute stream against gRPC, on a real node process.

    .venv/bin/python bench/transport.py [--calls 2000] [--blocks 6] [--workdir /work/bench-models/decode]

One `swarm node` on loopback (bench/zero_node.py: the real node, its checks, decoding and encoding, answering
zeros instead of multiplying, so that only the transport is timed) holding experts of bench/decode's model
(Qwen3.6-35B-A3B layer shape, D 2048). A NodeClient calls it one call at a time, as a decode step does per
node and layer, over its compute stream and over gRPC, alternating in blocks. Per call: the wall time (p50),
the CPU time of the calling process (every thread of it: the caller, the client's threads, gRPC's) and of the
node process (psutil). Two payloads: a decode call (2 rows of D f32, 16 KiB each way) and a prompt call
(128 rows, 1 MiB each way). Medians over the blocks. Figures go to the `bench:transport` section of
docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _doc import command, machine, publish  # noqa: E402
from _engines import ZERO_NODE  # noqa: E402
from _loopback import LOOPBACK  # noqa: E402
from _models import prepare  # noqa: E402

from swarm.coordinator.cli.spawn import start_nodes, stop_nodes  # noqa: E402
from swarm.node.client import NodeClient  # noqa: E402

log = logging.getLogger("bench.transport")


def block(
    client: NodeClient, node: psutil.Process, rows: torch.Tensor, calls: int
) -> tuple[float, float, float]:
    """(p50 wall, caller CPU, node CPU) per call, in microseconds, over `calls` calls."""
    ids, counts = [0, 1], [rows.shape[0] // 2, rows.shape[0] - rows.shape[0] // 2]
    walls = []
    node0, cpu0 = sum(node.cpu_times()[:2]), time.process_time()
    for _ in range(calls):
        t0 = time.perf_counter()
        client.compute(0, ids, counts, rows, timeout=30)
        walls.append(time.perf_counter() - t0)
    cpu, node_cpu = time.process_time() - cpu0, sum(node.cpu_times()[:2]) - node0
    return statistics.median(walls) * 1e6, cpu / calls * 1e6, node_cpu / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--calls", type=int, default=2000, help="calls per block (decode payload; a tenth for prompts)"
    )
    p.add_argument("--blocks", type=int, default=6, help="blocks per transport and payload, alternating")
    p.add_argument("--workdir", type=Path, default=Path("/work/bench-models/decode"))
    p.add_argument("--no-write", action="store_true", help="print, do not write docs/BENCHMARKS.md")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(1)
    args.workdir.mkdir(parents=True, exist_ok=True)
    _, shard_dir = prepare("qwen35moe", 4, args.workdir)
    spec = ["--host", LOOPBACK, "--experts", "0-7", "--threads", "1", "--no-verify", "--no-mdns"]
    (node,) = start_nodes(
        [(shard_dir, spec)], args.workdir / "transport-nodes", timeout=120.0, program=ZERO_NODE
    )
    try:
        proc = psutil.Process(node.process.pid)
        with NodeClient(node.address, fingerprint=node.fingerprint) as grpc_client:
            port = grpc_client.info().stream_port
            with NodeClient(node.address, fingerprint=node.fingerprint, stream_port=port) as stream_client:
                clients = {"compute stream": stream_client, "gRPC": grpc_client}
                payloads = {
                    "decode, 2 rows": (2, args.calls),
                    "prompt, 128 rows": (128, max(50, args.calls // 10)),
                }
                results: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
                for name, (n, calls) in payloads.items():
                    rows = torch.randn(n, 2048)
                    for c in clients.values():
                        block(c, proc, rows, 50)  # connections open, graphs and buffers warm
                    for b in range(args.blocks):
                        order = list(clients.items()) if b % 2 == 0 else list(reversed(clients.items()))
                        for transport, c in order:
                            results.setdefault((name, transport), []).append(block(c, proc, rows, calls))
                    log.info("%s done", name)
    finally:
        stop_nodes([node])

    def med(key: tuple[str, str], i: int) -> float:
        return statistics.median(r[i] for r in results[key])

    lines = [
        "## Transport: what one Compute call costs beside its compute (`bench/transport.py`)",
        "",
        f"Command: `{command('transport.py', argv)}`  ",
        f"Machine: {machine()}; Python gRPC {__import__('grpc').__version__}.  ",
        "One `swarm node` on loopback answering zeros (bench/zero_node.py: the real node's checks, decoding and "
        "encoding, no products), D 2048, f32 rows; one call at a time as a decode step makes them per node and "
        f"layer; {args.blocks} blocks per transport, alternating; medians. CPU per call counts every thread of "
        "each process.",
        "",
        "| call | transport | wall p50 µs | caller CPU µs | node CPU µs | both, µs |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for name in payloads:
        for transport in clients:
            k = (name, transport)
            lines.append(
                f"| {name} | {transport} | {med(k, 0):,.0f} | {med(k, 1):,.0f} | {med(k, 2):,.0f} | "
                f"{med(k, 1) + med(k, 2):,.0f} |"
            )
    lines.append("")
    for name in payloads:
        s, g = (name, "compute stream"), (name, "gRPC")
        lines.append(
            f"- {name}: the stream takes {(med(s, 1) + med(s, 2)) / (med(g, 1) + med(g, 2)):.2f}x gRPC's CPU per "
            f"call and {med(s, 0) / med(g, 0):.2f}x its wall time."
        )
    publish("transport", "\n".join(lines), write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
