"""Decode and prefill tokens/s: in-process experts vs loopback swarm nodes (vs llama.cpp, vs llama.cpp RPC).

Two models, both `swarm synth` with the real layer shape and 4 layers, Q4_K experts, Q8_0 dense (like the
real UD files):
  --model qwen3moe   qwen3-30b-a3b preset (D 2048, E 128, K 8, F 768): in-process vs 4 loopback nodes (issue 4)
  --model qwen35moe  qwen3.6-35b-a3b preset (D 2048, E 256, K 8, F 512, shared 512, hybrid attention):
                     in-process, 4 loopback nodes, llama.cpp (llama-bench, same GGUF, same threads) and
                     llama.cpp RPC over 4 local rpc-servers (issue 5)

    .venv/bin/python bench/decode.py --model qwen35moe [--reps 3] [--prompt-tokens 64] [--decode-tokens 32] \
        [--llama-bench /work/llamacpp-build/build/bin/llama-bench] [--rpc-server .../ggml-rpc-server] \
        [--audit RATE]

Every repetition runs every configuration once (those compared with each other back to back: UNITS), each
from a cold start the way a user meets `swarm run`: a fresh process opens the model (and the nodes start) and
the timed prefill and decode follow at once, with no warm-up pass (llama-bench does its own warm-up). The
default numerics computes on the stored quant blocks; the `--exact` configurations (float32 working copies,
dequantized as experts are first met) run beside them. Medians over the repetitions; ratios against the
in-process run.

For the swarm, where one decode step's time goes, all measured: dispatch (route output packed, encoded and
sent: SwarmExperts.start), blocked wait (the model waiting for node replies: SwarmExperts.wait_seconds), the
dense path (the rest of the step: attention / DeltaNet, norms, router, shared expert, output head), and node
compute (the nodes' own Stats busy_seconds delta over the decode phase, summed and for the busiest node).

Figures go to docs/BENCHMARKS.md: the `bench:decode` section, inside it one `bench:decode-<model>` per model.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import multiprocessing
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from swarm.compute import ffn
from swarm.compute.ggml import set_threads
from swarm.compute.openmp import wait_policy_env
from swarm.coordinator.audit import DEFAULT_RATE
from swarm.coordinator.engine import Engine, open_engine
from swarm.coordinator.experts import PendingExperts
from swarm.coordinator.generate import GenerationStats, SamplingParams, generate
from swarm.coordinator.spawn import SWARM_CLI, LocalNode, start_nodes, stop_nodes
from swarm.coordinator.swarm import SwarmExperts
from swarm.node.client import NodeClient
from swarm.sharding.ranges import format_ranges
from swarm.sharding.shard import shard_model
from swarm.sharding.slabs import read_manifest
from swarm.sharding.synth import preset, synthesize

log = logging.getLogger("bench.decode")

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "BENCHMARKS.md"
LOOPBACK = "127.0.0.1"
DEFAULT_BUILD = Path("/work/llamacpp-build/build/bin")
# The same llama.cpp built for the AVX2 baseline, the x86 level swarm's ggml is built for (README): how much of
# the gap to llama.cpp is the instruction set rather than the engine.
AVX2_BUILD = Path("/work/llamacpp-avx2/build/bin")
AVX2_CMAKE = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
OUTER = "decode"  # this script's section of docs/BENCHMARKS.md; one inner section per model
# Nodes that answer zeros (the transport's floor): the real `swarm node` under bench/zero_node.py.
ZERO_NODE: tuple[str, ...] = (str(ROOT / "bench" / "zero_node.py"),)

MODELS: dict[str, dict[str, Any]] = {
    "qwen3moe": {"preset": "qwen3-30b-a3b", "issue": 4, "llama": False},
    "qwen35moe": {"preset": "qwen3.6-35b-a3b", "issue": 9, "llama": True},
}

# A fixed English prompt (the synth tokenizer is trained on English text); repeated and cut to --prompt-tokens.
PROMPT = (
    "A mixture of experts model keeps many small feed-forward networks in every layer and sends each token "
    "to only a few of them, chosen by a router. Most of the weights sit in the experts, so a swarm of "
    "ordinary devices can hold them between them while one coordinator runs the attention and the router. "
)


@dataclass
class Run:
    """One timed pass of one configuration."""

    prefill_tps: float
    decode_tps: float
    tokens: list[int] = field(default_factory=list)
    breakdown: dict[str, float] = field(default_factory=dict)  # per decode step, seconds


# --- model preparation -------------------------------------------------------------------------------------


def prepare(model: str, layers: int, workdir: Path) -> tuple[Path, Path]:
    """The synthesized GGUF and its shard directory (reused when already in workdir: synth is deterministic)."""
    spec = preset(MODELS[model]["preset"], n_layers=layers, experts_type="Q4_K", dense_type="Q8_0")
    gguf = workdir / f"{model}-{layers}l-q4k-q80.gguf"
    shard_dir = workdir / f"{model}-{layers}l-q4k-q80.swarm"
    if not gguf.exists():
        log.info("synthesizing %s ...", gguf.name)
        synthesize(gguf, spec)
        shutil.rmtree(shard_dir, ignore_errors=True)
    if not (shard_dir / "manifest.json").exists():
        log.info("sharding into %s ...", shard_dir.name)
        shard_model(gguf, shard_dir, progress=False)
    return gguf, shard_dir


def prompt_tokens(engine: Engine, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += engine.tokenizer.encode(PROMPT)
    return ids[:n]


# --- timing proxies around the expert backends ---------------------------------------------------------------


class _TimedWait:
    def __init__(self, owner: TimedBackend, inner: PendingExperts) -> None:
        self.owner, self.inner = owner, inner

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return self.inner.wait()
        finally:
            self.owner.wait_s += time.perf_counter() - t0


class TimedBackend:
    """Passes start/wait through to a backend, adding up the time spent in each.

    For the in-process backend `start` is the whole expert computation; for the swarm it is pack + encode +
    send, and `wait` is the time blocked on replies (plus decoding them and unpacking).
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.start_s = 0.0
        self.wait_s = 0.0
        self.starts = 0

    def start(self, layer: int, x: torch.Tensor, ids: torch.Tensor) -> PendingExperts:
        t0 = time.perf_counter()
        try:
            return _TimedWait(self, self.inner.start(layer, x, ids))
        finally:
            self.start_s += time.perf_counter() - t0
            self.starts += 1


class TimedInProcess:
    """The in-process counterpart of TimedBackend, which would hide the experts from the MoE block's one-graph
    path (it takes only this process's own experts): times ffn.moe_layer (a whole MoE layer: experts,
    shared expert, sum) and the backend's own start (the exact numerics, which go op by op) in place."""

    def __init__(self, experts: Any) -> None:
        self.start_s = 0.0
        self.wait_s = 0.0
        self.starts = 0
        self._restore: list[tuple[Any, str, Any]] = []
        self._wrap(ffn, "moe_layer")
        self._wrap(experts, "start")

    def _wrap(self, owner: Any, name: str) -> None:
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.start_s += time.perf_counter() - t0
                self.starts += 1

        self._restore.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, timed)

    def close(self) -> None:
        for owner, name, old in reversed(self._restore):
            if old is None:
                delattr(owner, name)  # an instance's own attribute: the class's method shows again
            else:
                setattr(owner, name, old)


# Configurations whose figures are compared with each other run back to back, a unit per comparison, so
# that the two runs of a ratio meet the same stretch of this shared machine's load (minutes apart, a busy
# spell could sink one side only). Within a unit each neighbour pair stays adjacent: the unit runs forwards
# in even repetitions and backwards in odd ones (who goes first alternates); the units rotate.
UNITS: tuple[tuple[str, ...], ...] = (
    ("llama.cpp-avx2", "in-process", "llama.cpp"),
    ("swarm", "llama.cpp-rpc", "swarm-noaudit", "swarm-grpc"),
    ("swarm-floor", "swarm-layers"),
    ("in-process-exact", "swarm-exact"),
)


def rep_order(active: Sequence[str], rep: int) -> list[str]:
    """The configurations of repetition `rep` in the order they run (see UNITS); any not in a unit last."""
    units = [[c for c in u if c in active] for u in UNITS]
    units = [u if rep % 2 == 0 else u[::-1] for u in units if u]
    if units:
        units = units[rep % len(units) :] + units[: rep % len(units)]
    placed = {c for u in units for c in u}
    return [c for u in units for c in u] + [c for c in active if c not in placed]


# --- our engine, in-process or over loopback nodes -------------------------------------------------------


def node_busy(clients: Sequence[NodeClient]) -> list[tuple[float, int]]:
    out = []
    for c in clients:
        s = c.stats()
        out.append((s.busy_seconds, s.calls))
    return out


def timed_pass(
    engine: Engine,
    ids: list[int],
    n_decode: int,
    backend: TimedBackend | TimedInProcess,
    clients: Sequence[NodeClient] = (),
) -> Run:
    """Prefill `ids`, then greedy-decode n_decode tokens as `swarm run` does (generate(), with the engine's
    answer checker: its audits and settling are part of the time); bookkeeping snapshots are taken outside
    the timed regions."""
    stats = GenerationStats(prompt_tokens=len(ids))
    swarm = engine.experts if isinstance(engine.experts, SwarmExperts) else None
    params = SamplingParams(max_tokens=n_decode)  # greedy, no stop tokens: always n_decode tokens
    tokens = generate(engine.model, ids, params, engine.device, stats, checker=engine.checker)
    first = [next(tokens)]  # the prompt's pass (settled: the first token is what a user waits for)

    s0, w0, n0 = backend.start_s, backend.wait_s, backend.starts
    sw0 = swarm.wait_seconds if swarm else 0.0
    b0 = node_busy(clients)
    t0 = time.perf_counter()
    rest = list(tokens)
    stats.decode_seconds = time.perf_counter() - t0
    b1 = node_busy(clients)
    tokens = first + rest
    stats.generated_tokens = len(tokens)

    steps = max(1, n_decode - 1)
    bd = {
        "step": stats.decode_seconds / steps,
        "start": (backend.start_s - s0) / steps,
        "wait": (backend.wait_s - w0) / steps,
        "moe_calls": (backend.starts - n0) / steps,
    }
    bd["dense"] = bd["step"] - bd["start"] - bd["wait"]
    if swarm is not None:
        bd["swarm_wait"] = (swarm.wait_seconds - sw0) / steps
    if clients:
        busy = [(b[0] - a[0]) / steps for a, b in zip(b0, b1, strict=True)]
        calls = [(b[1] - a[1]) / steps for a, b in zip(b0, b1, strict=True)]
        bd["node_busy_sum"] = sum(busy)
        bd["node_busy_max"] = max(busy)
        bd["node_calls"] = sum(calls)
    return Run(stats.prefill_tps, stats.decode_tps, tokens, bd)


def run_engine(engine: Engine, n_prompt: int, n_decode: int, clients: Sequence[NodeClient] = ()) -> Run:
    """The first prefill and decode of a freshly opened engine: what `swarm run` reports."""
    ids = prompt_tokens(engine, n_prompt)
    if isinstance(engine.experts, SwarmExperts):
        backend = TimedBackend(engine.experts)
        engine.model.set_experts(backend)
        return timed_pass(engine, ids, n_decode, backend, clients)
    local = TimedInProcess(engine.experts)
    try:
        return timed_pass(engine, ids, n_decode, local, clients)
    finally:
        local.close()


def run_inprocess(gguf: Path, n_prompt: int, n_decode: int, threads: int, numerics: str) -> Run:
    """`swarm run GGUF --local`: the whole file, experts in this process."""
    set_threads(threads)
    # exact: no cap on the float32 copies (all of them, 13 GB, fit this machine; the default half-RAM budget
    # would thrash by a few experts and time the LRU, not the numerics)
    budget = 0 if numerics == "exact" else None
    engine = open_engine(gguf, local=True, device="cpu", numerics=numerics, memory_budget=budget)
    try:
        return run_engine(engine, n_prompt, n_decode)
    finally:
        engine.close()
        del engine
        gc.collect()


def split(n: int, parts: int) -> list[list[int]]:
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def run_swarm(
    shard_dir: Path,
    n_nodes: int,
    node_threads: int,
    n_prompt: int,
    n_decode: int,
    workdir: Path,
    threads: int,
    numerics: str,
    audit: float | None = None,
    program: Sequence[str] = SWARM_CLI,
    by_layer: bool = False,
    stream: bool = True,
) -> Run:
    """`swarm run` over loopback nodes; `audit`: the share of node answers checked (None: the default);
    `program`: what runs the nodes' CLI (ZERO_NODE: nodes that answer zeros, the transport's floor);
    `by_layer`: each node holds every expert of a range of the MoE layers (llama.cpp's RPC placement: one call
    per layer and step) instead of a range of every layer's experts (a call to every node per layer); `stream`:
    Compute calls over the nodes' compute streams (the default) or, with False, over gRPC (`--no-stream`)."""
    set_threads(threads)
    manifest = read_manifest(shard_dir)
    if by_layer:
        held = [["--layers", format_ranges([manifest.moe_layers[i] for i in r])]
                for r in split(len(manifest.moe_layers), n_nodes)]  # fmt: skip
    else:
        held = [["--experts", format_ranges(r)] for r in split(manifest.n_expert, n_nodes)]
    specs = [
        (shard_dir, ["--host", LOOPBACK, *h, "--threads", str(node_threads), "--no-verify",
                     *(() if stream else ("--no-stream",))])
        for h in held
    ]  # fmt: skip
    nodes: list[LocalNode] = start_nodes(specs, workdir / "nodes", timeout=120.0, program=program)
    engine = None
    clients: list[NodeClient] = []
    try:
        engine = open_engine(
            shard_dir,
            local=False,
            mdns_interfaces=[LOOPBACK],
            wait=20.0,
            device="cpu",
            numerics=numerics,
            **({} if audit is None else {"audit": audit}),
        )
        assert isinstance(engine.experts, SwarmExperts)
        if len(engine.experts.clients) != n_nodes:
            raise RuntimeError(f"found {len(engine.experts.clients)} nodes by mDNS, started {n_nodes}")
        clients = [NodeClient(n.address, fingerprint=n.fingerprint) for n in nodes]
        return run_engine(engine, n_prompt, n_decode, clients)
    finally:
        for c in clients:
            c.close()
        if engine is not None:
            engine.close()
        stop_nodes(nodes)


# --- llama.cpp ---------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def llama_bench(
    binary: Path, gguf: Path, threads: int, n_prompt: int, n_decode: int, rpc: Sequence[str] = ()
) -> Run:
    """One llama-bench run (its own warm-up, then one timed pp and one timed tg test); tokens/s of each."""
    cmd = [str(binary), "-m", str(gguf), "-p", str(n_prompt), "-n", str(n_decode), "-t", str(threads)]
    cmd += ["-r", "1", "-o", "json"]
    if rpc:
        cmd += ["--rpc", ",".join(rpc), "-ngl", "99"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.splitlines()[-15:])
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{tail}")
    rows = json.loads(proc.stdout)
    pp = next(r for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0)
    tg = next(r for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0)
    return Run(float(pp["avg_ts"]), float(tg["avg_ts"]))


def run_llama_rpc(
    bench_bin: Path,
    server_bin: Path,
    gguf: Path,
    threads: int,
    n_servers: int,
    server_threads: int,
    n_prompt: int,
    n_decode: int,
    workdir: Path,
) -> Run:
    with rpc_servers(server_bin, n_servers, server_threads, workdir) as endpoints:
        return llama_bench(bench_bin, gguf, threads, n_prompt, n_decode, endpoints)


@contextlib.contextmanager
def rpc_servers(server_bin: Path, n_servers: int, server_threads: int, workdir: Path) -> Iterator[list[str]]:
    """n llama.cpp `ggml-rpc-server` processes on loopback (`-t server_threads` each): their endpoints, while
    the block runs; stopped after it."""
    procs: list[tuple[subprocess.Popen, Any]] = []
    endpoints = []
    try:
        for i in range(n_servers):
            port = free_port()
            logf = open(workdir / f"rpc-server{i}.log", "wb")  # noqa: SIM115 (closed below)
            cmd = [str(server_bin), "-H", LOOPBACK, "-p", str(port), "-t", str(server_threads)]
            procs.append((subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT), logf))
            endpoints.append(f"{LOOPBACK}:{port}")
        for ep in endpoints:
            wait_port(ep, 30.0)
        yield endpoints
    finally:
        for p, _ in procs:
            p.terminate()
        for p, logf in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            logf.close()


def wait_port(endpoint: str, timeout: float) -> None:
    host, port = endpoint.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rpc-server at {endpoint} not listening after {timeout} s") from None
            time.sleep(0.1)


def llama_version(binary: Path) -> str:
    proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    text = (proc.stdout + proc.stderr).strip().splitlines()
    return next((line for line in text if "version" in line), "unknown version")


# --- report ------------------------------------------------------------------------------------------------


def med(runs: Sequence[Run], get: Callable[[Run], float]) -> float:
    return statistics.median(get(r) for r in runs)


def med_bd(runs: Sequence[Run], key: str) -> float:
    return statistics.median(r.breakdown[key] for r in runs) * 1e3


# (ours, llama.cpp's) configurations compared run by run: the engine in process against llama-bench, the swarm
# against llama.cpp's RPC.
PAIRS = (
    ("in-process", "llama.cpp"),
    ("in-process", "llama.cpp-avx2"),
    ("swarm", "llama.cpp-rpc"),
    ("swarm-noaudit", "llama.cpp-rpc"),
    ("swarm-grpc", "llama.cpp-rpc"),
    ("swarm-noaudit", "swarm-grpc"),
)


def side_by_side(results: dict[str, list[Run]]) -> dict[tuple[str, str], tuple[list[float], list[float]]]:
    """For each pair both measured: the prefill and decode ratios of the runs of the same repetition."""
    out = {}
    for ours, theirs in PAIRS:
        a, b = results.get(ours, []), results.get(theirs, [])
        n = min(len(a), len(b))
        if n:
            out[(ours, theirs)] = (
                [a[i].prefill_tps / b[i].prefill_tps for i in range(n)],
                [a[i].decode_tps / b[i].decode_tps for i in range(n)],
            )
    return out


def render(
    args: argparse.Namespace,
    cmd: str,
    results: dict[str, list[Run]],
    unavailable: dict[str, str],
    notes: list[str],
    llama_ver: str | None,
) -> str:
    model = args.model
    m = MODELS[model]
    spec = preset(m["preset"], n_layers=args.layers, experts_type="Q4_K", dense_type="Q8_0")
    section = f"decode-{model}"
    base = results.get("in-process", [])
    names = {
        "in-process": "in-process experts",
        "swarm": f"swarm, {args.nodes} loopback nodes"
        + (f", `--audit {args.audit:g}`" if args.audit is not None else ""),
        "swarm-noaudit": f"swarm, {args.nodes} loopback nodes, `--audit 0` (answers trusted, as RPC does)",
        "swarm-grpc": f"swarm, {args.nodes} loopback nodes, `--audit 0`, Compute calls over gRPC (nodes started "
        "with `--no-stream`)",
        "swarm-floor": f"swarm, {args.nodes} loopback nodes that answer zeros (no expert compute: the "
        "transport's floor), `--audit 0`",
        "swarm-layers": f"swarm, {args.nodes} loopback nodes holding a layer's experts each (RPC's "
        "placement: one call per layer), `--audit 0`",
        "llama.cpp": f"llama.cpp (llama-bench, {args.threads} threads)",
        "llama.cpp-avx2": f"llama.cpp built for the AVX2 baseline as swarm's ggml is (llama-bench, {args.threads} "
        "threads)",
        "llama.cpp-rpc": f"llama.cpp RPC, {args.rpc_servers} local rpc-servers",
        "in-process-exact": "in-process experts, `--exact`",
        "swarm-exact": f"swarm, {args.nodes} loopback nodes, `--exact`",
    }
    lines = [
        f"<!-- bench:{section} -->",
        f"## Decode and prefill tokens/s, {model} (issue {m['issue']}; `bench/decode.py`)",
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores shared with other engineers' test runs (noisy: "
        f"read the ratios, not the absolute figures), torch {torch.__version__} with {args.threads} threads in "
        f"the coordinator, Python {platform.python_version()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.  ",
        f"Model: `swarm synth` preset {m['preset']}, {spec.n_layers} layers, D {spec.n_embd}, E {spec.n_expert}, "
        f"K {spec.n_expert_used}, F {spec.expert_ff}"
        + (f", shared F {spec.shared_ff}" if spec.shared_ff else "")
        + f", Q4_K experts, {spec.dense_type} dense, vocab {spec.n_vocab} (random weights).  ",
        f"Workload: a fixed {args.prompt_tokens}-token prompt, then {args.decode_tokens} greedy tokens "
        f"(decode tokens/s counts the {args.decode_tokens - 1} steps after the token prefill gives). "
        f"{args.reps} repetitions; each runs every configuration once, from a cold start "
        "(a fresh process opens the model; no warm-up pass), timed as `swarm run` times it; configurations "
        "compared with each other run back to back, their order alternating (bench/decode.py: UNITS); medians. Nodes: "
        f"`--threads {args.node_threads}` each, disjoint expert ranges (unless the row says otherwise), found by mDNS on "
        "127.0.0.1, f32 wire.",
        "",
        "| configuration | prefill tok/s | decode tok/s | prefill vs in-process | decode vs in-process | "
        "decode tok/s of each run |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for key, label in names.items():
        if key in unavailable:
            lines.append(f"| {label} | unavailable | unavailable | | | |")
            continue
        runs = results.get(key)
        if not runs:
            continue
        pre, dec = med(runs, lambda r: r.prefill_tps), med(runs, lambda r: r.decode_tps)
        rp = rd = ""
        if base:
            rp = f"{pre / med(base, lambda r: r.prefill_tps):.2f}x"
            rd = f"{dec / med(base, lambda r: r.decode_tps):.2f}x"
        each = ", ".join(f"{r.decode_tps:.1f}" for r in runs)
        lines.append(f"| {label} | {pre:,.1f} | {dec:,.1f} | {rp} | {rd} | {each} |")
    pairs = side_by_side(results)
    if pairs:
        lines += [
            "",
            "Against llama.cpp, run by run (each ratio from runs of the same repetition; median, then each):",
            "",
        ]
        lines += [
            f"- {names[ours]} vs {names[theirs]}: prefill {statistics.median(p):.2f}x "
            f"({', '.join(f'{r:.2f}' for r in p)}), decode {statistics.median(d):.2f}x "
            f"({', '.join(f'{r:.2f}' for r in d)})"
            for (ours, theirs), (p, d) in pairs.items()
        ]
    for key, why in unavailable.items():
        lines += ["", f"**{names[key]}: unavailable.** {why}"]
    if llama_ver:
        lines += [
            "",
            f"llama.cpp: {llama_ver}, built from the source vendored in the llama-cpp-python 0.3.36 sdist "
            "(CPU backend, -march=native, OpenMP, llamafile tinyBLAS and weight repacking on, its defaults); "
            "llama-bench's pp test feeds "
            f"{args.prompt_tokens} tokens, its tg test decodes {args.decode_tokens} tokens from an empty context "
            "(ours decodes after the prompt, so it attends over 64 more positions; at 4 layers with 1 "
            "full-attention layer that is a small part of a step). RPC: `llama-bench --rpc ... -ngl 99` puts "
            "the layers on the rpc-servers (llama.cpp splits by layer, not by expert); "
            f"each rpc-server runs `-t {args.rpc_threads}`."
            + (f" {args.llama_note}" if args.llama_note else ""),
            "",
            "Building it (outside the repo; nothing of it is committed; 8 min on these 2 cores):",
            "",
            "```",
            "pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d /work/ext && cd /work/ext",
            "tar xzf llama_cpp_python-0.3.36.tar.gz",
            "cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B /work/llamacpp-build/build \\",
            "      -DCMAKE_BUILD_TYPE=Release -DGGML_RPC=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF",
            "cmake --build /work/llamacpp-build/build -j2 --target llama-bench ggml-rpc-server llama-server llama-batched-bench",
            "```",
            "",
            "Where the CPU reports AMX but the machine does not enable it (a VM: llama.cpp's native build then dies "
            "with SIGILL at `tilezero` in ggml's AMX kernels), add "
            '`"-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"` and the same `-DCMAKE_CXX_FLAGS` to '
            "the configure line.",
        ]
        if "llama.cpp-avx2" in results:
            lines += [
                "",
                "The AVX2-baseline row is the same source built for the x86 level swarm's ggml is built for "
                "(no AVX-512 or VNNI even where the CPU has them; see the README's install), the same two "
                "commands with `-B /work/llamacpp-avx2/build` and",
                "",
                f"`{AVX2_CMAKE}` added to the configure line.",
            ]
    swarm = results.get("swarm")
    if swarm:
        w = med_bd(swarm, "swarm_wait")
        lines += [
            "",
            "Where one decode step goes in the swarm (ms per step, medians; every figure measured):",
            "",
            "| part | ms / step | what it is |",
            "| --- | ---: | --- |",
            f"| whole step | {med_bd(swarm, 'step'):.1f} | wall time of one decode step (one token, as `swarm run` steps: generate() with its answer checks) |",
            f"| dense path | {med_bd(swarm, 'dense'):.1f} | the step minus the two rows below: attention / "
            "DeltaNet, norms, routers, shared experts, output head, argmax (coordinator compute) |",
            f"| dispatch | {med_bd(swarm, 'start'):.1f} | SwarmExperts.start: group expert-major, pack, "
            "encode, send one call per node |",
            f"| blocked wait | {med_bd(swarm, 'wait'):.1f} | pending.wait(): the model blocked on node "
            f"replies, then decode and unpack (SwarmExperts.wait_seconds: {w:.1f}) |",
            f"| node compute, all nodes | {med_bd(swarm, 'node_busy_sum'):.1f} | sum over the nodes of their "
            "Stats busy_seconds delta |",
            f"| node compute, busiest node | {med_bd(swarm, 'node_busy_max'):.1f} | the largest single node's "
            "busy delta |",
            "",
            f"Per step: {statistics.median(r.breakdown['moe_calls'] for r in swarm):.0f} MoE layers fanned out, "
            f"{statistics.median(r.breakdown['node_calls'] for r in swarm):.0f} Compute calls in all. "
            "The nodes and the coordinator share the same 2 cores, so the nodes' busy time is time the "
            "coordinator cannot run either.",
        ]
    floor = results.get("swarm-floor")
    if floor:
        lines += [
            "",
            f"Through nodes that answer zeros (bench/zero_node.py: the real nodes, gRPC and coordinator, with no "
            f"expert compute; its tokens are not the model's and are not compared), a decode step takes "
            f"{med_bd(floor, 'step'):.1f} ms (medians): dense path {med_bd(floor, 'dense'):.1f}, dispatch "
            f"{med_bd(floor, 'start'):.1f}, blocked wait {med_bd(floor, 'wait'):.1f}, the nodes' busy time "
            f"{med_bd(floor, 'node_busy_sum'):.1f} in all. That is what the transport and the coordinator cost "
            "before any expert is multiplied.",
        ]
    layers = results.get("swarm-layers")
    if layers:
        lines += [
            "",
            f"Placed by layer as llama.cpp's RPC places them (each node holds every expert of "
            f"{statistics.median(r.breakdown['moe_calls'] for r in layers) / args.nodes:.0f} MoE layer(s), so a "
            f"step makes {statistics.median(r.breakdown['node_calls'] for r in layers):.0f} Compute calls instead "
            f"of one per node and layer), a decode step takes {med_bd(layers, 'step'):.1f} ms (medians): dense "
            f"path {med_bd(layers, 'dense'):.1f}, dispatch {med_bd(layers, 'start'):.1f}, blocked wait "
            f"{med_bd(layers, 'wait'):.1f}, the nodes' busy time {med_bd(layers, 'node_busy_sum'):.1f} in all. "
            "The same nodes and model; only which node holds which slab differs. It is the placement for few "
            "round trips; the expert-range placement spreads each layer's compute over every node instead "
            "(what a long prompt gains from: compare the prefill columns).",
        ]
    if base:
        lines += [
            "",
            "In-process, for comparison (ms per decode step, medians): "
            f"whole step {med_bd(base, 'step'):.1f}, the MoE layers' graphs (ffn.moe_layer: routed experts, "
            f"shared expert and the sum) {med_bd(base, 'start'):.1f}, the rest (attention / DeltaNet, norms, "
            f"routers, output head) {med_bd(base, 'dense'):.1f}.",
        ]
    lines += [*(["", *notes] if notes else []), f"<!-- /bench:{section} -->"]
    return "\n".join(lines)


def write_section(text: str, section: str) -> None:
    """Replace (or add) the inner section `section` inside this script's `bench:decode` section, so that a run
    on one model keeps the other model's figures."""
    DOC.parent.mkdir(parents=True, exist_ok=True)
    old = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    outer = re.compile(rf"<!-- bench:{OUTER} -->\n?(.*?)<!-- /bench:{OUTER} -->", re.S)
    found = outer.search(old)
    body = found.group(1) if found else ""
    inner = re.compile(rf"<!-- bench:{re.escape(section)} -->.*?<!-- /bench:{re.escape(section)} -->", re.S)
    body = (
        inner.sub(lambda _m: text, body) if inner.search(body) else body.rstrip("\n") + "\n\n" + text + "\n"
    )
    block = f"<!-- bench:{OUTER} -->\n{body.strip(chr(10))}\n<!-- /bench:{OUTER} -->"
    new = outer.sub(lambda _m: block, old) if found else old.rstrip("\n") + "\n\n" + block + "\n"
    DOC.write_text(new)


def _call(fn: Callable[[], Run]) -> Run:
    return fn()


def _in_child(fn: Callable[[], Run], experts_remote: bool) -> Callable[[], Run]:
    """fn in a fresh process whose OpenMP wait policy is the one `swarm run` would pick (set before the
    child loads torch, which is the only time it counts)."""

    def run() -> Run:
        env = wait_policy_env(experts_remote)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                return pool.submit(_call, fn).result()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    return run


# --- main --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="qwen3moe")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2, help="compute threads of the coordinator; llama.cpp -t")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--node-threads", type=int, default=1, help="compute threads of each node")
    p.add_argument("--rpc-servers", type=int, default=4)
    p.add_argument("--llama-note", default="", help="a sentence about the llama.cpp build used, for the doc")
    p.add_argument("--rpc-threads", type=int, default=1, help="threads of each llama.cpp rpc-server")
    p.add_argument("--llama-bench", type=Path, default=DEFAULT_BUILD / "llama-bench")
    p.add_argument("--rpc-server", type=Path, default=DEFAULT_BUILD / "ggml-rpc-server")
    p.add_argument(
        "--llama-bench-avx2",
        type=Path,
        default=AVX2_BUILD / "llama-bench",
        help="llama-bench built for the AVX2 baseline (the row is left out where there is none)",
    )
    p.add_argument(
        "--only",
        default=None,
        help="comma list of configurations: in-process,swarm,swarm-noaudit,swarm-grpc,swarm-floor,swarm-layers,"
        "llama.cpp,llama.cpp-avx2,llama.cpp-rpc,in-process-exact,swarm-exact",
    )
    p.add_argument(
        "--audit",
        type=float,
        default=None,
        help=f"share of node answers the audited swarm row checks (default: swarm's own, {DEFAULT_RATE})",
    )
    p.add_argument("--workdir", type=Path, default=None, help="keep/reuse the synthesized model here")
    p.add_argument(
        "--no-write", action="store_true", help="print the section instead of writing docs/BENCHMARKS.md"
    )
    args = p.parse_args(argv)
    if args.audit is not None and not 0.0 <= args.audit <= 1.0:
        p.error(f"--audit {args.audit}: give a share between 0 and 1")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    log.setLevel(logging.INFO)
    torch.set_num_threads(args.threads)
    cmd = "python bench/decode.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))

    configs = ["in-process", "swarm", "swarm-noaudit", "swarm-grpc", "swarm-floor", "swarm-layers",
               "in-process-exact", "swarm-exact"]  # fmt: skip
    unavailable: dict[str, str] = {}
    llama_ver = None
    if MODELS[args.model]["llama"]:
        configs += ["llama.cpp", "llama.cpp-rpc"]
        if not os.access(args.llama_bench, os.X_OK):
            why = (
                f"no llama-bench at {args.llama_bench}; build it (see docs/BENCHMARKS.md) and pass "
                "--llama-bench"
            )
            unavailable["llama.cpp"] = unavailable["llama.cpp-rpc"] = why
        else:
            llama_ver = llama_version(args.llama_bench)
            if os.access(args.llama_bench_avx2, os.X_OK):
                configs.append("llama.cpp-avx2")
            if not os.access(args.rpc_server, os.X_OK):
                unavailable["llama.cpp-rpc"] = (
                    f"no rpc-server at {args.rpc_server}; build llama.cpp with -DGGML_RPC=ON and pass --rpc-server"
                )
    if args.only:
        wanted = args.only.split(",")
        configs = [c for c in configs if c in wanted]
    for key, why in unavailable.items():
        log.warning("%s unavailable: %s", key, why)

    tmp = None
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench-decode-")
        workdir = Path(tmp.name)
    else:
        workdir = args.workdir
        workdir.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    try:
        gguf, shard_dir = prepare(args.model, args.layers, workdir)
        swarm = partial(
            run_swarm,
            shard_dir,
            args.nodes,
            args.node_threads,
            args.prompt_tokens,
            args.decode_tokens,
            workdir,
            args.threads,
        )
        runners: dict[str, Callable[[], Run]] = {
            **{
                f"in-process{sfx}": partial(
                    run_inprocess, gguf, args.prompt_tokens, args.decode_tokens, args.threads, numerics
                )
                for sfx, numerics in (("", "native"), ("-exact", "exact"))
            },
            "swarm": partial(swarm, "native", args.audit),
            "swarm-exact": partial(swarm, "exact"),
            "swarm-noaudit": partial(swarm, "native", 0.0),
            "swarm-grpc": partial(swarm, "native", 0.0, stream=False),
            "swarm-floor": partial(swarm, "native", 0.0, ZERO_NODE),
            "swarm-layers": partial(swarm, "native", 0.0, by_layer=True),
            "llama.cpp": partial(
                llama_bench, args.llama_bench, gguf, args.threads, args.prompt_tokens, args.decode_tokens
            ),
            "llama.cpp-avx2": partial(
                llama_bench, args.llama_bench_avx2, gguf, args.threads, args.prompt_tokens, args.decode_tokens
            ),
            "llama.cpp-rpc": partial(
                run_llama_rpc,
                args.llama_bench,
                args.rpc_server,
                gguf,
                args.threads,
                args.rpc_servers,
                args.rpc_threads,
                args.prompt_tokens,
                args.decode_tokens,
                workdir,
            ),
        }
        # Our engine runs in a child process per pass: a cold start each time (and the exact numerics' float32
        # working copies, 10-13 GB, are surely given back before the next configuration starts).
        ours_keys = ("in-process", "swarm", "swarm-noaudit", "swarm-grpc", "swarm-floor", "swarm-layers",
                     "in-process-exact", "swarm-exact")  # fmt: skip
        for key in ours_keys:
            runners[key] = _in_child(runners[key], experts_remote=key.startswith("swarm"))
        active = [c for c in configs if c not in unavailable]
        results: dict[str, list[Run]] = {c: [] for c in active}
        for rep in range(args.reps):
            for key in rep_order(active, rep):
                t0 = time.perf_counter()
                try:
                    run = runners[key]()
                except RuntimeError as e:
                    log.error("%s failed: %s", key, e)
                    unavailable[key] = f"it failed: `{str(e).splitlines()[-1]}`"
                    active.remove(key)
                    results.pop(key, None)
                    continue
                results[key].append(run)
                log.info(
                    "rep %d %-13s prefill %7.1f tok/s  decode %6.2f tok/s  (%.0f s)",
                    rep + 1,
                    key,
                    run.prefill_tps,
                    run.decode_tps,
                    time.perf_counter() - t0,
                )
        for sfx, label in (("", "native"), ("-exact", "exact")):
            keys = (
                "in-process" + sfx,
                "swarm" + sfx,
                *(("swarm-noaudit", "swarm-grpc", "swarm-layers") if not sfx else ()),
            )
            ours = [r.tokens for k in keys for r in results.get(k, [])]
            if ours:
                same = all(t == ours[0] for t in ours)
                notes.append(
                    f"Greedy tokens ({label} numerics): swarm and in-process runs gave "
                    f"{'the same' if same else 'DIFFERENT'} {args.decode_tokens} tokens in every repetition."
                )
    finally:
        if tmp is not None:
            tmp.cleanup()
    text = render(args, cmd, results, unavailable, notes, llama_ver)
    print(text)
    if not args.no_write:
        write_section(text, f"decode-{args.model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
