"""Coordinator subcommands: `swarm run`, `swarm logits`, `swarm perplexity`, `swarm demo` (what they share with
`swarm serve` and `swarm status` is in flags.py and terminal.py)."""

from __future__ import annotations

import argparse
import sys

from swarm.compute.openmp import set_wait_policy
from swarm.coordinator.cli.flags import (
    add_numerics_args,
    add_picture_args,
    add_sampling_args,
    add_swarm_args,
    apply_threads,
    drafter_from_args,
    open_from_args,
    sampling_from_args,
)
from swarm.coordinator.cli.terminal import report, stream_answer
from swarm.coordinator.text.chat import prompt_ids
from swarm.proto.numerics import Numerics
from swarm.sharding.errors import UserError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run", help="answer a prompt in the terminal", description="Answer a prompt, streaming."
    )
    p.add_argument("model", metavar="DIR_OR_GGUF", help="shard directory or .gguf model")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="a picture (PNG, JPEG, WebP, GIF, BMP) for the prompt (repeatable): at each <__media__> of the "
        "prompt in order, else before its text; needs the model's mmproj (--mmproj)",
    )
    p.add_argument(
        "--stats",
        default=None,
        metavar="FILE",
        help="add how often the router picked each (layer, expert) to this JSON file (for `swarm plan --stats`)",
    )
    add_sampling_args(p)
    add_swarm_args(p)
    add_picture_args(p)
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


def cmd_run(args: argparse.Namespace) -> int:
    set_wait_policy(experts_remote=not args.local)
    engine = open_from_args(args)
    try:
        stats_of = None
        if args.stats:
            from swarm.coordinator.experts.backend import RoutingStats

            stats_of = RoutingStats(engine.experts)
            engine.model.set_experts(stats_of)
            if engine.mtp_head is not None:
                engine.mtp_head.set_experts(stats_of)
        params = sampling_from_args(args, engine.tokenizer.eos_ids)
        pictures = None
        if args.image:
            from swarm.coordinator.text.pictures import read_image_files, run_prompt

            prompt = run_prompt(engine, args.prompt, args.chat, args.system, read_image_files(args.image))
            ids, pictures = prompt.tokens, prompt.pictures
        else:
            ids = prompt_ids(engine.tokenizer, args.prompt, args.chat, args.system)
        if not ids:
            raise UserError("the prompt is empty after tokenization; give some text")
        drafter, mtp_drafter = drafter_from_args(args, engine)
        _, stats = stream_answer(engine, ids, params, drafter=drafter, mtp_drafter=mtp_drafter, pictures=pictures)
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

    from swarm.coordinator.decode.one import checked_logits

    engine = open_from_args(args)
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

    from swarm.coordinator.decode.one import checked_logits

    try:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {args.text} as UTF-8 text: {e}") from None
    if args.ctx < 2:
        raise UserError("--ctx must be at least 2")
    engine = open_from_args(args)
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
    from swarm.coordinator.cli.demo import run_demo

    apply_threads(args.threads)
    return run_demo(
        like=args.like,
        experts_type=args.experts_type,
        n_nodes=args.nodes,
        prompt=args.prompt,
        max_tokens=args.max_tokens,
        workdir=args.workdir,
        numerics=Numerics.of(args.exact),
    )
