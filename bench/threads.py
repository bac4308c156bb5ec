"""One thread budget: torch and ggml share one OpenMP pool; how its threads should wait.

    .venv/bin/python bench/threads.py [--gguf FILE] [--reps 3] [--no-write]

`swarm run FILE --local` from a cold start, decode tokens/s as it reports them, under:
  --threads 1 and 2, and OpenMP's default (spinning) wait vs OMP_WAIT_POLICY=PASSIVE,
  on an idle machine and beside one busy process (a pure-Python loop: another app on the device).
With --swarm DIR (a shard directory of that model): `swarm run DIR` over 4 loopback nodes (--threads 1
each, the nodes' own passive waiting), the coordinator's threads waiting passively, with a brief spin
(GOMP_SPINCOUNT=1000: what `swarm run` picks when its experts are remote), a short one (10000) or OpenMP's
full default spin (300000): cold runs, then decode blocks in one process alternating the coordinator's 1
and 2 threads (the 1-thread blocks are the control for the machine's load); written to the
`bench:threads-swarm` section.
Also reads, from a process that has run both torch and ggml, how many OpenMP runtimes it loaded (libgomp
in /proc/self/maps) and how many threads it runs. Medians of --reps runs, side by side in one run.
Figures go to the `bench:threads` section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _doc import command, machine, publish  # noqa: E402

PROMPT = (
    "A mixture of experts model keeps many small feed-forward networks in every layer and sends each token "
    "to only a few of them, chosen by a router. Most of the weights sit in the experts. "
)
_TPS = re.compile(r"prefill: \d+ tokens, ([\d.]+) tok/s \| decode: \d+ tokens, ([\d.]+) tok/s")

PROBE = """
import os, torch
from swarm.compute import dense, ggml, weights
ggml.set_threads(2)
w = weights.Weight.of_float(torch.randn(256, 256).numpy())
dense.linear([w], torch.randn(4, 256))
torch.randn(512, 512) @ torch.randn(512, 512)
maps = open('/proc/self/maps').read().splitlines()
libs = sorted({l.split()[-1] for l in maps if 'gomp' in l or 'libiomp' in l})
print(len(libs), len(os.listdir('/proc/self/task')), ' '.join(os.path.basename(x) for x in libs))
"""


TIMEOUT = 120  # seconds; a run that spins against a busy core can take far longer (not run again)


def _env_without_waits() -> dict[str, str]:
    """This process's environment without any OpenMP wait setting (each run sets the one it measures)."""
    from swarm.compute.openmp import OURS, SPIN_COUNT, WAIT_POLICY

    return {k: v for k, v in os.environ.items() if k not in (WAIT_POLICY, SPIN_COUNT, OURS)}


def swarm_run(gguf: Path, threads: int, policy: str | None) -> tuple[float, float] | None:
    """(prefill, decode) tokens/s of one cold `swarm run`, None when it ran past TIMEOUT."""
    env = _env_without_waits()
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    cmd = [sys.executable, "-m", "swarm.coordinator.cli", "run", str(gguf), "--local", "--threads", str(threads),
           "--prompt", PROMPT, "--max-tokens", "32"]  # fmt: skip
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return None
    m = _TPS.search(proc.stderr)
    if proc.returncode != 0 or m is None:
        raise RuntimeError(f"swarm run failed ({proc.returncode}): {proc.stderr[-1500:]}")
    return float(m.group(1)), float(m.group(2))


SWARM_WAITS = (
    ("passive, OMP_WAIT_POLICY=PASSIVE", {"OMP_WAIT_POLICY": "PASSIVE"}),
    ("brief spin, GOMP_SPINCOUNT=1000", {"GOMP_SPINCOUNT": "1000"}),
    ("short spin, GOMP_SPINCOUNT=10000", {"GOMP_SPINCOUNT": "10000"}),
    ("full spin, GOMP_SPINCOUNT=300000", {"GOMP_SPINCOUNT": "300000"}),
)


STEP_BLOCKS, BLOCK_STEPS = 12, 6


def steps_child(shard_dir: Path, peers: list[str]) -> None:
    """In this process (its OpenMP wait set by the parent), decode blocks of BLOCK_STEPS steps through the
    peers, alternating the coordinator's threads between 1 and 2: ms per step of each block, as JSON. The
    1-thread blocks run no OpenMP team (nothing waits on a barrier), so they read how loaded the machine
    was at the time; 2 threads against them is the wait's own effect."""
    import random

    import torch

    from swarm.compute.ggml import set_threads
    from swarm.coordinator.config import EngineConfig
    from swarm.coordinator.engine import open_engine

    engine = open_engine(shard_dir, EngineConfig(peers=tuple(peers), mdns=False, device="cpu", audit_rate=0.0))
    m = engine.model
    rng = random.Random(0)
    vocab = 1000  # token ids every vocabulary has
    out: dict[int, list[float]] = {1: [], 2: []}
    try:
        with torch.inference_mode():
            states = [m.new_state()]
            m(torch.tensor([rng.randrange(vocab) for _ in range(64)]), states, [64], last_only=True)
            for _ in range(STEP_BLOCKS):
                for threads in (1, 2):
                    set_threads(threads)
                    t0 = time.perf_counter()
                    for _ in range(BLOCK_STEPS):
                        m(torch.tensor([rng.randrange(vocab)]), states, [1], last_only=True)
                    out[threads].append((time.perf_counter() - t0) / BLOCK_STEPS * 1e3)
    finally:
        engine.close()
    print(json.dumps(out))


def _cold_runs(
    shard_dir: Path, peers: list[str], reps: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(decode, prefill) tok/s of cold `swarm run`s through the peers, per wait, in rotating order."""
    results: dict[str, list[float]] = {name: [] for name, _ in SWARM_WAITS}
    prefills: dict[str, list[float]] = {name: [] for name, _ in SWARM_WAITS}
    for rep in range(reps):
        turn = rep % len(SWARM_WAITS)
        order = SWARM_WAITS[turn:] + SWARM_WAITS[:turn]
        for name, extra in order:
            env = _env_without_waits()
            cmd = [sys.executable, "-m", "swarm.coordinator.cli", "run", str(shard_dir), "--no-mdns",
                   *peers, "--audit", "0", "--prompt", PROMPT, "--max-tokens", "48"]  # fmt: skip
            proc = subprocess.run(cmd, env={**env, **extra}, capture_output=True, text=True, timeout=300)
            m = _TPS.search(proc.stderr)
            if proc.returncode != 0 or m is None:
                raise RuntimeError(f"swarm run failed ({proc.returncode}): {proc.stderr[-1500:]}")
            results[name].append(float(m.group(2)))
            prefills[name].append(float(m.group(1)))
            print(name, prefills[name][-1], results[name][-1], flush=True)
    return results, prefills


def _step_blocks(shard_dir: Path, addresses: list[str], reps: int) -> dict[str, dict[int, list[float]]]:
    """ms per decode step of each wait, in blocks alternating the coordinator's 1 and 2 threads (steps_child)."""
    steps: dict[str, dict[int, list[float]]] = {name: {1: [], 2: []} for name, _ in SWARM_WAITS}
    for rep in range(max(1, reps // 2)):
        turn = rep % len(SWARM_WAITS)
        for name, extra in SWARM_WAITS[turn:] + SWARM_WAITS[:turn]:
            env = _env_without_waits()
            proc = subprocess.run(
                [sys.executable, __file__, "--steps-child", str(shard_dir), *addresses],
                env={**env, **extra}, capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            if proc.returncode != 0:
                raise RuntimeError(f"decode blocks failed ({proc.returncode}): {proc.stderr[-1500:]}")
            blocks = json.loads(proc.stdout.strip().splitlines()[-1])
            for threads in ("1", "2"):
                steps[name][int(threads)] += blocks[threads]
            print(name, {t: statistics.median(v) for t, v in blocks.items()}, flush=True)
    return steps


def _render_waits(
    reps: int,
    results: dict[str, list[float]],
    prefills: dict[str, list[float]],
    steps: dict[str, dict[int, list[float]]],
) -> str:
    cmd = command("threads.py", None)
    lines = [
        "## How a coordinator of remote experts should wait (`bench/threads.py --swarm`)",
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {machine()}. "
        "`swarm run` of the 4-layer Qwen3.6-35B-shape shard directory through 4 loopback nodes (`--threads 1`, "
        f"disjoint quarters of the experts, `--audit 0`), 48 tokens, {reps} runs per wait in a rotating order.",
        "",
        "| coordinator's OpenMP wait | prefill tok/s, median | decode tok/s, median | decode, each run |",
        "| --- | ---: | ---: | --- |",
    ]
    for name, _ in SWARM_WAITS:
        runs = results[name]
        lines.append(
            f"| {name} | {statistics.median(prefills[name]):.1f} | {statistics.median(runs):.1f} | "
            f"{', '.join(f'{r:.1f}' for r in runs)} |"
        )
    lines += [
        "",
        f"Decode steps in one coordinator process per wait (the same nodes, `--audit 0`, after a 64-token "
        f"prompt): blocks of {BLOCK_STEPS} steps alternating the coordinator's threads, 1 then 2, "
        f"{STEP_BLOCKS} of each per process, {max(1, reps // 2)} process(es) per wait in a rotating order. "
        "With 1 thread no OpenMP team runs, so those blocks read the machine's load at the time; 2 against 1 "
        "is what the wait does to the coordinator's own work (medians of all blocks).",
        "",
        "| coordinator's OpenMP wait | 1 thread, ms/step | 2 threads, ms/step | 2 threads vs 1 (time) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, _ in SWARM_WAITS:
        one, two = statistics.median(steps[name][1]), statistics.median(steps[name][2])
        lines.append(f"| {name} | {one:.1f} | {two:.1f} | {two / one:.2f}x |")
    return "\n".join(lines)


def swarm_waits(shard_dir: Path, reps: int, write: bool) -> None:
    """Decode through 4 loopback nodes under each coordinator wait of SWARM_WAITS, side by side."""
    from swarm.coordinator.cli.spawn import start_nodes, stop_nodes
    from swarm.sharding.slabs import read_manifest

    n_expert = read_manifest(shard_dir).n_expert
    quarter = n_expert // 4
    specs = [(shard_dir, ["--host", "127.0.0.1", "--experts", f"{i * quarter}-{(i + 1) * quarter - 1}",
                          "--threads", "1", "--no-verify", "--no-mdns"]) for i in range(4)]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-threads-swarm-") as work:
        nodes = start_nodes(specs, Path(work), timeout=120.0)
        try:
            peers = [a for n in nodes for a in ("--peer", n.address)]
            results, prefills = _cold_runs(shard_dir, peers, reps)
            steps = _step_blocks(shard_dir, [n.address for n in nodes], reps)
        finally:
            stop_nodes(nodes)
    publish("threads-swarm", _render_waits(reps, results, prefills, steps), write=write)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gguf", type=Path, default=None, help="model (default: synthesize the 35B layer shape)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--swarm", type=Path, default=None, metavar="DIR",
                   help="a shard directory: measure the coordinator's waits over 4 loopback nodes instead")  # fmt: skip
    p.add_argument("--steps-child", nargs="+", default=None, help=argparse.SUPPRESS)  # DIR PEER...
    args = p.parse_args(argv)
    if args.steps_child is not None:
        steps_child(Path(args.steps_child[0]), args.steps_child[1:])
        return 0
    if args.swarm is not None:
        swarm_waits(args.swarm, args.reps, not args.no_write)
        return 0
    tmp = None
    gguf = args.gguf
    if gguf is None:
        from swarm.sharding.synth import synthesize
        from swarm.sharding.synth_spec import preset

        tmp = tempfile.TemporaryDirectory(prefix="bench-threads-")
        gguf = Path(tmp.name) / "q36-4l.gguf"
        synthesize(gguf, preset("qwen3.6-35b-a3b", n_layers=4, experts_type="Q4_K", dense_type="Q8_0"))
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    n_omp, n_threads, omp_libs = (
        probe.stdout.strip().split(maxsplit=2) if probe.returncode == 0 else ("?",) * 3
    )
    configs = [(t, pol, busy) for busy in (False, True) for t in (1, 2) for pol in (None, "PASSIVE")]
    results: dict[tuple, list[tuple[float, float] | None]] = {c: [] for c in configs}
    try:
        for rep in range(args.reps):
            for c in configs[rep % len(configs) :] + configs[: rep % len(configs)]:
                threads, policy, busy = c
                if None in results[c]:
                    continue
                hog = None
                if busy:
                    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                try:
                    results[c].append(swarm_run(gguf, threads, policy))
                finally:
                    if hog is not None:
                        hog.kill()
                        hog.wait()
                print(c, results[c][-1], flush=True)
    finally:
        if tmp is not None:
            tmp.cleanup()
    cmd = command("threads.py", argv)
    lines = [
        "## One thread budget: torch and ggml, and how their threads wait (`bench/threads.py`)",
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {machine()}. "
        f"`swarm run --local` from a cold start on the 4-layer Qwen3.6-35B-shape GGUF (Q4_K experts, Q8_0 "
        f"dense), 32 tokens, {args.reps} runs per configuration in a rotating order, medians.",
        "",
        f"One pool: a process that has run torch and ggml loaded {n_omp} OpenMP runtime ({omp_libs}) and runs "
        f"{n_threads} threads in all with `--threads 2` (the main thread, one OpenMP worker, torch's and "
        "gRPC's housekeeping): ggml's graphs and torch's ops take turns on the same workers, so they never "
        "compete for the cores.",
        "",
        "| machine | threads | OpenMP wait | prefill tok/s | decode tok/s |",
        "| --- | ---: | --- | ---: | ---: |",
    ]
    for c in configs:
        threads, policy, busy = c
        done = [r for r in results[c] if r is not None]
        where = "one other busy process" if busy else "idle"
        if len(done) < len(results[c]):
            figs = f"a run took over {TIMEOUT} s (not repeated) | |"
        else:
            pre = statistics.median(r[0] for r in done)
            dec = statistics.median(r[1] for r in done)
            figs = f"{pre:.1f} | {dec:.1f} |"
        lines.append(f"| {where} | {threads} | {policy or 'default (spin)'} | {figs}")
    publish("threads", "\n".join(lines), write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
