"""What the answer checks guarantee and what they cost.

rely: two liars beside an honest holder of every slab, default settings: a node whose slab files rot after
it started, and a node serving a whole GGUF whose layer-0 expert weights differ under an identical header
(tests/test_trust.py's rigs, on the qwen35moe Q4_K_M fixture). Each run is a fresh coordinator reading a
12-token prompt's logits (`swarm logits`); a run counts when the logits equal in-process bit for bit, the
liar is banned and the honest node is not. Quiet, and beside three busy processes on the machine's cores.
Then `--verify pair` decoding 64 tokens with the files rotting after the prompt: the text must be the
in-process one.

detect: a node that falsifies a share q of its answers (bench/liar_node.py) beside an honest replica,
sampled exact audits (--verify sample --audit 0.05; the default --verify project checks every answer, and
tests/test_projection_swarm.py catches each liar at its first): 64 greedy tokens per run; how often it is caught, the share that goes
unseen, and that share as the model predicts it: (1 - q)^(4 + P) (its 4 admission probes, and every
prompt answer checked) x
(1 - r q)^C (r = 0.05 of its C decode answers audited) x (1 - q)^S (its latest answer checked at each of
the S forced settles, one per 8 decode passes), with P and C counted in the run.

cost: the Qwen3.6-35B-A3B layer shape (--layers of it, Q4_K experts, random weights), 4 loopback nodes (two
replicas of each half of the experts), a fresh coordinator per run (the repack of cold experts for the
exact checks included; the projections' vectors made at its start, timed apart): prompt and decode tok/s with
--audit 0, the default (--verify project), the exact audits (--verify sample), --verify pair and --verify
all (--settings), in rotating order after a warm-up run, medians of the repetitions and ratios to --audit 0
run by run (--split COORD/NODES, e.g. 0/1: the coordinator on its own cores, the nodes in a device on the
others, as on a coordinator device of its own); the vectors' resident bytes; the bytes an answer and its inner products take per decode call on the packed wire
(--wire q8: answers in byte planes) and on the default one.

bound: the projections' tolerance against honest answers of this build (bench/_trust_bound.py).

    python bench/trust.py --workdir /work/bench-models/decode [--runs 20] [--only rely,detect,cost,bound]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from _doc import command, machine, publish  # noqa: E402
from _loopback import LOOPBACK  # noqa: E402
from _models import prepare, prompt_tokens  # noqa: E402
from _rig import DeviceSpec, Rig  # noqa: E402
from _rig_cpus import _cpus as parse_cpus  # noqa: E402
from _timing import run_engine  # noqa: E402
from _trust_bound import bound, footprint  # noqa: E402
from test_trust import MODEL, ROT_LAYER, other_weights, rot  # noqa: E402

from swarm.compute.ggml import set_threads  # noqa: E402
from swarm.coordinator.checks.audit import PROBE_SLABS  # noqa: E402
from swarm.coordinator.cli.spawn import LocalNode, start_nodes, stop_nodes  # noqa: E402
from swarm.coordinator.config import DEFAULT_AUDIT_RATE, EngineConfig, Verify, Wire  # noqa: E402
from swarm.coordinator.decode.one import (  # noqa: E402
    SamplingParams,
    checked_logits,
    forward_one,
    generate,
)
from swarm.coordinator.decode.passes import SETTLE_EVERY  # noqa: E402
from swarm.coordinator.engine import open_engine  # noqa: E402
from swarm.node.auth import KEY_ENV, SwarmKey, generate_key_text  # noqa: E402
from swarm.sharding.ranges import format_ranges  # noqa: E402
from swarm.sharding.shard import shard_model  # noqa: E402
from swarm.sharding.slabs import read_manifest  # noqa: E402

log = logging.getLogger("bench.trust")
KEY_TEXT = generate_key_text()
KEY = SwarmKey.from_text(KEY_TEXT)
LIAR = ROOT / "bench" / "liar_node.py"


class Busy:
    """Processes spinning on the machine's cores for as long as the block runs."""

    def __init__(self, n: int) -> None:
        self.n, self.procs = n, []  # type: ignore[var-annotated]

    def __enter__(self) -> Busy:
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def _engine(shard_dir: Path, nodes: list[LocalNode], seed: int | None, **kw: Any) -> Any:
    peers = tuple(n.address for n in nodes)
    return open_engine(shard_dir, EngineConfig(peers=peers, mdns=False, device="cpu", key=KEY, audit_seed=seed, **kw))


# --- rely --------------------------------------------------------------------------------------------------


def rely(work: Path, runs: int) -> str:
    honest_dir = work / "honest.swarm"
    shard_model(MODEL, honest_dir)
    local = open_engine(honest_dir, EngineConfig(local=True, device="cpu"))
    tokens = list(range(3, 15))
    expect = forward_one(local.model, tokens, local.model.new_state(), "cpu")
    text = list(generate(local.model, tokens, SamplingParams(max_tokens=64), "cpu"))
    local.close()
    lines = [
        "| liar | machine | runs with exact logits, the liar banned, the honest node not |",
        "|---|---|---:|",
    ]
    for kind in ("bit-rot", "other-weights"):
        for busy in (0, 3):
            ok = _rely_runs(work, honest_dir, kind, busy, runs, tokens, expect)
            where = "quiet" if not busy else f"{busy} busy processes"
            lines.append(f"| {kind} | {where} | {ok} of {runs} |")
            log.info("rely %s %s: %d of %d", kind, where, ok, runs)
    pair_ok, pair_runs = _pair_runs(work, honest_dir, max(1, runs // 4), tokens, text)
    lines.append(
        f"\n`--verify pair`, 64 greedy tokens, the liar's files rotting once the prompt is read (sampled "
        f"audits off, so only the pairs can catch it): {pair_ok} of {pair_runs} runs gave the in-process text "
        "with the liar banned."
    )
    return "\n".join(lines)


def _liar(work: Path, honest_dir: Path, kind: str, tag: str) -> tuple[Path, list[str]]:
    if kind == "bit-rot":
        src = work / f"liar-{tag}.swarm"
        subprocess.run(["rm", "-rf", str(src)], check=True)
        subprocess.run(["cp", "-r", str(honest_dir), str(src)], check=True)
        return src, ["--recheck", "0"]
    src = work / "liar.gguf"
    if not src.exists():
        other_weights(MODEL, src, 0)
    return src, []


def _rely_runs(
    work: Path, honest_dir: Path, kind: str, busy: int, runs: int, tokens: list[int], expect: torch.Tensor
) -> int:
    liar_src, args = _liar(work, honest_dir, kind, "rely")
    nodes = start_nodes([(honest_dir, []), (liar_src, args)], work / "nodes", env={KEY_ENV: KEY_TEXT})
    if kind == "bit-rot":
        rot(liar_src, ROT_LAYER)
    ok = 0
    try:
        with Busy(busy):
            for run in range(runs):
                swarm = _engine(honest_dir, nodes, seed=None)
                try:
                    got = checked_logits(swarm.model, tokens, swarm.model.new_state(), "cpu", swarm.checker)
                    banned = set(swarm.checker.report.banned)
                    good = torch.equal(got, expect) and banned == {nodes[1].address}
                    ok += good
                    if not good:
                        log.warning(
                            "run %d: banned %s, max diff %.3g", run, banned, (got - expect).abs().max()
                        )
                finally:
                    swarm.close()
    finally:
        stop_nodes(nodes)
    return ok


def _pair_runs(
    work: Path, honest_dir: Path, runs: int, tokens: list[int], text: list[int]
) -> tuple[int, int]:
    ok = 0
    for run in range(runs):
        liar_src, args = _liar(work, honest_dir, "bit-rot", "pair")
        nodes = start_nodes([(honest_dir, []), (liar_src, args)], work / "nodes", env={KEY_ENV: KEY_TEXT})
        swarm = _engine(honest_dir, nodes, seed=run, verify=Verify.TWINS, audit_rate=0.0)
        try:
            it = generate(swarm.model, tokens, SamplingParams(max_tokens=64), "cpu", checker=swarm.checker)
            got = [next(it)]
            rot(liar_src, ROT_LAYER)
            got += list(it)
            ok += got == text and set(swarm.checker.report.banned) == {nodes[1].address}
        finally:
            swarm.close()
            stop_nodes(nodes)
    return ok, runs


# --- detect ------------------------------------------------------------------------------------------------


def detect(work: Path, runs: int, shares: list[float]) -> str:
    honest_dir = work / "honest.swarm"
    if not (honest_dir / "manifest.json").exists():
        shard_model(MODEL, honest_dir)
    local = open_engine(honest_dir, EngineConfig(local=True, device="cpu"))
    tokens = list(range(3, 15))
    text = list(generate(local.model, tokens, SamplingParams(max_tokens=64), "cpu"))
    local.close()
    lines = [
        "| q (share falsified) | runs | caught | unseen after 64 tokens | predicted unseen | released tokens "
        "before the ban (median) | text = in-process |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for q in shares:
        caught = exact = 0
        predicted: list[float] = []
        when: list[int] = []
        honest = start_nodes([(honest_dir, [])], work / "nodes", env={KEY_ENV: KEY_TEXT})
        liar = start_nodes(
            [(honest_dir, [])], work / "nodes", env={KEY_ENV: KEY_TEXT}, prefix="liar",
            program=(str(LIAR), str(q)),
        )  # fmt: skip
        nodes = honest + liar
        try:
            for _run in range(runs):  # a fresh coordinator each run: a ban lasts one run
                swarm = _engine(honest_dir, nodes, seed=None, verify=Verify.SAMPLE)
                try:
                    it = generate(
                        swarm.model, tokens, SamplingParams(max_tokens=64), "cpu", checker=swarm.checker
                    )
                    got: list[int] = []
                    prompt_calls = None
                    seen_at = None
                    for tok in it:
                        got.append(tok)
                        if prompt_calls is None:
                            prompt_calls = swarm.experts.calls_per_node[liar[0].address]
                        if seen_at is None and liar[0].address in swarm.checker.report.banned:
                            seen_at = len(got)
                    calls = swarm.experts.calls_per_node[liar[0].address]
                    banned = liar[0].address in swarm.checker.report.banned
                finally:
                    swarm.close()
                caught += banned
                exact += got == text
                if banned:
                    when.append(seen_at if seen_at is not None else 0)
                # the model: its answers up to the first token (the prompt: each checked), then the decode ones
                p_calls = prompt_calls or 0
                d_calls = max(0, calls - p_calls)
                settles = 63 // SETTLE_EVERY + 1
                predicted.append(
                    (1 - q) ** (PROBE_SLABS + p_calls)
                    * (1 - DEFAULT_AUDIT_RATE * q) ** d_calls
                    * (1 - q) ** settles
                )
        finally:
            stop_nodes(nodes)
        med_when = f"{statistics.median(when):.0f}" if when else "-"
        lines.append(
            f"| {q:g} | {runs} | {caught} | {(runs - caught) / runs:.2f} | {statistics.mean(predicted):.2f} | "
            f"{med_when} | {exact} of {runs} |"
        )
        log.info("detect q=%g: caught %d of %d", q, caught, runs)
    return "\n".join(lines)


# --- cost --------------------------------------------------------------------------------------------------

SETTINGS: dict[str, tuple[str, dict[str, Any]]] = {
    "trust": ("trust (--audit 0)", {"audit_rate": 0.0}),
    "project": ("default (--verify project: every answer projected)", {}),
    "sample": ("exact audits (--verify sample: 5 % of decode, every prompt answer on one row an expert)",
               {"verify": Verify.SAMPLE}),  # fmt: skip
    "pair": ("--verify pair", {"verify": Verify.TWINS}),
    "all": ("--verify all", {"verify": Verify.ALL}),
}


def _open(shard_dir: Path, nodes: list[LocalNode], kw: dict[str, Any], made: dict[str, float]) -> Any:
    """A fresh coordinator; the projections' vectors made now, as its start (timed into `made`)."""
    engine = _engine(shard_dir, nodes, seed=None, **kw)
    p = getattr(engine.checker, "projections", None)
    if p is not None:
        t0 = time.perf_counter()
        p.prepare()
        made["start s"] = time.perf_counter() - t0
        made["bytes"] = p.nbytes
    return engine


def _wire_bytes(shard_dir: Path, nodes: list[LocalNode], n_prompt: int, n_decode: int, wire: Wire) -> str:
    """Bytes an answer and its inner products take per decode call (the prompt's calls left out)."""
    engine = _engine(shard_dir, nodes, seed=None, wire=wire)
    try:
        it = generate(engine.model, prompt_tokens(engine, n_prompt), SamplingParams(max_tokens=n_decode), "cpu",
                      checker=engine.checker)  # fmt: skip
        next(it)
        e = engine.experts
        a0, i0, c0 = (sum(c.values()) for c in (e.answer_bytes_per_node, e.inner_bytes_per_node, e.calls_per_node))
        list(it)
        a1, i1, c1 = (sum(c.values()) for c in (e.answer_bytes_per_node, e.inner_bytes_per_node, e.calls_per_node))
    finally:
        engine.close()
    calls = max(1, c1 - c0)
    ans, inner = (a1 - a0) / calls, (i1 - i0) / calls
    return f"--wire {wire.value}: {ans:,.0f} B of answer and {inner:,.0f} B of inner products a decode call (+{inner / ans:.0%})"


def cost(workdir: Path, reps: int, n_prompt: int, n_decode: int, threads: int, layers: int = 4,
         settings: tuple[str, ...] = tuple(SETTINGS), experts: int | None = None,
         vocab: int | None = None, split: str | None = None) -> str:  # fmt: skip
    """`split` ("COORD/NODES", cpusets like "0/1"): the coordinator (this process) on the first cores and the
    nodes in a device of the rig (bench/_rig.py) on the others, so that neither takes the other's CPU, as on
    a coordinator device of its own; None: every process on every core."""
    set_threads(threads)
    _, shard_dir = prepare("qwen35moe", layers, workdir, experts, vocab)
    n_expert = read_manifest(shard_dir).n_expert
    halves = [format_ranges(range(0, n_expert // 2)), format_ranges(range(n_expert // 2, n_expert))]
    specs = [(shard_dir, ["--host", LOOPBACK, "--experts", halves[i % 2], "--threads", "1", "--no-verify"])
             for i in range(4)]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as undo:
        nodes = start_nodes(specs, Path(tmp) / "nodes", timeout=300.0, env={KEY_ENV: KEY_TEXT})
        undo.callback(stop_nodes, nodes)
        if split is not None:
            _split(split, nodes, undo)
        runs: dict[str, list[Any]] = {k: [] for k in settings}
        made: dict[str, float] = {}
        names = list(settings)
        engine = _open(shard_dir, nodes, SETTINGS["trust"][1], {})
        try:  # a warm-up run, not counted: the nodes' first answers read their slabs from disk
            run_engine(engine, n_prompt, min(n_decode, 4))
        finally:
            engine.close()
        for rep in range(reps):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                engine = _open(shard_dir, nodes, SETTINGS[name][1], made)
                try:
                    r = run_engine(engine, n_prompt, n_decode)
                finally:
                    engine.close()
                runs[name].append(r)
                log.info("%s: prefill %.1f decode %.2f tok/s", name, r.prefill_tps, r.decode_tps)
        wires = [_wire_bytes(shard_dir, nodes, n_prompt, min(n_decode, 8), w) for w in (Wire.Q8, Wire.F32)]
    base = runs["trust"]
    lines = [
        f"| setting | prompt tok/s ({n_prompt}) | ratio | decode tok/s | ratio |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, rs in runs.items():
        pr = statistics.median(r.prefill_tps / b.prefill_tps for r, b in zip(rs, base, strict=True))
        dr = statistics.median(r.decode_tps / b.decode_tps for r, b in zip(rs, base, strict=True))
        lines.append(
            f"| {SETTINGS[name][0]} | {statistics.median(r.prefill_tps for r in rs):.1f} | {pr:.2f}x | "
            f"{statistics.median(r.decode_tps for r in rs):.2f} | {dr:.2f}x |"
        )
    measured = {f"vectors made at a coordinator's start ({layers} layers), s": made.get("start s", 0.0),
                "vectors resident after the runs, MiB": made.get("bytes", 0) / 2**20}  # fmt: skip
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {w}" for w in wires) + "\n\n" + footprint(measured)


def _split(split: str, nodes: list[LocalNode], undo: contextlib.ExitStack) -> None:
    """This process's threads (the coordinator's) on the cores before the slash, the nodes in a rig device on
    those after it; undone by `undo` (the nodes' device removed once they are stopped)."""
    mine, theirs = split.split("/")
    rig = Rig()

    def close() -> None:  # the nodes stopped first (the rig's close kills what its devices still run)
        stop_nodes(nodes)
        rig.close()

    undo.callback(close)
    device = rig.device(DeviceSpec("nodes", cpus=theirs))
    for n in nodes:
        for f in device.procs_files:
            f.write_text(str(n.process.pid))  # (cgroup.procs: every thread of the node moves)
    before = os.sched_getaffinity(0)
    cores = set(parse_cpus(mine))
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), cores)

    def restore() -> None:
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), before)

    undo.callback(restore)
    log.info("split: coordinator on cores %s, nodes on %s (%s)", mine, theirs, device.tag)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=20, help="runs of each rely and detect case")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each cost setting")
    ap.add_argument("--shares", default="1,0.1,0.01", help="the detect liar's shares of falsified answers")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="rely,detect,cost,bound")
    ap.add_argument("--layers", type=int, default=4, help="layers of the 35B-shaped model the cost runs on")
    ap.add_argument("--experts", type=int, default=None, help="experts a layer (default: the real 256)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the synth's small one)")
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"cost settings, of {', '.join(SETTINGS)}")
    ap.add_argument("--split", default=None, metavar="COORD/NODES",
                    help="cost: the coordinator on cores COORD, the nodes in a device on cores NODES (e.g. 0/1)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parts = set(args.only.split(","))
    args.workdir.mkdir(parents=True, exist_ok=True)
    work = args.workdir / "trust"
    work.mkdir(exist_ok=True)
    head = f"Command: `{command('trust.py', argv)}`  \nMachine: {machine()}."
    if "rely" in parts:
        title = "## Two liars beside an honest holder, default settings (`bench/trust.py`, rely)"
        publish("trust-rely", f"{title}\n\n{head}\n\n{rely(work, args.runs)}", not args.no_write)
    if "detect" in parts:
        shares = [float(s) for s in args.shares.split(",")]
        title = (
            "## How soon a node that falsifies a share of its answers is caught (`bench/trust.py`, detect)"
        )
        publish("trust-detect", f"{title}\n\n{head}\n\n{detect(work, args.runs, shares)}", not args.no_write)
    if "cost" in parts:
        settings = tuple(args.settings.split(","))
        text = cost(args.workdir, args.reps, args.prompt_tokens, args.decode_tokens, args.threads, args.layers,
                    settings, args.experts, args.vocab, args.split)  # fmt: skip
        depth = "" if args.layers == 4 else f", {args.layers} layers"
        apart = ", the coordinator's cores apart from the nodes'" if args.split else ""
        title = f"## What each --verify setting costs (`bench/trust.py`, cost{depth}{apart})"
        section = ("trust-cost" if args.layers == 4 else f"trust-cost-{args.layers}l") + ("-split" if args.split else "")
        publish(section, f"{title}\n\n{head}\n\n{text}", not args.no_write)
    if "bound" in parts:
        made = sorted(args.workdir.glob("qwen35moe-*q4k-q80.gguf"), key=lambda p: p.stat().st_size)  # (smallest)
        title = "## The projections' bound against honest answers (`bench/trust.py`, bound)"
        text = bound(made[0] if made else None)
        publish("trust-bound", f"{title}\n\n{head}\n\n{text}", not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
