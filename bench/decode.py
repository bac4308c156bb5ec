"""Decode and prefill tokens/s: in-process experts vs loopback swarm nodes (vs llama.cpp, vs llama.cpp RPC).

Two models, both `swarm synth` with the real layer shape and 4 layers, Q4_K experts, Q8_0 dense (like the
real UD files):
  --model qwen3moe   qwen3-30b-a3b preset (D 2048, E 128, K 8, F 768): in-process vs 4 loopback nodes
  --model qwen35moe  qwen3.6-35b-a3b preset (D 2048, E 256, K 8, F 512, shared 512, hybrid attention):
                     in-process, 4 loopback nodes, llama.cpp (llama-bench, same GGUF, same threads) and
                     llama.cpp RPC over 4 local rpc-servers

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
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch
from _decode_report import render, section_name
from _doc import command, publish
from _engines import ZERO_NODE, in_child, run_inprocess, run_swarm
from _llama import AVX2_BUILD, DEFAULT_BUILD, llama_bench, llama_version, run_llama_rpc
from _models import MODELS, prepare
from _timing import Run

from swarm.coordinator.config import DEFAULT_AUDIT_RATE

log = logging.getLogger("bench.decode")

OUTER = "decode"  # this script's section of docs/BENCHMARKS.md; one inner section per model
# Our engine's configurations: each pass in a child process of its own (see runners).
OURS = ("in-process", "swarm", "swarm-noaudit", "swarm-grpc", "swarm-floor", "swarm-layers",
        "in-process-exact", "swarm-exact")  # fmt: skip

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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="qwen3moe")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dense-type", default="Q8_0", help="the dense tensors' type (synth --dense-type; Q4_K_M: "
                   "the mixture llama.cpp's quantizer makes)")
    p.add_argument("--experts", type=int, default=None, help="experts a layer (default: the preset's)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the synth's small one)")
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
        help=f"share of node answers the audited swarm row checks (default: swarm's own, {DEFAULT_AUDIT_RATE})",
    )
    p.add_argument("--workdir", type=Path, default=None, help="keep/reuse the synthesized model here")
    p.add_argument(
        "--no-write", action="store_true", help="print the section instead of writing docs/BENCHMARKS.md"
    )
    args = p.parse_args(argv)
    if args.audit is not None and not 0.0 <= args.audit <= 1.0:
        p.error(f"--audit {args.audit}: give a share between 0 and 1")
    return args


def configurations(args: argparse.Namespace) -> tuple[list[str], dict[str, str], str | None]:
    """The configurations to run, those that cannot run (and why), and the llama.cpp version where it runs."""
    configs = list(OURS)
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
    return configs, unavailable, llama_ver


def runners(
    args: argparse.Namespace, gguf: Path, shard_dir: Path, workdir: Path
) -> dict[str, Callable[[], Run]]:
    """One pass of each configuration, by name."""
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
    out: dict[str, Callable[[], Run]] = {
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
    for key in OURS:
        out[key] = in_child(out[key], experts_remote=key.startswith("swarm"))
    return out


def run_reps(
    args: argparse.Namespace,
    passes: dict[str, Callable[[], Run]],
    active: list[str],
    unavailable: dict[str, str],
) -> dict[str, list[Run]]:
    """Every repetition runs every active configuration once; one that fails is left out from then on (why:
    in `unavailable`)."""
    results: dict[str, list[Run]] = {c: [] for c in active}
    for rep in range(args.reps):
        for key in rep_order(active, rep):
            t0 = time.perf_counter()
            try:
                run = passes[key]()
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
    return results


def token_notes(args: argparse.Namespace, results: dict[str, list[Run]]) -> list[str]:
    """Whether our configurations of each numerics gave the same greedy tokens."""
    notes: list[str] = []
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
    return notes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("bench").setLevel(logging.INFO)  # this script's and its modules' progress
    torch.set_num_threads(args.threads)
    cmd = command("decode.py", argv)
    configs, unavailable, llama_ver = configurations(args)
    for key, why in unavailable.items():
        log.warning("%s unavailable: %s", key, why)

    tmp = None
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench-decode-")
        workdir = Path(tmp.name)
    else:
        workdir = args.workdir
        workdir.mkdir(parents=True, exist_ok=True)
    try:
        gguf, shard_dir = prepare(args.model, args.layers, workdir, args.experts, args.vocab, args.dense_type)
        active = [c for c in configs if c not in unavailable]
        results = run_reps(args, runners(args, gguf, shard_dir, workdir), active, unavailable)
        notes = token_notes(args, results)
    finally:
        if tmp is not None:
            tmp.cleanup()
    text = render(args, cmd, results, unavailable, notes, llama_ver)
    publish(section_name(args), text, not args.no_write, within=OUTER)
    return 0


if __name__ == "__main__":
    sys.exit(main())
