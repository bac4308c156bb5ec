"""Coordinator subcommands: `swarm run`, `swarm logits`, `swarm perplexity`, `swarm demo`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from swarm.node.cli import add_key_argument, swarm_key
from swarm.node.openmp import set_wait_policy
from swarm.sharding.errors import UserError


def add_discovery_args(g: Any, wait: float, wait_help: str) -> None:
    """How nodes are found: mDNS (on which interfaces, for how long), static peers, the swarm key."""
    g.add_argument(
        "--peer", action="append", default=[], metavar="HOST:PORT", help="a node to use (repeatable)"
    )
    g.add_argument("--no-mdns", action="store_true", help="do not look for nodes by mDNS; use --peer only")
    g.add_argument(
        "--mdns-interface",
        action="append",
        default=None,
        metavar="ADDR",
        help="interface address to browse mDNS on (repeatable; default all)",
    )
    g.add_argument("--wait", type=float, default=wait, help=wait_help)
    add_key_argument(g)


def add_swarm_args(p: argparse.ArgumentParser) -> None:
    """Where the experts are computed: here (--local) or on nodes found by mDNS / given as peers."""
    g = p.add_argument_group("swarm")
    g.add_argument("--local", action="store_true", help="compute the experts in this process (no nodes)")
    add_discovery_args(g, 3.0, "seconds to wait for nodes to cover every expert")
    g.add_argument(
        "--wire", choices=["f32", "f16", "bf16"], default="f32", help="precision of rows on the wire"
    )
    g.add_argument("--timeout", type=float, default=30.0, help="seconds before a node call fails over")
    g.add_argument(
        "--audit",
        type=float,
        default=None,
        metavar="RATE",
        help="share of node answers recomputed here to check them, 0-1 (default 0.05); a node caught is "
        "banned and the work its answers touched is done again. Nodes are also probed before first use. "
        "Needs the model's expert slabs here (a GGUF, or a shard directory with its experts/); 0: trust",
    )
    g.add_argument(
        "--degraded",
        action="store_true",
        help="when no live node holds an expert, leave it out and renormalize the weights of the experts that "
        "answered (hivemind's k_min) instead of waiting for a holder: answers go on, but differ from the "
        "model's (the run's report counts the pairs left out). Off by default",
    )
    g.add_argument(
        "--device", default=None, help="torch device for the dense path (default: cuda if present)"
    )
    add_numerics_args(g)


def add_numerics_args(g: Any) -> None:
    """How weights are multiplied (--exact) and on how many threads."""
    g.add_argument(
        "--exact",
        action="store_true",
        help="float32 math on exactly dequantized weights (the oracle that matches transformers; slower "
        "and float32-sized); default: every weight in its file type with ggml's kernels, as llama.cpp does",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        help="compute threads of this process, shared by torch and ggml (default: one per core)",
    )


def apply_threads(threads: int | None) -> None:
    if threads is None:
        return
    if threads < 1:
        raise UserError("--threads must be at least 1")
    from swarm.node.kernels import set_threads

    set_threads(threads)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    g.add_argument("--seed", type=int, default=None)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run", help="answer a prompt in the terminal", description="Answer a prompt, streaming."
    )
    p.add_argument("model", metavar="DIR_OR_GGUF", help="shard directory or .gguf model")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument(
        "--stats",
        default=None,
        metavar="FILE",
        help="add how often the router picked each (layer, expert) to this JSON file (for `swarm plan --stats`)",
    )
    add_sampling_args(p)
    add_swarm_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("logits", help="write logits at every position to a .npy file")
    p.add_argument("model", metavar="DIR_OR_GGUF")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", help="comma-separated token ids")
    src.add_argument("--prompt", help="text to tokenize")
    p.add_argument("-o", "--output", required=True, help="output .npy ([T, V] float32)")
    add_swarm_args(p)
    p.set_defaults(func=cmd_logits)

    p = sub.add_parser("perplexity", help="perplexity of a text file")
    p.add_argument("model", metavar="DIR_OR_GGUF")
    p.add_argument("text", metavar="FILE.txt")
    p.add_argument("--ctx", type=int, default=512, help="tokens per evaluation window")
    p.add_argument("--max-chunks", type=int, default=0, help="stop after this many windows (0 = all)")
    add_swarm_args(p)
    p.set_defaults(func=cmd_perplexity)

    p = sub.add_parser(
        "demo",
        help="a whole swarm on this machine: synthesize, shard, start nodes, answer, compare",
        description=(
            "Synthesizes a small random-weight model with a real layout, shards it, starts node processes on "
            "loopback (expert ranges plus one replica), finds them by mDNS, answers a prompt through the swarm "
            "and in process, and checks that the two agree bit for bit; then kills one node and answers again. "
            "No downloads, no other machines."
        ),
    )
    p.add_argument(
        "--like", default="qwen35moe-tiny", help="synth preset of the model (default qwen35moe-tiny)"
    )
    p.add_argument("--experts-type", default="Q4_K", help="quant type of the experts")
    p.add_argument(
        "--nodes", type=int, default=3, help="node processes holding expert ranges (one replica is added)"
    )
    p.add_argument("--prompt", default="Explain what a mixture of experts is.")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument(
        "--workdir", default=None, help="keep the model and logs here (default: a temp dir, removed)"
    )
    add_numerics_args(p)
    p.set_defaults(func=cmd_demo)


def _status(text: str) -> None:
    """A line about what is happening, for a person watching the terminal (not for pipes and logs)."""
    if sys.stderr.isatty():
        print(text, file=sys.stderr, flush=True)


def _audit_rate(rate: float) -> float:
    if not 0.0 <= rate <= 1.0:
        raise UserError(
            f"--audit {rate}: give a share between 0 (trust every node) and 1 (check every answer)"
        )
    return rate


def _open(args: argparse.Namespace) -> Any:
    from swarm.coordinator.audit import DEFAULT_RATE
    from swarm.coordinator.engine import open_engine
    from swarm.coordinator.swarm import SwarmExperts

    where = "experts in this process" if args.local else "looking for nodes"
    _status(f"swarm {args.command}: opening {args.model} ({where}) ...")
    apply_threads(args.threads)
    key = swarm_key(args, args.command)
    engine = open_engine(
        args.model,
        local=args.local,
        peers=tuple(args.peer),
        mdns=not args.no_mdns,
        mdns_interfaces=args.mdns_interface,
        wait=args.wait,
        wire=args.wire,
        device=args.device,
        key=key,
        timeout=args.timeout,
        audit=DEFAULT_RATE if args.audit is None else _audit_rate(args.audit),
        degraded=args.degraded,
        progress=True,
        numerics="exact" if args.exact else "native",
    )
    if isinstance(engine.experts, SwarmExperts):
        n = len(engine.experts.clients)
        nodes = "1 node holds" if n == 1 else f"{n} nodes hold"
        _status(f"swarm {args.command}: {nodes} every expert; model on {engine.device}")
        if key is None:
            print(
                f"swarm {args.command}: warning: no swarm key: these are OPEN nodes (started without a key), "
                "which anyone who reaches them can use; see `swarm keygen`",
                file=sys.stderr,
            )
    return engine


def _sampling(args: argparse.Namespace, stop_ids: frozenset[int]) -> Any:
    from swarm.coordinator.generate import SamplingParams

    if args.max_tokens < 1:
        raise UserError("--max-tokens must be at least 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        raise UserError("need --temperature >= 0, 0 < --top-p <= 1, --top-k >= 0")
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop_ids=stop_ids,
    )


def prompt_ids(engine: Any, prompt: str, chat: bool, system: str | None = None) -> list[int]:
    from swarm.coordinator.chat import ChatTemplate

    if not chat:
        return engine.tokenizer.encode(prompt, parse_special=False)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    text = ChatTemplate.from_tokenizer(engine.tokenizer).render(messages, add_generation_prompt=True)
    return engine.tokenizer.encode(text, parse_special=True)


def stream_answer(engine: Any, ids: list[int], params: Any, out: Any = None) -> tuple[list[int], Any]:
    """Generate, printing text as it comes (to stdout by default); (generated ids, GenerationStats)."""
    from swarm.coordinator.generate import GenerationStats, generate

    out = out or sys.stdout
    stats = GenerationStats()
    detok = engine.tokenizer.stream(skip_control=True)
    generated = []
    for token in generate(engine.model, ids, params, engine.device, stats, checker=engine.checker):
        generated.append(token)
        if token not in params.stop_ids:
            out.write(detok.push(token))
            out.flush()
    out.write(detok.flush() + "\n")
    out.flush()
    return generated, stats


def report(engine: Any, stats: Any, err: Any = None) -> None:
    """Speed and where the experts went, to stderr by default."""
    from swarm.coordinator.swarm import SwarmExperts

    err = err or sys.stderr
    print(
        f"prefill: {stats.prompt_tokens} tokens, {stats.prefill_tps:.1f} tok/s | "
        f"decode: {stats.generated_tokens} tokens, {stats.decode_tps:.1f} tok/s | finish: {stats.finish_reason}",
        file=err,
    )
    if isinstance(engine.experts, SwarmExperts):
        for address in sorted(engine.experts.calls_per_node):
            print(
                f"  node {address}: {engine.experts.calls_per_node[address]} calls, "
                f"{engine.experts.rows_per_node[address]} rows",
                file=err,
            )
        if engine.experts.failovers:
            print(f"  failovers: {engine.experts.failovers}", file=err)
        if engine.experts.dropped_pairs:
            print(
                f"  DEGRADED: {engine.experts.dropped_pairs} (token, expert) pairs had no live holder and were "
                "left out; this answer is not the model's exact one",
                file=err,
            )
        auditor = engine.experts.auditor
        if auditor is not None:
            r = auditor.report
            print(f"  audits: {r.audits} answers and {r.probes} probe calls checked", file=err)
            for address, why in sorted(r.banned.items()):
                print(f"  BANNED {address}: {why}", file=err)
            if stats.extra.get("redone_passes"):
                print(
                    f"  passes done again without the banned nodes: {stats.extra['redone_passes']}", file=err
                )
        if engine.experts.hedges:
            print(
                f"  hedged calls: {engine.experts.hedges} (a replica answered first {engine.experts.hedge_wins} times)",
                file=err,
            )
    else:
        print("  experts computed in process (--local)", file=err)


def cmd_run(args: argparse.Namespace) -> int:
    set_wait_policy(experts_remote=not args.local)
    engine = _open(args)
    try:
        stats_of = None
        if args.stats:
            from swarm.coordinator.experts import RoutingStats

            stats_of = RoutingStats(engine.experts)
            engine.model.set_experts(stats_of)
        params = _sampling(args, engine.tokenizer.eos_ids)
        ids = prompt_ids(engine, args.prompt, args.chat, args.system)
        if not ids:
            raise UserError("the prompt is empty after tokenization; give some text")
        _, stats = stream_answer(engine, ids, params)
        report(engine, stats)
        if stats_of is not None:
            stats_of.save(args.stats, engine.fingerprint)
            print(f"routing statistics of {stats_of.tokens} tokens added to {args.stats}", file=sys.stderr)
    finally:
        engine.close()
    return 0


def _parse_tokens(text: str, vocab: int) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise UserError(f"bad --tokens {text!r}; give comma-separated ids like 1,2,3") from None
    bad = [t for t in ids if not 0 <= t < vocab]
    if not ids or bad:
        raise UserError(f"--tokens needs ids in 0..{vocab - 1}" + (f"; got {bad[:5]}" if bad else ""))
    return ids


def cmd_logits(args: argparse.Namespace) -> int:
    set_wait_policy(experts_remote=not args.local)
    import numpy as np

    from swarm.coordinator.generate import checked_logits

    engine = _open(args)
    try:
        vocab = engine.model.token_embd.num_embeddings
        ids = (
            _parse_tokens(args.tokens, vocab)
            if args.tokens is not None
            else engine.tokenizer.encode(args.prompt, parse_special=False)
        )
        logits = checked_logits(engine.model, ids, engine.model.new_state(), engine.device, engine.checker)
        out = logits.float().cpu().numpy()
        try:
            with open(args.output, "wb") as f:
                np.save(f, out)
        except OSError as e:
            raise UserError(f"cannot write {args.output}: {e.strerror}") from None
        print(f"wrote {args.output}: logits [{out.shape[0]}, {out.shape[1]}] float32 for {len(ids)} tokens")
    finally:
        engine.close()
    return 0


def cmd_perplexity(args: argparse.Namespace) -> int:
    set_wait_policy(experts_remote=not args.local)
    import math
    import time

    import torch

    from swarm.coordinator.generate import checked_logits

    try:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {args.text} as UTF-8 text: {e}") from None
    if args.ctx < 2:
        raise UserError("--ctx must be at least 2")
    engine = _open(args)
    try:
        ids = engine.tokenizer.encode(text, parse_special=False)
        if len(ids) < 2:
            raise UserError(f"{args.text}: too short to score (needs at least 2 tokens)")
        nll, count, chunks = 0.0, 0, 0
        t0 = time.perf_counter()
        for start in range(0, len(ids) - 1, args.ctx):
            window = ids[start : start + args.ctx]
            if len(window) < 2:
                break
            state = engine.model.new_state()
            logits = checked_logits(engine.model, window, state, engine.device, engine.checker).double()
            logp = torch.log_softmax(logits[:-1], dim=-1)
            target = torch.tensor(window[1:], device=logp.device)
            nll -= float(logp.gather(1, target[:, None]).sum())
            count += len(window) - 1
            chunks += 1
            print(f"[{chunks}] running perplexity {math.exp(nll / count):.4f}", file=sys.stderr)
            if args.max_chunks and chunks >= args.max_chunks:
                break
        seconds = time.perf_counter() - t0
        print(
            f"perplexity: {math.exp(nll / count):.4f} over {count} tokens ({chunks} windows of <= {args.ctx})"
        )
        print(f"{count / seconds:.1f} tokens/s", file=sys.stderr)
    finally:
        engine.close()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    set_wait_policy(experts_remote=True)  # its nodes share this machine
    from swarm.coordinator.demo import run_demo

    apply_threads(args.threads)
    return run_demo(
        like=args.like,
        experts_type=args.experts_type,
        n_nodes=args.nodes,
        prompt=args.prompt,
        max_tokens=args.max_tokens,
        workdir=args.workdir,
        numerics="exact" if args.exact else "native",
    )
