"""Benchmark a node on the Qwen3.6-35B-A3B expert shape (D 2048, F 512, Q4_K experts).

1. Compute throughput: rows/s of ExpertStore.compute (warm working copies) at 1, 8 and 64 rows per expert,
   8 experts per call as a node serves a layer, against torch's own float32 matmuls of the same math on the
   same (already float32) weights, interleaved in one run; plus the cost of dequantizing one Q4_K expert (what
   a call pays for an expert evicted under --memory): the store's torch path (swarm.compute.dequant) against the
   former gguf-py numpy path, and per quant type the torch dequantizer against gguf-py's numpy one.
2. Loopback round trip to a real `swarm node` process: p50/p99 of a decode-sized Compute (8 rows of 2048 f16,
   one row for each of 8 experts) against a gRPC health check (an empty call) on the same channel.

    .venv/bin/python bench/node.py [--reps 30] [--rtt-calls 300] [--no-write]

Figures go to the `bench:node` section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from _doc import replace_section
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

from swarm.compute.dequant import dequantize
from swarm.compute.expert_weights import dequantize_expert
from swarm.compute.store import ExpertStore
from swarm.coordinator.cli.spawn import start_nodes, stop_nodes
from swarm.node.client import NodeClient
from swarm.sharding import gguf_io
from swarm.sharding.slabs import ExpertSlab, SlabTensor, slabs_from_gguf
from swarm.sharding.synth import synthesize
from swarm.sharding.synth_spec import preset

log = logging.getLogger("bench.node")

SECTION = "node"
EXPERTS_PER_CALL = 8
EXPERT_D, EXPERT_F = 2048, 512
DEQUANT_TYPES = (
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
# gguf-py cannot quantize to these; their blocks are random bytes with the float16 scale fields (d, dmin) set
# to a model's magnitudes, so that no scale is a subnormal (which would slow both dequantizers alike).
K_SCALE_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def synth_model(tmp: Path) -> Path:
    path = tmp / "qwen36-experts.gguf"
    spec = preset(
        "qwen3.6-35b-a3b", n_layers=1, n_expert=EXPERTS_PER_CALL, n_vocab=300, experts_type="Q4_K", mtp=0
    )
    return synthesize(path, spec)


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] * 1e6


def bench_compute(store: ExpertStore, reps: int) -> list[dict[str, float]]:
    layer = store.layers()[0]
    experts = [e for (la, e) in store.held() if la == layer][:EXPERTS_PER_CALL]
    # torch's own float32 math on the same dequantized weights: separate gate and up matmuls, no store.
    plain = [dequantize_expert(store.slabs[(layer, e)]) for e in experts]
    ws = [(w.gate.contiguous(), w.up.contiguous(), w.down) for w in plain]

    def torch_ref(x: torch.Tensor, n: int) -> torch.Tensor:
        out = torch.empty_like(x)
        for i, (g, u, d) in enumerate(ws):
            xs = x[i * n : (i + 1) * n]
            out[i * n : (i + 1) * n] = F.linear(F.silu(F.linear(xs, g)) * F.linear(xs, u), d)
        return out

    rows_out = []
    for n in (1, 8, 64):
        x = torch.randn(n * len(experts), store.hidden_size or 0)
        counts = [n] * len(experts)
        store.compute(layer, experts, counts, x)  # warm the working copies
        assert torch.allclose(store.compute(layer, experts, counts, x), torch_ref(x, n), rtol=1e-4, atol=1e-4)
        ts, tt = [], []
        for _ in range(reps):  # interleaved: both see the same machine load
            t0 = time.perf_counter()
            store.compute(layer, experts, counts, x)
            t1 = time.perf_counter()
            torch_ref(x, n)
            t2 = time.perf_counter()
            ts.append(t1 - t0)
            tt.append(t2 - t1)
        total = n * len(experts)
        rows_out.append(
            {
                "n": n,
                "threads": torch.get_num_threads(),
                "store_rows_s": total / statistics.median(ts),
                "torch_rows_s": total / statistics.median(tt),
                "store_us": median_us(ts),
                "torch_us": median_us(tt),
            }
        )
    return rows_out


def bench_layout(store: ExpertStore, reps: int) -> list[dict[str, float]]:
    """The working-copy layout choice: F.linear on gate_up [2F, D] as stored vs a pre-transposed [D, 2F] copy."""
    w = store.weights(*store.held()[0])
    gu_t, down_t = w.gate_up.t().contiguous(), w.down.t().contiguous()
    out = []
    for n in (1, 8, 64):
        x = torch.randn(n, store.hidden_size or 0)
        a_s, b_s = [], []
        for _ in range(reps * 4):
            t0 = time.perf_counter()
            h = F.linear(x, w.gate_up)
            g, u = h.chunk(2, dim=-1)
            F.linear(F.silu(g) * u, w.down)
            t1 = time.perf_counter()
            h = x @ gu_t
            g, u = h.chunk(2, dim=-1)
            (F.silu(g) * u) @ down_t
            t2 = time.perf_counter()
            a_s.append(t1 - t0)
            b_s.append(t2 - t1)
        out.append({"n": n, "stored_us": median_us(a_s), "transposed_us": median_us(b_s)})
    return out


def numpy_expert(slab: ExpertSlab) -> tuple[torch.Tensor, torch.Tensor]:
    """The store's dequantization before swarm.compute.dequant: gguf-py numpy per slab, gate and up joined by cat."""

    def load(s: SlabTensor | None) -> torch.Tensor:
        assert s is not None
        return torch.from_numpy(gguf_io.dequantize(s.data, s.qtype, s.shape))

    return torch.cat([load(slab.gate), load(slab.up)]), load(slab.down)


def bench_dequant(store: ExpertStore, reps: int) -> dict[str, float]:
    """One Q4_K expert through ExpertStore.dequantize_expert (torch) vs the former numpy path, interleaved."""
    parts = store.slabs[store.held()[0]]
    w = dequantize_expert(parts)
    gate_up, down = numpy_expert(parts)
    assert torch.equal(w.gate_up.view(torch.int32), gate_up.view(torch.int32))
    assert torch.equal(w.down.view(torch.int32), down.view(torch.int32))
    tt, tn = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        dequantize_expert(parts)
        t1 = time.perf_counter()
        numpy_expert(parts)
        t2 = time.perf_counter()
        tt.append(t1 - t0)
        tn.append(t2 - t1)
    return {"torch_ms": statistics.median(tt) * 1e3, "numpy_ms": statistics.median(tn) * 1e3}


def expert_bytes(name: str, rng: np.random.Generator) -> np.ndarray:
    """One expert's worth (gate + up + down, 3F x D values) of blocks of quant type `name`, as bytes."""
    qtype = GGMLQuantizationType[name]
    block, size = GGML_QUANT_SIZES[qtype]
    n = 3 * EXPERT_F * EXPERT_D
    if name in K_SCALE_FIELDS:
        blocks = rng.integers(0, 256, (n // block, size), dtype=np.uint8)
        for off in K_SCALE_FIELDS[name]:
            scales = (rng.uniform(0.5, 1.5, n // block) * 1e-3).astype(np.float16)
            blocks[:, off : off + 2] = scales.view(np.uint8).reshape(-1, 2)
        return blocks.reshape(-1)
    values = rng.standard_normal((3 * EXPERT_F, EXPERT_D), dtype=np.float32) * EXPERT_D**-0.5
    return np.ascontiguousarray(quantize(values, qtype)).view(np.uint8).reshape(-1)


def bench_dequant_types(reps: int) -> list[dict[str, float | str]]:
    """Per quant type, one expert's bytes: gguf-py numpy (gguf_io.dequantize) vs the torch dequantizer at
    1 and at the default number of torch threads, interleaved; checked bit-identical first."""
    rng = np.random.default_rng(0)
    shape = (3 * EXPERT_F, EXPERT_D)
    threads = torch.get_num_threads()
    out = []
    for name in DEQUANT_TYPES:
        qtype = GGMLQuantizationType[name]
        raw = expert_bytes(name, rng)
        want = torch.from_numpy(gguf_io.dequantize(raw, qtype, shape))
        assert torch.equal(dequantize(raw, qtype, shape).view(torch.int32), want.view(torch.int32)), name
        # One pass per torch thread count, gguf-py's numpy code (single-threaded) interleaved in both.
        tn: list[float] = []
        tt: dict[int, list[float]] = {1: [], threads: []}
        for n_threads in sorted(tt):
            torch.set_num_threads(n_threads)
            for _ in range(reps):
                t0 = time.perf_counter()
                gguf_io.dequantize(raw, qtype, shape)
                t1 = time.perf_counter()
                dequantize(raw, qtype, shape)
                t2 = time.perf_counter()
                tn.append(t1 - t0)
                tt[n_threads].append(t2 - t1)
        torch.set_num_threads(threads)
        out.append(
            {
                "type": name,
                "mb": raw.nbytes / 1e6,
                "numpy_ms": statistics.median(tn) * 1e3,
                "torch1_ms": statistics.median(tt[1]) * 1e3,
                "torch_ms": statistics.median(tt[threads]) * 1e3,
            }
        )
        log.info("dequant %s: %s", name, out[-1])
    return out


def bench_rtt(model: Path, calls: int, tmp: Path) -> dict[str, float]:
    args = ["--no-mdns", "--workers", "4", "--threads", str(torch.get_num_threads())]
    (node,) = start_nodes([(model, args)], tmp / "nodes")
    try:
        client = NodeClient(node.address, fingerprint=node.fingerprint)
        x = torch.randn(EXPERTS_PER_CALL, 2048).to(torch.float16)
        experts, counts = list(range(EXPERTS_PER_CALL)), [1] * EXPERTS_PER_CALL
        for _ in range(20):  # warm: connection, working copies
            client.compute(0, experts, counts, x)
            client.health()
        compute, empty = [], []
        before = client.stats()
        for _ in range(calls):
            t0 = time.perf_counter()
            client.compute(0, experts, counts, x)
            t1 = time.perf_counter()
            client.health()
            t2 = time.perf_counter()
            compute.append(t1 - t0)
            empty.append(t2 - t1)
        after = client.stats()
        busy_us = (after.busy_seconds - before.busy_seconds) / max(1, after.calls - before.calls) * 1e6
        client.close()
    finally:
        stop_nodes([node])
    return {
        "compute_p50": pct(compute, 0.5),
        "compute_p99": pct(compute, 0.99),
        "empty_p50": pct(empty, 0.5),
        "empty_p99": pct(empty, 0.99),
        "node_busy_us": busy_us,
        "compute_mean": statistics.mean(compute) * 1e6,
        "empty_mean": statistics.mean(empty) * 1e6,
    }


def render(
    cmd: str,
    comp: list[dict[str, float]],
    layout: list[dict[str, float]],
    dq: dict[str, float],
    dq_types: list[dict[str, float | str]],
    rtt: dict[str, float],
) -> str:
    lines = [
        f"<!-- bench:{SECTION} -->",
        "## Node: expert compute and loopback round trip (`bench/node.py`)",
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, "
        f"Python {platform.python_version()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.  ",
        f"Shape: Qwen3.6-35B-A3B experts, D 2048, F 512, Q4_K (synthesized), {EXPERTS_PER_CALL} experts per call. "
        "Medians of interleaved runs; the machine is shared, so read the ratios.",
        "",
        "| torch threads | rows per expert | ExpertStore.compute rows/s | torch f32 matmuls rows/s | ratio | "
        "store µs/call | torch µs/call |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in comp:
        lines.append(
            f"| {r['threads']} | {r['n']} | {r['store_rows_s']:,.0f} | {r['torch_rows_s']:,.0f} | "
            f"{r['store_rows_s'] / r['torch_rows_s']:.2f} | {r['store_us']:,.0f} | {r['torch_us']:,.0f} |"
        )
    lines += [
        "",
        "Working-copy layout (one expert, µs per SwiGLU): F.linear on the stored [2F, D] gate_up and [D, F] down "
        "(what the store keeps) vs matmuls on pre-transposed contiguous copies:",
        "",
        "| rows | stored [out, in] µs | pre-transposed µs |",
        "| ---: | ---: | ---: |",
        *[f"| {r['n']} | {r['stored_us']:,.0f} | {r['transposed_us']:,.0f} |" for r in layout],
    ]
    lines += [
        "",
        f"Dequantizing one Q4_K expert (gate+up+down) to float32, the extra cost of a call whose expert was evicted "
        f"under `--memory`: {dq['torch_ms']:.1f} ms with `ExpertStore.dequantize_expert` (torch, `swarm.compute.dequant`) "
        f"against {dq['numpy_ms']:.1f} ms the former way (gguf-py numpy per slab, then torch.cat): "
        f"{dq['numpy_ms'] / dq['torch_ms']:.1f}x, the same bits.",
        "",
        "Per quant type, one expert's bytes (3F x D = 3.1 M values), `swarm.compute.dequant.dequantize` against gguf-py's "
        "numpy dequantizer (`swarm.sharding.gguf_io.dequantize`), interleaved, checked bit-identical; MB/s of "
        "quantized input. Blocks quantized by gguf-py from normal values, or (Q2_K..Q6_K, which gguf-py cannot "
        "quantize) random bytes with model-sized float16 scales. Both include allocating the float32 output.",
        "",
        f"| type | MB | gguf-py numpy ms | torch 1 thread ms | torch {torch.get_num_threads()} threads ms | "
        "numpy MB/s | torch 1 thread MB/s | torch MB/s | speedup 1 thread | speedup |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *[
            f"| {r['type']} | {r['mb']:.2f} | {r['numpy_ms']:.2f} | {r['torch1_ms']:.2f} | {r['torch_ms']:.2f} | "
            f"{r['mb'] / r['numpy_ms'] * 1e3:,.0f} | {r['mb'] / r['torch1_ms'] * 1e3:,.0f} | "
            f"{r['mb'] / r['torch_ms'] * 1e3:,.0f} | {r['numpy_ms'] / r['torch1_ms']:.1f}x | "
            f"{r['numpy_ms'] / r['torch_ms']:.1f}x |"
            for r in dq_types
        ],
        "",
        "Loopback round trip to a `swarm node` process (same channel, alternating calls):",
        "",
        "| call | p50 µs | p99 µs |",
        "| --- | ---: | ---: |",
        f"| Compute, 8 rows of 2048 f16 (1 row x 8 experts) | {rtt['compute_p50']:,.0f} | {rtt['compute_p99']:,.0f} |",
        f"| gRPC health check (empty call) | {rtt['empty_p50']:,.0f} | {rtt['empty_p99']:,.0f} |",
        "",
        f"Means over the same calls: Compute {rtt['compute_mean']:,.0f} µs round trip, of which the node spent "
        f"{rtt['node_busy_us']:,.0f} µs computing (Stats busy time), so decode, encode and the wire cost about "
        f"{rtt['compute_mean'] - rtt['node_busy_us']:,.0f} µs per call; an empty call costs {rtt['empty_mean']:,.0f} µs.",
        f"<!-- /bench:{SECTION} -->",
    ]
    return "\n".join(lines)


def write_section(text: str) -> None:
    replace_section(SECTION, text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--rtt-calls", type=int, default=300)
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads here and in the node (default: torch's)"
    )
    p.add_argument(
        "--no-write", action="store_true", help="print the section instead of writing docs/BENCHMARKS.md"
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    cmd = "python bench/node.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = synth_model(tmp)
        store = ExpertStore(slabs_from_gguf(model))
        log.info("compute throughput ...")
        comp = []
        default_threads = torch.get_num_threads()
        for threads in sorted({1, default_threads}):  # many threads can lose badly on a busy machine
            torch.set_num_threads(threads)
            comp += bench_compute(store, args.reps)
        torch.set_num_threads(default_threads)
        layout = bench_layout(store, args.reps)
        dq = bench_dequant(store, args.reps)
        log.info("dequantization per type ...")
        dq_types = bench_dequant_types(max(5, args.reps // 2))
        log.info("loopback round trip ...")
        rtt = bench_rtt(model, args.rtt_calls, tmp)
    text = render(cmd, comp, layout, dq, dq_types, rtt)
    print(text)
    if not args.no_write:
        write_section(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
