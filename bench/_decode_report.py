"""The `bench:decode-<model>` section bench/decode.py writes: the configurations side by side, the ratios run
by run against llama.cpp, and where one decode step goes."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from _models import MODELS
from _timing import Run

from swarm.sharding.synth_spec import preset


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


def row_names(args: argparse.Namespace) -> dict[str, str]:
    """Each configuration's label in the table, in the table's order."""
    return {
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


def section_name(args: argparse.Namespace) -> str:
    """The model's inner section: decode-<model>, with the depth and dense type where they are not the default."""
    shape = (f"-{args.layers}l" if args.layers != 4 else "") + (
        f"-{args.dense_type.lower().replace('_', '')}" if args.dense_type != "Q8_0" else "")
    return f"decode-{args.model}{shape}"


def _header(args: argparse.Namespace, cmd: str) -> list[str]:
    model = args.model
    m = MODELS[model]
    spec = preset(m["preset"], n_layers=args.layers, experts_type="Q4_K", dense_type=args.dense_type,
                  n_expert=args.experts, n_vocab=args.vocab)  # fmt: skip
    return [
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


def _table(names: dict[str, str], results: dict[str, list[Run]], unavailable: dict[str, str]) -> list[str]:
    base = results.get("in-process", [])
    lines = []
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
    return lines


def _against_llama(names: dict[str, str], results: dict[str, list[Run]]) -> list[str]:
    pairs = side_by_side(results)
    if not pairs:
        return []
    lines = [
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
    return lines


def _llama_build(args: argparse.Namespace, results: dict[str, list[Run]], llama_ver: str) -> list[str]:
    """Which llama.cpp ran and how to build it."""
    lines = [
        "",
        f"llama.cpp: {llama_ver}, built from the source vendored in the llama-cpp-python 0.3.36 sdist "
        "(CPU backend, the x86 levels this CPU has, OpenMP, llamafile tinyBLAS and weight repacking on, its defaults); "
        "llama-bench's pp test feeds "
        f"{args.prompt_tokens} tokens, its tg test decodes {args.decode_tokens} tokens from an empty context "
        "(ours decodes after the prompt, so it attends over 64 more positions; at 4 layers with 1 "
        "full-attention layer that is a small part of a step). RPC: `llama-bench --rpc ... -ngl 99` puts "
        "the layers on the rpc-servers (llama.cpp splits by layer, not by expert); "
        f"each rpc-server runs `-t {args.rpc_threads}`." + (f" {args.llama_note}" if args.llama_note else ""),
        "",
        "Building it (outside the repo; nothing of it is committed): `deploy/build-llama-cpp.sh`, which downloads "
        "the sdist, configures with the RPC backend and the server and the x86 levels the CPU has, and builds the "
        "tools the benches run.",
    ]
    if "llama.cpp-avx2" in results:
        lines += [
            "",
            "The AVX2-baseline row is the same source built for the x86 level swarm's ggml is built for "
            "(no AVX-512 or VNNI even where the CPU has them; see the README's install): "
            "`LLAMA_AVX512=0 deploy/build-llama-cpp.sh /work/llamacpp-avx2`.",
        ]
    return lines


def _swarm_steps(swarm: Sequence[Run]) -> list[str]:
    """Where one decode step goes in the swarm."""
    w = med_bd(swarm, "swarm_wait")
    return [
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


def _floor(floor: Sequence[Run]) -> list[str]:
    return [
        "",
        f"Through nodes that answer zeros (bench/zero_node.py: the real nodes, gRPC and coordinator, with no "
        f"expert compute; its tokens are not the model's and are not compared), a decode step takes "
        f"{med_bd(floor, 'step'):.1f} ms (medians): dense path {med_bd(floor, 'dense'):.1f}, dispatch "
        f"{med_bd(floor, 'start'):.1f}, blocked wait {med_bd(floor, 'wait'):.1f}, the nodes' busy time "
        f"{med_bd(floor, 'node_busy_sum'):.1f} in all. That is what the transport and the coordinator cost "
        "before any expert is multiplied.",
    ]


def _by_layer(args: argparse.Namespace, layers: Sequence[Run]) -> list[str]:
    return [
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


def _in_process(base: Sequence[Run]) -> list[str]:
    return [
        "",
        "In-process, for comparison (ms per decode step, medians): "
        f"whole step {med_bd(base, 'step'):.1f}, the MoE layers' graphs (ffn.moe_layer: routed experts, "
        f"shared expert and the sum) {med_bd(base, 'start'):.1f}, the rest (attention / DeltaNet, norms, "
        f"routers, output head) {med_bd(base, 'dense'):.1f}.",
    ]


def render(
    args: argparse.Namespace,
    cmd: str,
    results: dict[str, list[Run]],
    unavailable: dict[str, str],
    notes: list[str],
    llama_ver: str | None,
) -> str:
    section = section_name(args)
    names = row_names(args)
    lines = [f"<!-- bench:{section} -->", *_header(args, cmd), *_table(names, results, unavailable)]
    lines += _against_llama(names, results)
    for key, why in unavailable.items():
        lines += ["", f"**{names[key]}: unavailable.** {why}"]
    if llama_ver:
        lines += _llama_build(args, results, llama_ver)
    if swarm := results.get("swarm"):
        lines += _swarm_steps(swarm)
    if floor := results.get("swarm-floor"):
        lines += _floor(floor)
    if layers := results.get("swarm-layers"):
        lines += _by_layer(args, layers)
    if base := results.get("in-process", []):
        lines += _in_process(base)
    lines += [*(["", *notes] if notes else []), f"<!-- /bench:{section} -->"]
    return "\n".join(lines)
