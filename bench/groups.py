"""Several conversations over slow links: `swarm serve`'s pass in one group against the same pass split into
groups in flight at once (coordinator/decode/passes.py, coordinator/serve/groups.py), aggregate decode tok/s.

    .venv/bin/python bench/groups.py [--rtts 0,2,5,25] [--conversations 8] [--tokens 24] [--reps 3]
                                     [--workdir /work/bench-models/decode] [--no-write]

The Qwen3.6-35B-A3B layer shape (4 layers, Q4_K experts, bench/_models.py) on 4 `swarm node` processes holding
a disjoint quarter of the experts each, reached through bench/_relay.py (a relay that delays every byte by
half the round trip each way; `tc netem` is not available here) at each RTT, or directly at 0 ms. The
coordinator is this process: the serve scheduler (coordinator/serve/scheduler.py) with 8 slots and default
settings (audits at the default rate, no drafts: this measures the groups alone), 8 conversations submitted
at once. Aggregate decode tok/s: tokens given out by the passes between the moment every conversation has
its first token and the moment the first one ends, over that time. Modes: one group (--groups 1), auto
(--groups auto, the default) and 2 groups; alternated run by run, medians of --reps.

--emulated: the coordinator alone, its nodes emulated (each layer's answers arrive one round trip after the
call at no CPU cost here, as nodes with cores of their own would give them), 1-4 groups: what groups can give
where the nodes do not share this machine's cores (section bench:groups-emulated).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

from _doc import bench_args, bench_parser, command, machine, publish
from _emulated import emulate
from _models import prepare
from _relay import relay

from swarm.coordinator.cli.spawn import LocalNode, start_nodes, stop_nodes
from swarm.coordinator.config import EngineConfig
from swarm.coordinator.decode.one import SamplingParams
from swarm.coordinator.engine import open_engine
from swarm.coordinator.serve import scheduler as sched
from swarm.coordinator.serve.groups import WaitShare
from swarm.node.client import NodeClient
from swarm.sharding.slabs import read_manifest

RELAY_HOST = "127.0.0.2"
MODES = {"1 group": 1, "auto": 0, "2 groups": 2}


def _stream_port(node: LocalNode) -> int:
    with NodeClient(node.address, fingerprint=node.fingerprint) as client:
        return client.info().stream_port


def one_run(engine: object, prompts: list[list[int]], tokens: int, fixed: int) -> tuple[float, list[int]]:
    """Aggregate decode tok/s of the conversations run together, and the groups the passes went in."""
    policy = WaitShare(engine.experts, fixed)  # type: ignore[attr-defined]
    split: list[int] = []
    choose = policy.choose
    policy.choose = lambda entries: split.append(choose(entries)) or split[-1]  # type: ignore[method-assign]
    s = sched.Scheduler(engine.model, engine.device, engine.checker, len(prompts), 1024, len(prompts),  # type: ignore[attr-defined]
                        groups=policy)  # fmt: skip
    s.start()
    ends: list[float] = []
    lock = threading.Lock()
    done = threading.Event()

    def finished(_: object) -> None:
        with lock:
            ends.append(time.monotonic())
            if len(ends) == len(prompts):
                done.set()

    reqs = [sched.Request(p, SamplingParams(max_tokens=tokens), lambda _: None, finished) for p in prompts]
    try:
        for r in reqs:
            s.submit(r)
        if not done.wait(600):
            raise RuntimeError("the conversations did not end in 600 s")
    finally:
        s.stop()
    t0 = max(r.first_token or 0.0 for r in reqs)
    t1 = min(ends)
    given = sum(n for t, n in s.recent if t0 < t <= t1)
    return given / (t1 - t0) if t1 > t0 else 0.0, split


def bench(args: argparse.Namespace) -> str:
    _, shard_dir = prepare("qwen35moe", 4, Path(args.workdir))
    n_expert = read_manifest(shard_dir).n_expert
    cuts = [n_expert * i // 4 for i in range(5)]
    nodes = start_nodes(
        [(shard_dir, ["--no-mdns", "--experts", f"{cuts[i]}-{cuts[i + 1] - 1}"]) for i in range(4)],
        Path(args.workdir) / "groups-nodes",
    )
    rows = []
    try:
        streams = [_stream_port(n) for n in nodes]
        for rtt in args.rtts:
            if rtt:
                grpc = [f"{RELAY_HOST}:{n.port}" for n in nodes]
                pairs = [(a, a.replace(RELAY_HOST, "127.0.0.1")) for a in grpc]
                pairs += [(f"{RELAY_HOST}:{p}", f"127.0.0.1:{p}") for p in streams]
                with relay(pairs, rtt):
                    rows.append((rtt, *measure(shard_dir, grpc, args)))
            else:
                rows.append((rtt, *measure(shard_dir, [n.address for n in nodes], args)))
    finally:
        stop_nodes(nodes)
    return render(rows, args)


def measure(
    shard_dir: Path, peers: list[str], args: argparse.Namespace
) -> tuple[dict[str, float], dict[str, str]]:
    engine = open_engine(shard_dir, EngineConfig(peers=tuple(peers), mdns=False, device="cpu", wait=30.0))
    try:
        vocab = engine.model.token_embd.num_embeddings
        prompts = [[(7 + 31 * i + 5 * j) % vocab for j in range(16)] for i in range(args.conversations)]
        one_run(engine, prompts, 4, 1)  # warm: graphs of these batch sizes built, nodes admitted
        got: dict[str, list[float]] = {m: [] for m in MODES}
        splits: dict[str, list[int]] = {m: [] for m in MODES}
        for _ in range(args.reps):
            for mode, fixed in MODES.items():
                tps, split = one_run(engine, prompts, args.tokens, fixed)
                got[mode].append(tps)
                splits[mode] += split
        med = {m: statistics.median(v) for m, v in got.items()}
        seen = {m: ", ".join(f"{g}: {splits[m].count(g)}" for g in sorted(set(splits[m]))) for m in MODES}
        print(f"{peers[0]} {med} {seen}", file=sys.stderr, flush=True)
        return med, seen
    finally:
        engine.close()


def render(rows: list[tuple[float, dict[str, float], dict[str, str]]], args: argparse.Namespace) -> str:
    head = "| RTT | 1 group tok/s | auto tok/s | auto / 1 group | passes by groups (auto) | 2 groups tok/s | 2 / 1 |"
    lines = [
        f"`{command('groups.py', args.argv)}` on {machine()}; load average before the run "
        f"{args.load:.1f}. 4 layers of the Qwen3.6-35B-A3B shape, 4 nodes behind a delaying relay, "
        f"{args.conversations} conversations at once, {args.tokens} tokens each, aggregate decode tok/s "
        f"(medians of {args.reps}; the modes alternate run by run).",
        "",
        head,
        "|" + "---|" * 7,
    ]
    for rtt, med, seen in rows:
        one = med["1 group"] or float("nan")
        lines.append(
            f"| {rtt:g} ms | {med['1 group']:.1f} | {med['auto']:.1f} | {med['auto'] / one:.2f}x | "
            f"{seen['auto']} | {med['2 groups']:.1f} | {med['2 groups'] / one:.2f}x |"
        )
    return "\n".join(lines)


def emulated(args: argparse.Namespace) -> str:
    """--emulated: the same passes with the nodes' work and links emulated (Emulated), 1-4 groups, and what a
    one-group pass's dense work costs by the number of conversations."""
    gguf, _ = prepare("qwen35moe", 4, Path(args.workdir))
    engine = open_engine(gguf, EngineConfig(local=True, device="cpu"))
    vocab = engine.model.token_embd.num_embeddings
    prompts = [[(7 + 31 * i + 5 * j) % vocab for j in range(16)] for i in range(args.conversations)]
    groups = [1, 2, 3, 4]
    rows, costs = [], []
    try:
        for rtt in args.rtts:
            emulate(engine, rtt)
            one_run(engine, prompts, 4, 1)
            got: dict[int, list[float]] = {g: [] for g in groups}
            for _ in range(args.reps):
                for g in groups:
                    got[g].append(one_run(engine, prompts, args.tokens, g)[0])
            rows.append((rtt, {g: statistics.median(v) for g, v in got.items()}))
            print(f"emulated {rtt:g} ms {rows[-1][1]}", file=sys.stderr, flush=True)
        emulate(engine, 0.0)
        n = 1
        while n <= args.conversations:
            tps = statistics.median(one_run(engine, prompts[:n], args.tokens, 1)[0] for _ in range(args.reps))
            costs.append((n, n / tps * 1000.0))
            n *= 2
    finally:
        engine.close()
    lines = [
        f"`{command('groups.py', args.argv)}` on {machine()}; load average before the run {args.load:.1f}. "
        f"The same {args.conversations} conversations ({args.tokens} tokens each) with the nodes emulated: every "
        "layer's answers arrive one round trip after the call at no cost to this machine (zeros: the text is not "
        "the model's), as nodes with cores of their own and an ideal link would give them; the coordinator's "
        "side alone. Aggregate decode tok/s by groups (medians of "
        f"{args.reps}; the groups take turns at the dense work, coordinator/experts/turns.py).",
        "",
        "| RTT | 1 group | 2 groups | 3 groups | 4 groups | best / 1 group |",
        "|---|---|---|---|---|---|",
    ]
    for rtt, med in rows:
        best = max(med[g] for g in groups[1:])
        lines.append(f"| {rtt:g} ms | " + " | ".join(f"{med[g]:.1f}" for g in groups) + f" | {best / med[1]:.2f}x |")
    lines += [
        "",
        "A one-group pass's dense work by conversations (0 ms: no wait), ms: "
        + ", ".join(f"{n}: {ms:.1f}" for n, ms in costs)
        + ".",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__)
    p.add_argument("--rtts", default="0,2,5,25", help="round trips added by the relay, ms")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--tokens", type=int, default=24, help="tokens each conversation generates")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--emulated", action="store_true", help="nodes emulated (answers after the RTT, no CPU here)")
    args = bench_args(p, argv)
    args.rtts = [float(x) for x in args.rtts.split(",")]
    if args.emulated:
        publish("groups-emulated", emulated(args), not args.no_write)
    else:
        publish("groups", bench(args), not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
