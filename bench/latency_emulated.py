"""Checking windows with the nodes emulated: what drafts known to be right give when the nodes' work and links
cost this machine nothing (bench/_emulated.py), against the same decode without drafts.

    .venv/bin/python bench/latency_emulated.py [--rtts 5,25] [--reps 5] [--decode-tokens 48] [--no-write]

bench/latency.py measures windows through real nodes on this machine, whose cores the nodes share with the
coordinator; here the coordinator's side is all there is: the Qwen3.6-35B-A3B layer shape (4 layers, bench/
_models.py) in this process, every MoE layer's answers (zeros) one round trip after its call. Greedy decode of
--decode-tokens after a 64-token prompt, without drafts and with Scripted drafts of that run's own continuation
(known to be right) at k = 1, 2, 3; decode tok/s medians of --reps, configurations rotated run by run. Section
bench:latency-emulated of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from _doc import bench_args, bench_parser, command, machine, publish
from _emulated import emulate
from _models import prepare, prompt_tokens

from swarm.coordinator.config import EngineConfig
from swarm.coordinator.decode.one import GenerationStats, SamplingParams, generate
from swarm.coordinator.drafts.lookup import Scripted
from swarm.coordinator.engine import open_engine

KS = (0, 1, 2, 3)


def decode(engine: object, prompt: list[int], n: int, k: int, reference: list[int]) -> tuple[float, list[int]]:
    """(decode tok/s, the tokens) of one greedy generation, with k known-right drafts (0: none)."""
    stats = GenerationStats()
    drafter = Scripted(tuple(prompt + reference), k) if k else None
    tokens = list(generate(engine.model, prompt, SamplingParams(max_tokens=n), engine.device, stats,  # type: ignore[attr-defined]
                           drafter=drafter))  # fmt: skip
    return stats.decode_tps, tokens


def bench(args: argparse.Namespace) -> str:
    gguf, _ = prepare("qwen35moe", 4, Path(args.workdir))
    engine = open_engine(gguf, EngineConfig(local=True, device="cpu"))
    rows = []
    try:
        prompt = prompt_tokens(engine, 64)
        for rtt in args.rtts:
            emulate(engine, rtt)
            _, reference = decode(engine, prompt, args.decode_tokens, 0, [])
            got: dict[int, list[float]] = {k: [] for k in KS}
            for rep in range(args.reps):
                for k in KS[rep % len(KS) :] + KS[: rep % len(KS)]:
                    tps, tokens = decode(engine, prompt, args.decode_tokens, k, reference)
                    if tokens != reference:
                        raise SystemExit(f"{rtt:g} ms, k = {k}: the text differs from the run without drafts")
                    got[k].append(tps)
            med = {k: statistics.median(v) for k, v in got.items()}
            rows.append((rtt, med))
            print(f"emulated {rtt:g} ms {med}", file=sys.stderr, flush=True)
    finally:
        engine.close()
    lines = [
        f"`{command('latency_emulated.py', args.argv)}` on {machine()}; load average before the run "
        f"{args.load:.1f}. 4 layers of the Qwen3.6-35B-A3B shape in this process, the nodes emulated (every "
        "layer's answers one round trip after the call, at no cost to this machine: zeros, so the text is not "
        f"the model's); greedy, {args.decode_tokens} tokens after a 64-token prompt, drafts known to be right "
        f"(the run's own continuation); decode tok/s, medians of {args.reps}. Every run's text equalled the "
        "run without drafts.",
        "",
        "| RTT | no drafts | k = 1 | k = 2 | k = 3 | k = 3 / none |",
        "|---|---|---|---|---|---|",
    ]
    for rtt, med in rows:
        lines.append(
            f"| {rtt:g} ms | " + " | ".join(f"{med[k]:.1f}" for k in KS) + f" | {med[3] / med[0]:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__)
    p.add_argument("--rtts", default="5,25", help="round trips of the emulated links, ms")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--decode-tokens", type=int, default=48)
    args = bench_args(p, argv)
    args.rtts = [float(x) for x in args.rtts.split(",")]
    publish("latency-emulated", bench(args), not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
