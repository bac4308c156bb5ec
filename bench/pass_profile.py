"""Where an in-process pass's time goes: the ggml graphs by the code that runs them, and what runs between.

    .venv/bin/python bench/pass_profile.py --model qwen35moe --layers 40 --experts 64 --vocab 248320 \
        --dense-type Q4_K_M [--reps 3] [--prompt-tokens 64] [--decode-tokens 32] [--threads 2] [--workdir DIR]

`swarm run GGUF --local` on a `swarm synth` model (bench/_models.py), the experts in this process. Each ggml
graph's run (Graph.run: its slots set, ggml_graph_compute) is timed and counted under the function that ran it
(moe_layer, delta_net_layer, attention_heads, linear, ...); "between the graphs" is the pass's wall time less
all of them: Python, torch (routing, attention's softmax, sampling), the model's own bookkeeping. A warm-up
pass first (the first reads the file from disk), then `--reps` passes of a fixed prompt and greedy decode;
medians. The figures are for the prompt's pass as a whole and for one decode step.

Figures go to docs/BENCHMARKS.md, section `pass-profile-<model>-<layers>l-<dense type>`.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from _doc import bench_args, bench_parser, command, machine, publish
from _models import MODELS, prepare, prompt_tokens

from swarm.compute import graph as graph_module
from swarm.compute.ggml import set_threads
from swarm.coordinator.config import EngineConfig
from swarm.coordinator.decode.one import SamplingParams, generate
from swarm.coordinator.engine import Engine, open_engine

log = logging.getLogger("bench.pass_profile")

BETWEEN = "between the graphs"


class GraphClock:
    """Graph.run timed and counted by the function that called run_graph (two frames up)."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.runs: defaultdict[str, int] = defaultdict(int)
        self._run = graph_module.Graph.run
        clock = self

        def run(gr: graph_module.Graph, *args: object, **kwargs: object) -> None:
            caller = sys._getframe(2).f_code.co_name
            t = time.perf_counter()
            try:
                clock._run(gr, *args, **kwargs)  # type: ignore[arg-type]
            finally:
                clock.seconds[caller] += time.perf_counter() - t
                clock.runs[caller] += 1

        graph_module.Graph.run = run  # type: ignore[method-assign]

    def snapshot(self) -> tuple[dict[str, float], dict[str, int]]:
        return dict(self.seconds), dict(self.runs)

    def close(self) -> None:
        graph_module.Graph.run = self._run  # type: ignore[method-assign]


def delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def one_pass(engine: Engine, ids: list[int], n_decode: int, clock: GraphClock) -> dict[str, dict]:
    """{phase: {part: seconds}} and {phase + ' runs': {part: graph runs}} for the prompt's pass and the
    decode steps after it (wall time of each phase under BETWEEN's complement)."""
    s0, r0 = clock.snapshot()
    t0 = time.perf_counter()
    tokens = generate(engine.model, ids, SamplingParams(max_tokens=n_decode), engine.device, checker=engine.checker)
    next(tokens)
    t1 = time.perf_counter()
    s1, r1 = clock.snapshot()
    rest = list(tokens)
    t2 = time.perf_counter()
    s2, r2 = clock.snapshot()
    steps = max(1, len(rest))
    out: dict[str, dict] = {}
    for phase, sa, sb, ra, rb, wall, div in (("prefill", s0, s1, r0, r1, t1 - t0, 1),
                                             ("decode", s1, s2, r1, r2, t2 - t1, steps)):  # fmt: skip
        secs = delta(sb, sa)
        secs[BETWEEN] = wall - sum(secs.values())
        out[phase] = {k: v / div for k, v in secs.items()} | {"wall": wall / div}
        out[phase + " runs"] = {k: v / div for k, v in delta(rb, ra).items()}
    return out


def render(args: argparse.Namespace, name: str, passes: list[dict[str, dict]]) -> str:
    parts = sorted({k for p in passes for ph in ("prefill", "decode") for k in p[ph] if k != "wall"},
                   key=lambda k: (k == BETWEEN, -statistics.median(p["decode"].get(k, 0) for p in passes)))  # fmt: skip

    def med(phase: str, key: str) -> float:
        return statistics.median(p[phase].get(key, 0.0) for p in passes)

    pre_wall, dec_wall = med("prefill", "wall"), med("decode", "wall")
    rows = [
        f"| {k} | {1e3 * med('prefill', k):.1f} | {100 * med('prefill', k) / pre_wall:.0f} % "
        f"| {1e3 * med('decode', k):.2f} | {100 * med('decode', k) / dec_wall:.0f} % "
        f"| {med('prefill runs', k):.0f} | {med('decode runs', k):.1f} |"
        for k in parts
    ]
    a = args
    return "\n".join([
        f"## Where an in-process pass's time goes, {name} (`bench/pass_profile.py`)",
        "",
        f"Command: `{command('pass_profile.py', a.argv)}`  ",
        f"Machine: {machine()}; {a.threads} compute threads.  ",
        f"Workload: a {a.prompt_tokens}-token prompt, then {a.decode_tokens} greedy tokens; a warm-up pass, "
        f"then {a.reps} passes, medians. Each ggml graph's run is timed under the function that ran it; "
        f"\"{BETWEEN}\" is the rest of the wall time (Python, torch, bookkeeping).",
        "",
        f"Prompt's pass: {1e3 * pre_wall:.0f} ms ({a.prompt_tokens / pre_wall:.1f} tok/s); decode step: "
        f"{1e3 * dec_wall:.1f} ms ({1 / dec_wall:.2f} tok/s).",
        "",
        "| part | prompt's pass, ms | share | decode step, ms | share | graphs, prompt | graphs a step |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *rows,
    ])


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__)
    p.add_argument("--model", choices=sorted(MODELS), default="qwen35moe")
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--dense-type", default="Q8_0")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    args = bench_args(p, argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    gguf, _ = prepare(args.model, args.layers, Path(args.workdir), args.experts, args.vocab, args.dense_type)
    set_threads(args.threads)
    engine = open_engine(gguf, EngineConfig(local=True, device="cpu"))
    clock = GraphClock()
    try:
        ids = prompt_tokens(engine, args.prompt_tokens)
        one_pass(engine, ids, args.decode_tokens, clock)  # warm-up: the file's pages, the kept graphs
        passes = [one_pass(engine, ids, args.decode_tokens, clock) for _ in range(args.reps)]
    finally:
        clock.close()
        engine.close()
    name = f"{args.model}, {args.layers} layers, {args.dense_type} dense"
    section = f"pass-profile-{args.model}-{args.layers}l-{args.dense_type.lower().replace('_', '')}"
    publish(section, render(args, name, passes), not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
