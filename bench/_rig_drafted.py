"""The coordinator's side of a drafted rig run (bench/rig_split.py --drafts K), run inside the coordinator's
device in place of `swarm run`, with `swarm run`'s own flags and engine:

    python bench/_rig_drafted.py run SHARD_DIR --no-mdns --peer ... --prompt TEXT --max-tokens N [swarm run flags] \
        --drafts K --wrong P [--seed S]

Three greedy generations of the prompt on one engine: the first (untimed) gives the continuation; the second is
timed without drafts; the third with K drafts a pass taken from that continuation, each draft replaced by another
token with probability P (independently, seeded): drafts as right as a draft model that is right with 1 - P a
token (the published MTP rate on Qwen3.6-35B is ~0.82). The drafted text must equal the undrafted one. Prints
one line `RESULT {json}`: prompt and decode tok/s of both timed runs, the drafts made and kept.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable, Sequence

from swarm.compute.openmp import set_wait_policy


def noisy(text: tuple[int, ...], k: int, wrong: float, n_vocab: int, seed: int) -> Callable[[Sequence[int]], list[int]]:
    """Drafts read from `text` (what follows the tokens so far), each replaced with probability `wrong`."""
    rng = random.Random(seed)

    def draft(tokens: Sequence[int]) -> list[int]:
        n = len(tokens)
        if n >= len(text) or tuple(tokens) != text[:n]:
            return []
        out = list(text[n : n + k])
        return [(t + 1) % n_vocab if rng.random() < wrong else t for t in out]

    return draft


def main(argv: list[str]) -> int:
    set_wait_policy(experts_remote=True)  # before torch and ggml load, as `swarm run` does
    from swarm.coordinator.cli import build_parser
    from swarm.coordinator.cli.flags import open_from_args
    from swarm.coordinator.decode.one import GenerationStats, SamplingParams, generate
    from swarm.coordinator.text.chat import prompt_ids

    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--drafts", type=int, required=True)
    own.add_argument("--wrong", type=float, required=True)
    own.add_argument("--seed", type=int, default=0)
    ours, rest = own.parse_known_args(argv)
    args = build_parser(rest).parse_args(rest)
    engine = open_from_args(args)
    try:
        ids = prompt_ids(engine.tokenizer, args.prompt, args.chat, args.system)
        params = SamplingParams(max_tokens=args.max_tokens)  # greedy

        def timed(drafter: Callable[[Sequence[int]], Sequence[int]] | None) -> tuple[list[int], GenerationStats]:
            stats = GenerationStats(prompt_tokens=len(ids))
            t0 = time.perf_counter()
            tokens = list(generate(engine.model, ids, params, engine.device, stats, checker=engine.checker,
                                   drafter=drafter))  # fmt: skip
            stats.extra["wall"] = time.perf_counter() - t0
            return tokens, stats

        reference, _ = timed(None)
        plain, plain_stats = timed(None)
        n_vocab = engine.tokenizer.vocab_size
        drafter = noisy(tuple(ids + reference), ours.drafts, ours.wrong, n_vocab, ours.seed)
        drafted, drafted_stats = timed(drafter)
        if drafted != reference or plain != reference:
            print("drafted or repeated text differs from the first run's", file=sys.stderr)
            return 1
        result = {
            "prompt_tokens": len(ids),
            "decode_tokens": len(reference),
            "plain": [plain_stats.prefill_tps, plain_stats.decode_tps],
            "drafted": [drafted_stats.prefill_tps, drafted_stats.decode_tps],
            "drafts_made": int(drafted_stats.extra.get("drafted", 0)),
            "drafts_kept": int(drafted_stats.extra.get("accepted", 0)),
        }
        print("RESULT " + json.dumps(result), flush=True)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
