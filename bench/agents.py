"""What structured output costs and saves: the grammar's mask per decode token on a 248k-token vocabulary, and
decode speed on a schema-shaped answer with the grammar's forced tokens as drafts against without, through 4
nodes directly and through the 5 ms relay.

    .venv/bin/python bench/agents.py [--tokens 96] [--rtts 0,5] [--nodes 4] [--workdir /work/bench-models/decode]
                                     [--no-write]

The mask: decode/grammar.py's logits processor (following the answer, llguidance's mask or forced token, the
mask applied to a float32 row) timed per token over greedy answers to SCHEMA on random rows, on the released
Qwen3.5 models' vocabulary size, 248,320 tokens: the fixture's 151,936-token Qwen3.5 vocabulary
(../shared/fixtures/tokenizer; the 248k one is not in the fixtures) grown by 96,384 tokens, each two of its
tokens' bytes joined (longer tokens, as the added multilingual ones are), and on the fixture's own 151,936 for
comparison. Against a one-token decode pass of the bench model (bench/_models.py: 4 layers of the
Qwen3.6-35B-A3B shape, so a 40-layer pass is about ten times longer and the share a tenth; its LM head is its
synth vocabulary's, not 248k rows) in process and through the nodes. The answer: the same model greedy under
SCHEMA, held by its grammar, its forced tokens drafted (Conversation.forced) or not; decode tokens per second
and tokens per pass, the text compared.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import llguidance
import torch
from _doc import bench_args, bench_parser, command, machine, publish
from _latency_swarm import Nodes, linked
from _models import prepare, prompt_tokens

from swarm.coordinator.config import EngineConfig
from swarm.coordinator.decode.core import DecodeCore
from swarm.coordinator.decode.grammar import Grammar, GrammarVocab, TokenizerSource, json_grammar
from swarm.coordinator.decode.sampling import SamplingParams
from swarm.coordinator.engine import open_engine
from swarm.coordinator.text.tokenizer import GGUFTokenizer
from swarm.sharding.gguf_io import open_gguf, read_metadata

VOCAB = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "tokenizer" / "ggml-vocab-qwen35.gguf"
WIDE = 248_320  # the released Qwen3.5 / 3.6 models' vocabulary size
# an agent's structured answer: mostly keys and punctuation the grammar forces, a few values the model picks
SCHEMA = {
    "type": "object",
    "properties": {
        "action": {"enum": ["read_file", "write_file", "run_command", "search"]},
        "path": {"type": "string", "maxLength": 12},
        "line_start": {"type": "integer", "minimum": 0, "maximum": 9999},
        "line_end": {"type": "integer", "minimum": 0, "maximum": 9999},
        "recursive": {"type": "boolean"},
        "confidence": {"enum": ["low", "medium", "high"]},
        "needs_confirmation": {"type": "boolean"},
    },
    "required": ["action", "path", "line_start", "line_end", "recursive", "confidence", "needs_confirmation"],
    "additionalProperties": False,
}


class Timed:
    """A logits processor timed call by call."""

    def __init__(self, inner: Grammar) -> None:
        self.inner, self.seconds = inner, []

    def __call__(self, logits: torch.Tensor, position: int, before: list[int]) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.inner(logits, position, before)
        self.seconds.append(time.perf_counter() - t0)
        return out


class WiderVocab(GrammarVocab):
    """A GGUF vocabulary grown to `size` tokens for llguidance: each added token two of its tokens' bytes joined
    (seeded, none twice, no control token). Forced bytes are still tokenized by the GGUF's own tokenizer."""

    def __init__(self, tokenizer: GGUFTokenizer, size: int) -> None:
        wrapped = TokenizerSource(tokenizer)
        have = set(wrapped.tokens)
        pool = [t for i, t in enumerate(wrapped.tokens) if t and i not in tokenizer.control_ids]
        rng = random.Random(0)
        while len(wrapped.tokens) < size:
            token = rng.choice(pool) + rng.choice(pool)
            if token not in have:
                have.add(token)
                wrapped.tokens.append(token)
        self.tokenizer, self.size, self.eos = tokenizer, size, sorted(tokenizer.eos_ids)
        self.ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrapped), eos_token=self.eos)


def mask_cost(vocab: GrammarVocab, tokens: int) -> tuple[float, float, int]:
    """(median, mean) seconds of the processor per token over greedy answers on random rows of `vocab`, and the
    tokens timed."""
    eos = set(vocab.eos)
    times: list[float] = []
    gen = torch.Generator().manual_seed(0)
    while len(times) < tokens:
        grammar = Timed(Grammar(vocab, vocab.compile(json_grammar(SCHEMA)), start=0))
        seq: list[int] = []
        for _ in range(200):
            token = int(torch.argmax(grammar(torch.randn(vocab.size, generator=gen), len(seq), seq)))
            seq.append(token)
            if token in eos:
                break
        times += grammar.seconds
    return statistics.median(times), statistics.fmean(times), len(times)


def answer(
    engine: object, prompt: list[int], tokens: int, forced: bool
) -> tuple[list[int], float, int, float]:
    """One greedy answer under SCHEMA through the decode core: (tokens, decode seconds after the prompt's
    pass, decode passes, the processor's mean seconds a token)."""
    vocab = GrammarVocab.of(engine.tokenizer)  # type: ignore[attr-defined]
    grammar = Timed(Grammar(vocab, vocab.compile(json_grammar(SCHEMA)), start=len(prompt)))
    core = DecodeCore(engine.model, engine.device, engine.checker)  # type: ignore[attr-defined]
    params = SamplingParams(tokens, stop_ids=engine.tokenizer.eos_ids)  # type: ignore[attr-defined]
    conv = core.open(prompt, params, processors=[grammar], forced=grammar.inner.forced if forced else None)
    core.step(core.plan([conv])[0])
    while not conv.seq.ready and core.pending:
        core.step([])
    out = core.collect(conv)
    steps0, t0 = conv.seq.steps, time.perf_counter()
    while conv.finish is None:
        entries = core.plan([conv])[0]
        core.step(entries)
        out += core.collect(conv)
    wall = time.perf_counter() - t0
    passes = conv.seq.steps - steps0
    core.close()
    return out, wall, passes, statistics.fmean(grammar.seconds)


def bench(args: argparse.Namespace) -> str:
    tokenizer = GGUFTokenizer(read_metadata(open_gguf(VOCAB)))
    masks = {}
    for size, vocab in [
        (WIDE, WiderVocab(tokenizer, WIDE)),
        (tokenizer.vocab_size, GrammarVocab.of(tokenizer)),
    ]:
        masks[size] = mask_cost(vocab, args.tokens * 4)
        med, mean, n = masks[size]
        print(f"mask, {size} tokens: median {med * 1e3:.3f} ms, mean {mean * 1e3:.3f} ms over {n} tokens",
              file=sys.stderr)  # fmt: skip
    gguf, shard = prepare("qwen35moe", 4, Path(args.workdir))
    rows = []
    engine = open_engine(gguf, EngineConfig(local=True, device="cpu"))
    try:
        prompt = prompt_tokens(engine, 32)
        for forced in (False, True):
            rows.append(("in process", forced, *answer(engine, prompt, args.tokens, forced)))
            print(rows[-1][:2], rows[-1][3:], file=sys.stderr, flush=True)
    finally:
        engine.close()
    nodes = Nodes(shard, args.nodes, Path(args.workdir) / "nodes")
    try:
        for rtt in args.rtts:
            carried: dict[str, object] = {}
            with linked(nodes, rtt or None, 2, 0.0, carried) as engine:
                for forced in (False, True):
                    rows.append(
                        (
                            f"{args.nodes} nodes, {rtt:g} ms",
                            forced,
                            *answer(engine, prompt, args.tokens, forced),
                        )
                    )
                    print(rows[-1][:2], rows[-1][3:], file=sys.stderr, flush=True)
    finally:
        nodes.close()
    return report(args, masks, rows)


def report(args: argparse.Namespace, masks: dict[int, tuple[float, float, int]], rows: list[tuple]) -> str:
    lines = [
        f"`{command('agents.py', args.argv)}` on {machine()}; load average before the run {args.load:.1f}.",
        "",
        *(
            f"The grammar's mask on a {size:,}-token vocabulary: **{med * 1e3:.3f} ms** a token (median; mean "
            f"{mean * 1e3:.3f} ms) over {n} tokens of greedy answers to the bench's schema on random rows."
            for size, (med, mean, n) in masks.items()
        ),
        f"({WIDE:,}: the fixture's 151,936 grown as the bench's docstring says.)",
        "",
        "| where | forced tokens as drafts | tokens | decode passes | tokens a pass | decode tok/s "
        "| vs without | one-token pass, ms | 248k mask (mean), % of it | same text |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    mean = masks[WIDE][1]
    by = {(w, f): (out, wall, passes) for w, f, out, wall, passes, _ in rows}
    for where, forced, out, wall, passes, _ in rows:
        base_out, base_wall, base_passes = by[(where, False)]
        tps, base_tps = (len(out) - 1) / wall, (len(base_out) - 1) / base_wall
        one_pass = base_wall / base_passes
        lines.append(
            f"| {where} | {'yes' if forced else 'no'} | {len(out)} | {passes} | {(len(out) - 1) / passes:.2f} | "
            f"{tps:.1f} | {tps / base_tps:.2f}x | {one_pass * 1e3:.1f} | {100 * mean / one_pass:.1f} % | "
            f"{'yes' if out == base_out else 'NO'} |"
        )
    lines += [
        "",
        "The bench model is 4 layers deep: a 40-layer model's pass is about ten times longer (the mask's share "
        "a tenth) and, over a network, its round trips ten times more, which the forced drafts save. Tokens: "
        "the answer's, its first from the prompt's pass; the decode figures are of the passes after it.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__)
    p.add_argument("--tokens", type=int, default=96, help="most tokens an answer may take")
    p.add_argument("--rtts", default="0,5", help="relay round trips, ms (0: the nodes directly)")
    p.add_argument("--nodes", type=int, default=4)
    args = bench_args(p, argv)
    args.rtts = [float(x) for x in args.rtts.split(",")]
    publish("agents", bench(args), not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
