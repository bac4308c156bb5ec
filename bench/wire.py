"""Reading a prompt over slow links with each wire format (f32, f16, bf16, q8): nodes in network namespaces,
every link shaped with tc tbf, the coordinator in this process.

    sudo .venv/bin/python bench/wire.py [--reps 3] [--rates 100mbit,20mbit] [--prompt-tokens 300]

Model: the `swarm synth` file at Qwen3.6-35B-A3B's layer shape (bench/_models.py: 4 layers, D 2048, E 256,
K 8, F 512, Q4_K experts, Q8_0 dense). Swarm: 4 nodes (`--threads 1`, 64 experts each), each in a network
namespace of its own on a bridge, its veth shaped in both directions with `tc tbf` at the rate in turn; the
coordinator (this process) opens one engine per wire format on the same nodes, so the configurations differ
only in what the calls carry. Per rate, each repetition reads the prompt once with each engine, in a
rotating order; medians. A prompt is read as `swarm run` reads one: the logits of its last token only.
q8's logits must be f32's bit for bit (the bench stops otherwise); f16's and bf16's are not. Figures go to the `bench:wire` section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "deploy"))
from _doc import command, machine, publish  # noqa: E402
from _models import prepare, prompt_tokens  # noqa: E402
from netns_swarm import Net, build_network, sh, tear_down  # noqa: E402

from swarm.coordinator.cli.spawn import SWARM_CLI, LocalNode  # noqa: E402
from swarm.coordinator.config import EngineConfig, Wire  # noqa: E402
from swarm.coordinator.decode.one import forward_one  # noqa: E402
from swarm.coordinator.engine import open_engine  # noqa: E402
from swarm.node.auth import KEY_ENV, SwarmKey, generate_key_text  # noqa: E402
from swarm.sharding.slabs import read_manifest  # noqa: E402

WIRES = ("f32", "f16", "bf16", "q8")
NODES = 4


def shape_links(net: Net, rate: str | None) -> None:
    """Every node's link at `rate` in both directions (None: unshaped)."""
    for i in range(NODES):
        for where in ((), ("ip", "netns", "exec", net.ns(i))):
            dev = net.veth(i) if not where else "eth0"
            if rate is None:
                sh(*where, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            else:
                sh(*where, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "64kb",
                   "latency", "100ms")  # fmt: skip


def start_nodes(net: Net, shard_dir: Path, workdir: Path, key_text: str) -> list[LocalNode]:
    n_expert = read_manifest(shard_dir).n_expert
    cuts = [n_expert * i // NODES for i in range(NODES + 1)]
    nodes = []
    for i in range(NODES):
        ready, log = workdir / f"node{i}.ready.json", workdir / f"node{i}.log"
        cmd = ["ip", "netns", "exec", net.ns(i), sys.executable, *SWARM_CLI, "node", str(shard_dir),
               "--host", net.ip(i), "--port", "0", "--ready-file", str(ready), "--exit-with-parent",
               "--threads", "1", "--no-mdns", "--experts", f"{cuts[i]}-{cuts[i + 1] - 1}"]  # fmt: skip
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, KEY_ENV: key_text})  # fmt: skip
        nodes.append(LocalNode(proc, ready, log))
    for n in nodes:
        n.wait_prepared(600)
    return nodes


def read_prompt(engine: object, tokens: list[int]) -> tuple[tuple[float, float], torch.Tensor]:
    """((seconds, of them those the coordinator waited on the nodes: the wire's part), the logits)."""
    waited, t0 = engine.experts.wait_seconds, time.perf_counter()
    logits = forward_one(engine.model, tokens, engine.model.new_state(), "cpu", last_only=True)
    return (time.perf_counter() - t0, engine.experts.wait_seconds - waited), logits


def measure(engines: dict, tokens: list[int], rates: list[str], reps: int, net: Net) -> tuple[dict, dict]:
    """({(rate, wire): [(seconds, waited)]}, {wire: largest |logit - f32's|}); stops when q8's logits are
    not f32's."""
    times: dict[tuple[str, str], list[tuple[float, float]]] = {}
    diffs = dict.fromkeys(WIRES, 0.0)
    for rate in rates:
        shape_links(net, None if rate == "none" else rate)
        for rep in range(reps):
            order = list(WIRES[rep % len(WIRES) :] + WIRES[: rep % len(WIRES)])
            logits = {}
            for wire in order:
                (seconds, waited), logits[wire] = read_prompt(engines[wire], tokens)
                times.setdefault((rate, wire), []).append((seconds, waited))
                print(
                    f"{rate:8s} rep {rep + 1} {wire:4s} {len(tokens) / seconds:7.1f} tok/s, {waited:5.1f} s on nodes "
                    f"(load {os.getloadavg()[0]:.1f})",
                    file=sys.stderr,
                )
            for wire in WIRES:
                diffs[wire] = max(diffs[wire], float((logits[wire] - logits["f32"]).abs().max()))
            if not torch.equal(logits["q8"], logits["f32"]):
                raise SystemExit(f"q8's logits differ from f32's by up to {diffs['q8']:.3g}")
    return times, diffs


def _bytes_a_row(experts: object) -> tuple[float, float]:
    """(row bytes out, answer bytes back) per row, as the calls and replies carried them."""
    rows = max(1, sum(experts.rows_per_node.values()))
    return sum(experts.row_bytes_per_node.values()) / rows, sum(experts.answer_bytes_per_node.values()) / rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rates", default="100mbit,20mbit", help="link rates in turn; none = an unshaped veth")
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--workdir", type=Path, default=Path("/work/bench-models/decode"))
    p.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("bench/wire.py: needs root (network namespaces, tc)", file=sys.stderr)
        return 2
    args.workdir.mkdir(parents=True, exist_ok=True)
    _, shard_dir = prepare("qwen35moe", 4, args.workdir)
    net, key_text = Net(tag="w", subnet="10.79.0"), generate_key_text()
    load_before = os.getloadavg()
    tear_down(net, NODES)
    build_network(net, NODES, None)
    nodes: list[LocalNode] = []
    engines: dict = {}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-wire-") as tmp:
            nodes = start_nodes(net, shard_dir, Path(tmp), key_text)
            peers = tuple(n.address for n in nodes)
            for wire in WIRES:
                engines[wire] = open_engine(shard_dir, EngineConfig(peers=peers, mdns=False, wire=Wire(wire), device="cpu", key=SwarmKey.from_text(key_text), audit_rate=0.0, timeout=600.0))  # fmt: skip
            tokens = prompt_tokens(engines["f32"], args.prompt_tokens)
            for wire in WIRES:  # first use of every expert, on the nodes and here, before any figure
                read_prompt(engines[wire], tokens)
            times, diffs = measure(engines, tokens, args.rates.split(","), args.reps, net)
            bytes_a_row = {w: _bytes_a_row(e.experts) for w, e in engines.items()}
    finally:
        for e in engines.values():
            e.close()
        for n in nodes:
            n.stop()
        tear_down(net, NODES)
    text = report(args, times, diffs, bytes_a_row, len(tokens), (load_before, os.getloadavg()))
    publish("wire", text, not args.no_write)
    return 0


def report(
    args: argparse.Namespace, times: dict, diffs: dict, per_row: dict, n_tokens: int, load: tuple
) -> str:
    before, after = load
    lines = [
        "## Reading a prompt over slow links, by wire format (`bench/wire.py`)",
        "",
        f"Command: `sudo {command('wire.py', None)}`  ",
        f"Machine: {machine()}; load average {before[0]:.1f} / {before[1]:.1f} before, {after[0]:.1f} / "
        f"{after[1]:.1f} after (1 / 5 min; 2 cores shared with other work).  ",
        f"Model: `swarm synth` at Qwen3.6-35B-A3B's layer shape, 4 layers (D 2048, E 256, K 8, F 512; Q4_K "
        f"experts, Q8_0 dense). Workload: one {n_tokens}-token prompt read through the swarm as `swarm run` "
        "reads one (its last token's logits). Swarm: 4 nodes (`--threads 1`, 64 experts each, swarm key: TLS), each in a network "
        "namespace of its own, its veth shaped in both directions with `tc tbf` (burst 64 kB, latency 100 ms) "
        "at the rate shown; one coordinator engine per wire format on the same nodes, audits off, native "
        f"numerics. {args.reps} repetitions per rate in a rotating order of the formats; medians. Answers "
        "come back in float32 for f32, packed in byte planes (the same bits) for q8, in the rows' type for f16 "
        "and bf16; the byte counts are what the calls and replies carried, averaged over all rows.",
        "",
        "| link | wire | row bytes out / back | prompt tok/s | vs f32 | s waiting on nodes | vs f32 | logits vs f32 "
        "| seconds (on nodes) of each run |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for rate in args.rates.split(","):
        base = [statistics.median(r[k] for r in times[(rate, "f32")]) for k in (0, 1)]
        for wire in WIRES:
            runs = times[(rate, wire)]
            med = [statistics.median(r[k] for r in runs) for k in (0, 1)]
            same = (
                "-"
                if wire == "f32"
                else "bit for bit"
                if diffs[wire] == 0
                else f"max abs diff {diffs[wire]:.2g}"
            )
            out, back = per_row[wire]
            lines.append(
                f"| {rate} | {wire} | {out:.0f} / {back:.0f} | {n_tokens / med[0]:.1f} | "
                f"{base[0] / med[0]:.2f}x | {med[1]:.1f} | {base[1] / med[1]:.2f}x | {same} | "
                + ", ".join(f"{t:.1f} ({w:.1f})" for t, w in runs)
                + " |"
            )
    per_rep = {
        rate: ", ".join(
            f"{f[0] / q[0]:.2f}" for f, q in zip(times[(rate, "f32")], times[(rate, "q8")], strict=True)
        )
        for rate in args.rates.split(",")
    }
    goal = ""
    if "20mbit" in args.rates.split(","):
        f32_s, q8_s = (statistics.median(r[0] for r in times[("20mbit", w)]) for w in ("f32", "q8"))
        ratio = f32_s / q8_s
        goal = (
            f"Goal (a prompt at 20 Mbit/s with 8-bit rows >= 1.5x the float32 figure, bit for bit the same "
            f"logits): {'met' if ratio >= 1.5 and diffs['q8'] == 0 else 'NOT met'} ({ratio:.2f}x)."
        )
    q8_out, q8_back = per_row["q8"]
    ceiling = sum(per_row["f32"]) / (q8_out + q8_back)
    lines += [
        "",
        "q8 against f32 in each repetition (prompt time ratio): "
        + "; ".join(f"{rate}: {r}" for rate, r in per_rep.items())
        + ".",
        *(["", goal] if goal else []),
        "",
        "q8 sends each row as the Q8_K blocks the Q4_K kernels quantize it to (256 values: an f32 scale and 256 "
        "int8, 260 bytes), made on the coordinator by ggml's own quantizer; the node hands ggml float rows that "
        "quantize back to exactly those blocks, so its answers are those of the float32 rows. The answers "
        "are float32 (their bits are the result) and come back as byte planes (swarm.proto.planes): the "
        "three mantissa-bearing bytes of each value as they are, the top bytes (sign and exponent) Huffman "
        f"coded, {q8_back:.0f} bytes a row here for 8192. So a layer's bytes on a link go from 8192 + 8192 a "
        f"row to {q8_out:.0f} + {q8_back:.0f}: at best {ceiling:.2f}x less time on links that carry nothing "
        "else, less once the coordinator's own work (attention, DeltaNet, the router: seconds of CPU for a "
        "prompt this long) and the nodes' matmuls are counted. f16 and bf16 halve both directions, and round "
        "the rows and answers.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
