"""Decode under node churn, and what degraded mode costs.

Churn: 4 loopback nodes with replication 2 (nodes i and i+2 hold the same half of the experts); while a
128-token greedy generation runs, a node is SIGKILLed and restarted on its port every 2 s. Decode tokens/s
with churn is reported as a ratio to the same generation without faults, measured side by side in rotating
order, medians of the repetitions; every churned generation must equal the fault-free text (the bench stops
otherwise).

Degraded mode: logits of a 64-token prompt with a share of the experts gone (their pairs left out, the
weights of the rest renormalized: `--degraded`) against the full model: mean KL over the positions and top-1
agreement. Half the experts gone is measured through the swarm itself (both holders of one half stopped);
smaller shares through the same MoE renormalization in process.

    python bench/faults.py --workdir /work/bench-models/decode [--reps 3] [--no-write]
"""

from __future__ import annotations

import argparse
import logging
import platform
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _doc import publish  # noqa: E402
from _loopback import LOOPBACK  # noqa: E402
from _models import MODELS, prepare, prompt_tokens  # noqa: E402

from swarm.compute.ggml import set_threads  # noqa: E402
from swarm.compute.openmp import set_wait_policy  # noqa: E402
from swarm.coordinator.cli.spawn import LocalNode, spawn_node, start_nodes, stop_nodes  # noqa: E402
from swarm.coordinator.config import EngineConfig
from swarm.coordinator.decode.one import GenerationStats, SamplingParams, forward_one, generate  # noqa: E402
from swarm.coordinator.engine import Engine, open_engine  # noqa: E402
from swarm.coordinator.experts.backend import WithoutExperts  # noqa: E402
from swarm.node.auth import KEY_ENV, SwarmKey, generate_key_text  # noqa: E402
from swarm.sharding.ranges import format_ranges  # noqa: E402
from swarm.sharding.slabs import read_manifest  # noqa: E402

log = logging.getLogger("bench.faults")
KILL_EVERY = 2.0


class Churn:
    """Kills node i (round robin) every `every` s and starts it again on its port."""

    def __init__(
        self, nodes: list[LocalNode], specs: list[list[str]], shard_dir: Path, work: Path, env: dict
    ) -> None:
        self.nodes, self.specs, self.shard_dir, self.work, self.env = nodes, specs, shard_dir, work, env
        self.ports = [n.port for n in nodes]
        self.kills = 0
        self.restart_s: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def __enter__(self) -> Churn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        victim = 0
        while not self._stop.wait(KILL_EVERY):
            i = victim % len(self.nodes)
            victim += 1
            self.nodes[i].process.send_signal(signal.SIGKILL)
            self.nodes[i].process.wait(10)
            self.kills += 1
            t0 = time.monotonic()
            args = [*self.specs[i], "--port", str(self.ports[i])]
            self.nodes[i] = spawn_node(self.shard_dir, args, self.work, f"again{victim}", self.env)
            self.nodes[i].wait_ready(60)
            self.restart_s.append(time.monotonic() - t0)


def timed_generation(engine: Any, ids: list[int], n: int) -> tuple[list[int], float]:
    stats = GenerationStats()
    tokens = list(
        generate(
            engine.model, ids, SamplingParams(max_tokens=n), engine.device, stats, checker=engine.checker
        )
    )
    return tokens, stats.decode_tps


def kl_top1(full: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    p = torch.log_softmax(full.double(), -1)
    q = torch.log_softmax(other.double(), -1)
    kl = float((p.exp() * (p - q)).sum(-1).mean())
    top1 = float((full.argmax(-1) == other.argmax(-1)).double().mean())
    return kl, top1


Quality = list[tuple[str, float, float]]  # (experts gone, mean KL vs full, top-1 agreement)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen35moe")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--no-write", action="store_true")
    return ap.parse_args(argv)


def churn_runs(
    args: argparse.Namespace, engine: Any, ids: list[int], expect: list[int], churn: Callable[[], Churn]
) -> tuple[dict[str, list[float]], list[int], list[float]]:
    """Decode tok/s of each repetition without faults and under `churn`, in alternating order; the kills per
    churned generation and the nodes' restart times. Every text must equal the fault-free one, `expect`."""
    runs: dict[str, list[float]] = {"fault-free": [], "churn": []}
    kills: list[int] = []
    restarts: list[float] = []
    for rep in range(args.reps):
        for name in ["fault-free", "churn"] if rep % 2 == 0 else ["churn", "fault-free"]:
            if name == "churn":
                with churn() as churned:
                    tokens, tps = timed_generation(engine, ids, args.tokens)
                kills.append(churned.kills)
                restarts += churned.restart_s
            else:
                tokens, tps = timed_generation(engine, ids, args.tokens)
            if tokens != expect:
                raise SystemExit(f"rep {rep} {name}: the text differs from the fault-free one")
            runs[name].append(tps)
            log.info("rep %d %-10s decode %6.2f tok/s", rep + 1, name, tps)
    return runs, kills, restarts


def degraded_quality(
    full_local: Engine,
    full: torch.Tensor,
    shard_dir: Path,
    ids: list[int],
    nodes: list[LocalNode],
    key: SwarmKey,
    halves: list[str],
    n_expert: int,
) -> Quality:
    """Logits with a share of the experts gone against the full model's (`full`, from `full_local`, which
    this closes): half of them through the swarm (both holders of the second half stopped: mDNS goodbyes,
    the rest answers), smaller shares in process."""
    degraded = open_engine(
        shard_dir, EngineConfig(mdns_interfaces=[LOOPBACK], wait=20.0, device="cpu", key=key, degraded=True))
    for i in (1, 3):
        nodes[i].stop()
    time.sleep(1.0)
    half = forward_one(degraded.model, ids, degraded.model.new_state(), "cpu")
    quality = [
        ("1/2 (both holders of experts " + halves[1] + " gone; through the swarm)", *kl_top1(full, half))
    ]
    degraded.close()
    base = full_local.experts
    for share, label in ((8, "1/8"), (4, "1/4")):
        gone = set(range(n_expert - n_expert // share, n_expert))
        full_local.model.set_experts(WithoutExperts(base, gone))
        out = forward_one(full_local.model, ids, full_local.model.new_state(), "cpu")
        quality.append(
            (
                f"{label} (experts {format_ranges(sorted(gone))} gone; in process, same renormalization)",
                *kl_top1(full, out),
            )
        )
    full_local.model.set_experts(base)
    full_local.close()
    return quality


def render(
    args: argparse.Namespace,
    argv: list[str] | None,
    runs: dict[str, list[float]],
    kills: list[int],
    restarts: list[float],
    failovers: int,
    halves: list[str],
    quality: Quality,
) -> str:
    med = {k: statistics.median(v) for k, v in runs.items()}
    cmd = "python bench/faults.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        "<!-- bench:faults -->",
        "## Decode under node churn, and the cost of degraded mode (`bench/faults.py`)",
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {platform.machine()}, 2 cores shared with other work (read the ratios), torch {torch.__version__}, "
        f"{args.threads} coordinator threads; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.  ",
        f"Model: `swarm synth` preset {MODELS[args.model]['preset']}, {args.layers} layers, Q4_K experts, Q8_0 dense "
        f"(random weights), as a shard directory. 4 loopback nodes, `--threads 1` each, replication 2 (nodes 0 and 2 "
        f"hold experts {halves[0]}, nodes 1 and 3 hold {halves[1]}), found by mDNS, swarm key, default audits (0.05).  ",
        f"Workload: a 64-token prompt, then {args.tokens} greedy tokens; {args.reps} repetitions in rotating order; "
        f"medians. Churn: a node SIGKILLed and restarted on its port every {KILL_EVERY:g} s during the generation "
        f"(round robin); every churned text equalled the fault-free one, token for token.",
        "",
        "| run | decode tok/s (median) | vs fault-free | decode tok/s of each run |",
        "| --- | ---: | ---: | --- |",
    ]
    for name in ("fault-free", "churn"):
        each = ", ".join(f"{v:.1f}" for v in runs[name])
        lines.append(f"| {name} | {med[name]:.1f} | {med[name] / med['fault-free']:.2f}x | {each} |")
    lines += [
        "",
        f"Kills per churned generation: {', '.join(map(str, kills))}; a node took {statistics.median(restarts):.1f} s "
        f"(median) from SIGKILL to serving again; {failovers} calls failed over in all.",
        "",
        "Degraded mode (`--degraded`, off by default): logits of the 64-token prompt with a share of the experts "
        "gone, against the full model (natural-log KL, mean over positions; random weights, so read the trend, "
        "not the size a trained model would show):",
        "",
        "| experts gone | mean KL vs full | top-1 agreement |",
        "| --- | ---: | ---: |",
    ]
    for label, kl, top1 in quality:
        lines.append(f"| {label} | {kl:.3g} | {top1:.3f} |")
    lines.append("<!-- /bench:faults -->")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("swarm").setLevel(logging.ERROR)  # the churn's failovers would flood the output
    set_wait_policy(experts_remote=True)
    set_threads(args.threads)
    gguf, shard_dir = prepare(args.model, args.layers, args.workdir)
    n_expert = read_manifest(shard_dir).n_expert
    halves = [format_ranges(range(0, n_expert // 2)), format_ranges(range(n_expert // 2, n_expert))]
    specs = [["--experts", halves[i % 2], "--threads", "1", "--no-verify"] for i in range(4)]
    key_text = generate_key_text()
    env = {KEY_ENV: key_text}
    work = args.workdir / "faults-nodes"
    nodes = start_nodes([(shard_dir, s) for s in specs], work, timeout=180, env=env)
    try:
        engine = open_engine(
            shard_dir, EngineConfig(mdns_interfaces=[LOOPBACK], wait=20.0, device="cpu", key=SwarmKey.from_text(key_text)))
        ids = prompt_tokens(engine, 64)
        expect, _ = timed_generation(engine, ids, args.tokens)  # also admits (probes) every node once
        churn = partial(Churn, nodes, specs, shard_dir, work, env)
        runs, kills, restarts = churn_runs(args, engine, ids, expect, churn)
        failovers = engine.experts.failovers

        full_local = open_engine(gguf, EngineConfig(local=True, device="cpu"))
        full = forward_one(full_local.model, ids, full_local.model.new_state(), "cpu")
        engine.close()
        key = SwarmKey.from_text(key_text)
        quality = degraded_quality(full_local, full, shard_dir, ids, nodes, key, halves, n_expert)
    finally:
        stop_nodes(nodes)
    publish(
        "faults", render(args, argv, runs, kills, restarts, failovers, halves, quality), not args.no_write
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
