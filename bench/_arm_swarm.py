"""A swarm with one ARM node of each generation beside x86 nodes, for bench/arm.py: the ARM nodes run in the
arm64 root (deploy/arm/arm-root.sh run BUILD 'swarm node ...', torch-free venvs, under qemu-user), the x86
ones and the coordinator here, all on loopback, at default settings (audits on, answers of another numerics
class checked within the cross-class bound).

The 4-layer qwen35moe Q4_K_M fixture (8 experts; Q4_K gate/up, Q6_K down in one layer): the neon, dotprod
and dotprod-i8mm nodes hold experts 0-1, 2-3 and 4-5, an x86 node 6-7, and a second x86 node all of them
(every expert has two holders, which take turns in address order: the ARM nodes listen on the lowest ports,
so they serve the prompt's call of every layer). Runs: every node honest (none may be banned), then one
node of each kind serving a whole GGUF whose layer-0 expert weights differ under the same header (it must
be banned, and only it). Each run is a fresh coordinator: a 12-token prompt's logits and 24 greedy tokens,
against in process: KL(in process || swarm) of the prompt's next-token distributions, and the text.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from _loopback import free_port  # noqa: E402
from test_trust import MODEL, other_weights  # noqa: E402

from swarm.coordinator.cli.spawn import LocalNode, start_nodes, stop_nodes  # noqa: E402
from swarm.coordinator.config import EngineConfig  # noqa: E402
from swarm.coordinator.decode.one import SamplingParams, checked_logits, forward_one, generate  # noqa: E402
from swarm.coordinator.engine import open_engine  # noqa: E402
from swarm.node.auth import KEY_ENV, SwarmKey, generate_key_text  # noqa: E402
from swarm.sharding.shard import shard_model  # noqa: E402

log = logging.getLogger("bench.arm")
SCRIPT = ROOT / "deploy" / "arm" / "arm-root.sh"
KEY_TEXT = generate_key_text()
KEY = SwarmKey.from_text(KEY_TEXT)
PROMPT = list(range(3, 15))
DECODE = 24
HOLD = {"neon": "0-1", "dotprod": "2-3", "dotprod-i8mm": "4-5", "x86": "6-7"}
# A logit moved by more than this moved by a step, not by float rounding: ggml rounds a product's input rows
# to 8 bits, and an element a few ulp off can round the other way (an expert's input, or its SwiGLU output).
NOISE = 1e-4
START_TIMEOUT = 600.0  # an emulated node imports and maps its slabs 20-100x slower than a real one


def _ports(n: int) -> list[int]:
    """n free loopback ports, lowest first: holders of an expert take turns in address order, so the ARM
    nodes (given the lowest) serve the first call of every layer (the prompt's) rather than the x86 replica."""
    return sorted(free_port() for _ in range(n))


def _arm_node(root: Path, work: str, build: str, source: str, args: list[str]) -> LocalNode:
    """`swarm node` of a build's venv in the root (the command execs down to the node: a signal reaches it)."""
    ready, logf = f"{work}/nodes/{build}.ready.json", root / f"{work.lstrip('/')}/nodes/{build}.log"
    (root / ready.lstrip("/")).unlink(missing_ok=True)
    cmd = (f"exec swarm node {source} --ready-file {ready} --exit-with-parent --threads 1 "
           f"--key-file {work}/swarm.key {' '.join(args)}")  # fmt: skip
    with open(logf, "wb") as out:
        proc = subprocess.Popen([str(SCRIPT), "run", build, cmd], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env={**os.environ, "ARM_ROOT": str(root)})  # fmt: skip
    return LocalNode(proc, root / ready.lstrip("/"), logf)


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """Mean over positions of KL(softmax p || softmax q), float64."""

    def logsoftmax(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = logsoftmax(p_logits), logsoftmax(q_logits)
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())


def _run(shard_dir: Path, nodes: dict[str, LocalNode], expect: np.ndarray, text: list[int]) -> dict:
    swarm = open_engine(shard_dir, EngineConfig(peers=tuple(n.address for n in nodes.values()), mdns=False, device="cpu", key=KEY))  # fmt: skip
    try:
        logits = checked_logits(swarm.model, PROMPT, swarm.model.new_state(), "cpu", swarm.checker).numpy()
        got = list(
            generate(swarm.model, PROMPT, SamplingParams(max_tokens=DECODE), "cpu", checker=swarm.checker)
        )
        by_address = {n.address: name for name, n in nodes.items()}
        banned = sorted(by_address.get(a, a) for a in swarm.checker.report.banned)
        moved = np.abs(logits.astype(np.float64) - expect).max(-1)  # per prompt position
        return {"kl": _kl(expect, logits), "max_dlogit": float(moved.max()), "moved": int((moved > NOISE).sum()),
                "text_same": got == text, "banned": banned}  # fmt: skip
    finally:
        swarm.close()


def run_swarm(root: Path, work: str, builds: list[str]) -> list[tuple[str, dict]]:
    """[(what was damaged, the run's figures)]: an honest run, then one damaged node of each kind."""
    host_work = root / work.lstrip("/")
    shard_dir = host_work / "m.swarm"
    if not shard_dir.exists():
        shard_model(MODEL, shard_dir)
    (host_work / "nodes").mkdir(parents=True, exist_ok=True)
    keyfile = host_work / "swarm.key"
    keyfile.write_text(KEY_TEXT)
    keyfile.chmod(0o600)
    liar = host_work / "liar.gguf"
    if not liar.exists():
        other_weights(MODEL, liar, 0)
    local = open_engine(shard_dir, EngineConfig(local=True, device="cpu"))
    try:
        expect = forward_one(local.model, PROMPT, local.model.new_state(), "cpu").numpy()
        text = list(generate(local.model, PROMPT, SamplingParams(max_tokens=DECODE), "cpu"))
    finally:
        local.close()
    results = []
    for damaged in [None, *builds, "x86"]:
        nodes: dict[str, LocalNode] = {}
        ports = [str(p) for p in _ports(len(builds) + 2)]
        try:
            for b, port in zip(builds, ports, strict=False):
                src = f"{work}/liar.gguf" if b == damaged else f"{work}/m.swarm"
                nodes[b] = _arm_node(root, work, b, src, ["--port", port, "--experts", HOLD[b]])
            x86_src = liar if damaged == "x86" else shard_dir
            x86 = start_nodes([(x86_src, ["--port", ports[-2], "--experts", HOLD["x86"]]),
                               (shard_dir, ["--port", ports[-1]])], host_work / "nodes", env={KEY_ENV: KEY_TEXT},
                              prefix="x86-")  # fmt: skip
            nodes["x86"], nodes["x86 (all experts)"] = x86
            for b in builds:
                nodes[b].wait_ready(START_TIMEOUT)
            figures = _run(shard_dir, nodes, expect, text)
            log.info("damaged %s: %s", damaged or "none", figures)
            results.append((damaged or "none", figures))
        finally:
            stop_nodes(list(nodes.values()), timeout=60.0)
    shutil.rmtree(host_work / "nodes", ignore_errors=True)
    return results


def swarm_lines(results: list[tuple[str, dict]]) -> list[str]:
    lines = [
        "| damaged node | banned | prompt logits: KL(in process ‖ swarm) | largest logit difference | positions "
        f"moved > {NOISE:g} | {DECODE} greedy tokens: the in-process text |",
        "|---|---|---:|---:|---:|---|",
    ]
    for damaged, r in results:
        lines.append(
            f"| {damaged} | {', '.join(r['banned']) or 'none'} | {r['kl']:.2g} | {r['max_dlogit']:.2g} | "
            f"{r['moved']} of {len(PROMPT)} | {'yes' if r['text_same'] else 'NO'} |"
        )
    return lines
