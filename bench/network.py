"""Decode and prefill over real network links: nodes in network namespaces, links shaped with tc tbf.

    sudo .venv/bin/python bench/network.py [--reps 3] [--rates none,100mbit,20mbit] [--workdir DIR]

Model: `swarm synth` qwen3-30b-a3b preset, 4 layers (D 2048, E 128, K 8, F 768, Q4_K experts). Every
configuration is one run of deploy/netns_swarm.py (4 nodes with disjoint expert ranges, each in a namespace
of its own, found by multicast mDNS across a bridge) with `swarm run` on the host, for each link rate and
wire precision, plus `swarm run --local` as the reference; repetitions rotate the order; medians. The prompt
is long (256 tokens) so that prefill has touched nearly every expert before decoding starts, and decode
tokens/s is mostly warm. Figures go to the `bench:network` section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _doc import replace_section

from swarm.sharding.shard import shard_model
from swarm.sharding.synth import synthesize
from swarm.sharding.synth_spec import preset

ROOT = Path(__file__).resolve().parent.parent
RIG = ROOT / "deploy" / "netns_swarm.py"
SPEED = re.compile(r"prefill: (\d+) tokens, ([\d.]+) tok/s \| decode: (\d+) tokens, ([\d.]+) tok/s")
WORDS = "the swarm of experts runs on phones and laptops while one coordinator routes every token".split()


def prepare(workdir: Path) -> Path:
    gguf, shard_dir = workdir / "qwen3moe-4l-q4k.gguf", workdir / "qwen3moe-4l-q4k.swarm"
    if not gguf.exists():
        synthesize(gguf, preset("qwen3-30b-a3b", n_layers=4, experts_type="Q4_K"))
    if not (shard_dir / "manifest.json").exists():
        shard_model(gguf, shard_dir, progress=False)
    return shard_dir


def one_run(shard_dir: Path, config: str, prompt: str, n_decode: int, i: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one configuration: "local" or "RATE/WIRE" (RATE "none": unshaped)."""
    run = ["--prompt", prompt, "--max-tokens", str(n_decode)]
    if config == "local":
        cmd = [sys.executable, "-m", "swarm.coordinator.cli", "run", str(shard_dir), "--local", *run]
    else:
        rate, wire = config.split("/")
        cmd = [sys.executable, str(RIG), str(shard_dir), "--nodes", "4", "--tag", f"b{i % 100}",
               "--subnet", f"10.78.{i % 200 + 20}", "--key", secrets.token_hex(8),
               *(["--rate", rate] if rate != "none" else []), "--", *run, "--wire", wire]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    found = SPEED.search(out.stderr)
    if out.returncode != 0 or not found:
        raise SystemExit(f"{config}: failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return float(found.group(2)), float(found.group(4))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rates", default="none,100mbit,20mbit", help="link rates; none = an unshaped veth")
    p.add_argument("--wires", default="f32,f16")
    p.add_argument("--decode-tokens", type=int, default=48)
    p.add_argument("--workdir", type=Path, default=None, help="keep/reuse the synthesized model here")
    p.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("bench/network.py: needs root (network namespaces)", file=sys.stderr)
        return 2
    cmd = "python bench/network.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-network-"))
    workdir.mkdir(parents=True, exist_ok=True)
    shard_dir = prepare(workdir)
    prompt = " ".join(WORDS[i % len(WORDS)] for i in range(256))
    configs = ["local"] + [f"{r}/{w}" for r in args.rates.split(",") for w in args.wires.split(",")]
    runs: dict[str, list[tuple[float, float]]] = {c: [] for c in configs}
    n = 0
    for rep in range(args.reps):
        order = configs[rep % len(configs) :] + configs[: rep % len(configs)]
        for c in order:
            t0 = time.perf_counter()
            runs[c].append(one_run(shard_dir, c, prompt, args.decode_tokens, n))
            n += 1
            print(f"rep {rep + 1} {c:14s} prefill {runs[c][-1][0]:7.1f} decode {runs[c][-1][1]:6.2f} tok/s "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)  # fmt: skip

    def med(c: str, k: int) -> float:
        return statistics.median(r[k] for r in runs[c])

    base_p, base_d = med("local", 0), med("local", 1)
    lines = [
        "## Over network links (`bench/network.py`)",
        "",
        f"Command: `sudo {cmd}`  ",
        f"Machine: {platform.machine()}, 2 cores shared, torch {torch.__version__}, Python "
        f"{platform.python_version()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.  ",
        "Model: `swarm synth` preset qwen3-30b-a3b, 4 layers, D 2048, E 128, K 8, F 768, Q4_K experts (random "
        "weights). Workload: `swarm run` with a 256-token prompt, then "
        f"{args.decode_tokens} greedy tokens. Swarm: 4 nodes (`--threads 1`, disjoint expert ranges), each in "
        "a network namespace of its own on a bridge, found by multicast mDNS; each link shaped in both "
        "directions with `tc tbf` at the rate shown (none: an unshaped veth). "
        f"{args.reps} repetitions in a rotating order; medians; every run starts its nodes afresh, so the "
        "first use of each expert (dequantization) is inside the figures, as it is for a user.",
        "",
        "| configuration | wire | prefill tok/s | decode tok/s | prefill vs in-process | decode vs in-process | decode tok/s of each run |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
        f"| in-process (`--local`) | - | {base_p:.1f} | {base_d:.1f} | 1.00x | 1.00x | "
        + ", ".join(f"{r[1]:.1f}" for r in runs["local"])
        + " |",
    ]
    for c in configs[1:]:
        rate, wire = c.split("/")
        link = "4 nodes, unshaped veth" if rate == "none" else f"4 nodes, links at {rate}"
        lines.append(
            f"| {link} | {wire} | {med(c, 0):.1f} | {med(c, 1):.1f} | {med(c, 0) / base_p:.2f}x | "
            f"{med(c, 1) / base_d:.2f}x | " + ", ".join(f"{r[1]:.1f}" for r in runs[c]) + " |"
        )
    lines += [
        "",
        "Bytes per decode step and MoE layer: 8 rows of 2048 values out and back (64 KiB each way in f32, "
        "32 KiB in f16), spread over the 4 links; at 20 Mbit/s 16 KiB take about 6.5 ms on one link.",
    ]
    section = "\n".join(lines)
    if args.no_write:
        print(section)
    else:
        replace_section("network", section)
        print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
