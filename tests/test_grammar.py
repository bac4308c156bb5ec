"""Structured output (decode/grammar.py): a grammar compiled by llguidance over the model's whole vocabulary
holds every answer to its schema, as a token mask and its forced tokens as drafts.

On the 152k-token Qwen3.5 vocabulary (../shared/fixtures/tokenizer): the mask of a prefix is the same however
the matcher reached it (checking windows and redos revisit positions); the forced tokens are what the mask
leaves. On the fixture's random weights in process: 50 seeds under a JSON schema all validate (the
`jsonschema` package), with the same tokens with drafts and without; a grammar with no way on ends the answer
with its own finish reason."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest
import torch
from conftest import FIXTURES, node_swarm

from swarm.coordinator.checks.audit import Verdict
from swarm.coordinator.cli.launch import spawn_server
from swarm.coordinator.config import EngineConfig
from swarm.coordinator.decode.core import DecodeCore, StopStrings, lookup_source
from swarm.coordinator.decode.grammar import (
    DEAD_END,
    Grammar,
    GrammarError,
    GrammarVocab,
    answer_grammar,
    json_grammar,
)
from swarm.coordinator.decode.logprobs import Logprobs
from swarm.coordinator.decode.penalties import Penalties
from swarm.coordinator.decode.sampling import SamplingParams
from swarm.coordinator.decode.tool_grammar import calls_lark, tool_schemas
from swarm.coordinator.drafts.lookup import PromptLookup
from swarm.coordinator.engine import open_engine
from swarm.coordinator.text.tokenizer import GGUFTokenizer
from swarm.coordinator.text.tools import Family, Reading, call_format, read_answer
from swarm.sharding.gguf_io import open_gguf, read_metadata

VOCAB = Path(__file__).parents[2] / "shared" / "fixtures" / "tokenizer" / "ggml-vocab-qwen35.gguf"
MODEL = FIXTURES / "qwen35moe-tiny" / "model-f32.gguf"
# bounded everywhere, so that random weights finish it within a short answer
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def big() -> GrammarVocab:
    return GrammarVocab.of(GGUFTokenizer(read_metadata(open_gguf(VOCAB))))


def greedy(grammar: Grammar, prompt: list[int], rows: torch.Tensor, eos: set[int]) -> list[int]:
    """Tokens picked greedily from `rows` (one random row per position) through the grammar's mask."""
    seq = list(prompt)
    for row in rows:
        token = int(torch.argmax(grammar(row, len(seq), seq)))
        seq.append(token)
        if token in eos:
            break
    return seq[len(prompt) :]


def test_the_whole_vocabulary_answers_to_the_schema_and_the_mask_follows_any_prefix(
    big: GrammarVocab,
) -> None:
    tok = big.tokenizer
    assert big.size == tok.vocab_size > 150_000
    prompt = tok.encode("<|im_start|>user\nJSON please<|im_end|>\n<|im_start|>assistant\n")
    eos = set(tok.eos_ids)
    rows = torch.randn(80, tok.vocab_size, generator=torch.Generator().manual_seed(1))
    grammar = Grammar(big, big.compile(json_grammar(SCHEMA)), start=len(prompt))
    answer = greedy(grammar, prompt, rows, eos)
    assert answer[-1] in eos and grammar.ended_by(answer) is None
    jsonschema.validate(json.loads(tok.decode(answer[:-1])), SCHEMA)
    # the first tokens are forced ('{"name": "'): the drafts are the mask's only choice
    forced = grammar.forced(prompt)
    assert tok.decode(list(forced)).startswith('{"name"') and tuple(answer[: len(forced)]) == forced

    # a fresh matcher's mask at each prefix, then the first one's at the same prefixes in random order
    seq = prompt + answer
    fresh = Grammar(big, big.compile(json_grammar(SCHEMA)), start=len(prompt))
    zero = torch.zeros(tok.vocab_size)
    want = {p: fresh(zero, p, seq[:p]).clone() for p in range(len(prompt), len(seq))}
    order = list(want)
    random.Random(0).shuffle(order)
    for p in order:
        assert torch.equal(grammar(zero, p, seq[:p]), want[p]), p
    # complete: only EOS is left
    done = grammar(zero, len(seq) - 1, seq[:-1])
    assert set(torch.nonzero(torch.isfinite(done)).flatten().tolist()) <= eos


def test_a_thinking_block_goes_before_the_value(big: GrammarVocab) -> None:
    tok = big.tokenizer
    grammar = Grammar(big, big.compile(json_grammar({"type": "object"}, thinking=True)), start=0)
    answer = tok.encode('hmm {"no": 1} </think>\n\n{"a": [1, 2]}') + [min(tok.eos_ids)]
    assert grammar.ended_by(answer) is None
    assert grammar.forced(answer[:-1]) == ()
    assert grammar.ended_by(tok.encode("hmm") + [min(tok.eos_ids)]) == DEAD_END  # EOS before any value


def test_a_grammar_with_no_way_on_ends_with_its_own_reason(big: GrammarVocab) -> None:
    tok = big.tokenizer
    grammar = Grammar(big, big.compile('start: "ab" B\nB: /[a-z]+/ & /[0-9]+/\n'), start=0)
    answer = greedy(grammar, [], torch.zeros(6, tok.vocab_size), set(tok.eos_ids))
    assert tok.decode(answer[:-1]) == "ab" and answer[-1] in tok.eos_ids
    assert grammar.ended_by(answer) == DEAD_END
    # an answer that left the grammar (a prefix it never allowed) gets EOS alone, and the same reason
    row = grammar(torch.zeros(tok.vocab_size), 2, tok.encode("zz"))
    assert torch.nonzero(torch.isfinite(row)).flatten().tolist() == [min(tok.eos_ids)]


def test_after_an_eos_draft_a_rollback_gives_the_mask_of_the_tokens_given(big: GrammarVocab) -> None:
    """A checking window whose EOS draft was taken has a row after the EOS; the answer's end then asks about the
    answer without it, and a redo about every earlier prefix. The matcher must be where the tokens say each time
    (llguidance keeps no rollback entry for an EOS consumed alone: it must take one only beside the tokens
    before it), from one token behind the window and from several."""
    tok = big.tokenizer
    src = big.compile(json_grammar({"type": "object"}))
    answer, eos = tok.encode('{"a": [1, 2]}'), min(tok.eos_ids)
    row = torch.zeros(tok.vocab_size)
    for behind in (1, 3):
        grammar = Grammar(big, src, start=0)
        grammar(row, len(answer) - behind, answer[:-behind])
        only = grammar(row, len(answer) + 2, [*answer, eos, eos])  # the row after the EOS
        assert torch.nonzero(torch.isfinite(only)).flatten().tolist() == [eos]
        assert grammar.ended_by([*answer, eos]) is None  # ended by EOS where the grammar was complete: "stop"
        for i in reversed(range(len(answer) + 1)):  # a redo, back to the start
            want = Grammar(big, src, start=0)(row, i, answer[:i]).clone()
            assert torch.equal(grammar(row, i, answer[:i]), want), (behind, i)


@pytest.mark.parametrize(
    "schema", [{"type": "foo"}, {"type": "object", "properties": {"a": {"type": 3}}}, [1], "object"]
)
def test_a_schema_the_engine_cannot_compile_is_a_grammar_error(big: GrammarVocab, schema: object) -> None:
    with pytest.raises(GrammarError):
        big.compile(json_grammar(schema))


@pytest.mark.parametrize("family", [Family.QWEN_XML, Family.JSON])
def test_a_forced_call_reads_back_as_a_call_its_tool_accepts(big: GrammarVocab, family: Family) -> None:
    tok, schemas = big.tokenizer, tool_schemas(TOOLS)
    src = big.compile(answer_grammar(calls_lark(call_format(family), schemas, parallel=False)))
    gen = torch.Generator().manual_seed(2)
    names = set()
    for _ in range(6):
        answer = greedy(
            Grammar(big, src, start=0), [], torch.randn(300, tok.vocab_size, generator=gen), set(tok.eos_ids)
        )
        assert answer[-1] in tok.eos_ids, tok.decode(answer)
        read = read_answer(tok.decode(answer[:-1]), Reading(family, schemas))
        assert len(read.calls) == 1 and not read.content.strip(), tok.decode(answer)
        jsonschema.validate(read.calls[0].arguments, schemas[read.calls[0].name])
        names.add(read.calls[0].name)
    assert names == set(schemas)


# --- in process, the fixture's random weights -------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    engine = open_engine(MODEL, EngineConfig(local=True))
    yield engine
    engine.close()


def answers(
    engine, prompt: list[int], params: list[SamplingParams], src: str, drafts: bool
) -> list[list[int]]:
    """Conversations through one decode core (together: one pass for all), each held to the grammar; drafts:
    its forced tokens, and prompt lookup after them."""
    vocab = GrammarVocab.of(engine.tokenizer)
    core = DecodeCore(engine.model, engine.device, drafts=lookup_source(PromptLookup(3)) if drafts else None)
    convs = []
    for p in params:
        grammar = Grammar(vocab, vocab.compile(src), start=len(prompt))
        convs.append(core.open(prompt, p, processors=[grammar], forced=grammar.forced if drafts else None))
    while any(c.finish is None for c in convs):
        core.step(core.plan([c for c in convs if c.finish is None])[0])
        for c in convs:
            core.collect(c)
    core.close()
    if drafts:
        assert all(c.seq.accepted > 0 for c in convs), "forced tokens ride the checking window"
    return [c.out for c in convs]


def test_fifty_seeds_validate_and_drafts_change_no_token(engine) -> None:
    tok = engine.tokenizer
    prompt = tok.encode("<|im_start|>user\nA person as JSON<|im_end|>\n<|im_start|>assistant\n")
    src = json_grammar(SCHEMA)
    params = [SamplingParams(120, temperature=1.0, seed=seed, stop_ids=tok.eos_ids) for seed in range(50)]
    params.append(SamplingParams(120, stop_ids=tok.eos_ids))  # greedy
    outs = answers(engine, prompt, params, src, drafts=True)
    for seed, out in enumerate(outs):
        assert out[-1] in tok.eos_ids, (seed, tok.decode(out))
        jsonschema.validate(json.loads(tok.decode(out[:-1])), SCHEMA)
    assert len({tuple(o) for o in outs}) > 40, "the seeds sample"
    assert answers(engine, prompt, params[::10], src, drafts=False) == outs[::10]


def test_fifty_seeds_under_tool_choice_required_each_call_fits_its_tool(engine) -> None:
    """25 seeds under "required" (either tool), 25 under the named get_weather."""
    tok, schemas = engine.tokenizer, tool_schemas(TOOLS)
    prompt = tok.encode("<|im_start|>user\nThe weather?<|im_end|>\n<|im_start|>assistant\n")
    fmt = call_format(Family.QWEN_XML)
    named = {"get_weather": schemas["get_weather"]}
    for offered, seeds in [(schemas, range(25)), (named, range(25, 50))]:
        src = answer_grammar(calls_lark(fmt, offered, parallel=False))
        params = [SamplingParams(120, temperature=1.0, seed=seed, stop_ids=tok.eos_ids) for seed in seeds]
        outs = answers(engine, prompt, params, src, drafts=True)
        for seed, out in zip(seeds, outs, strict=True):
            assert out[-1] in tok.eos_ids, (seed, tok.decode(out))
            read = read_answer(tok.decode(out[:-1]), Reading(Family.QWEN_XML, schemas))
            assert len(read.calls) == 1 and read.calls[0].name in offered, (seed, tok.decode(out))
            jsonschema.validate(read.calls[0].arguments, schemas[read.calls[0].name])
        assert answers(engine, prompt, params[::8], src, drafts=False) == outs[::8]


class Catching:
    """A checker (decode/passes.py Checker) over honest answers that leaves the work open at three settles in five
    (unless forced) and says a node was caught at the fourth: passes held several at a time and done again, as a
    busy swarm's audits and a caught liar make them, deterministically. A redo of honest answers gives the same
    text."""

    def __init__(self) -> None:
        self.settles = 0

    def cover(self, on: bool) -> None:
        pass

    def settle(self, force: bool = False) -> Verdict:
        self.settles += 1
        turn = self.settles % 5
        if turn == 4:
            return Verdict.CAUGHT
        return Verdict.OPEN if turn in (1, 2, 3) and not force else Verdict.SETTLED


def test_passes_done_again_and_again_change_no_token_and_no_finish(engine) -> None:
    """Conversations sharing passes under a checker that has them redone again and again, with drafts (a grammar's
    forced tokens, prompt lookup) in their windows: under a schema (its EOS: "stop"), under a schema cut by its
    max_tokens mid-value ("length"), free text cut by max_tokens, free text cut by a stop string. Each gives the
    tokens and the finish of one token a pass with no checker: no token counts twice toward a limit, no stop is
    missed or moved, whatever was redone or rolled back. Beside them, penalties and the logprobs they leave, the
    same both ways too."""
    tok = engine.tokenizer
    prompt = tok.encode("<|im_start|>user\nA person as JSON<|im_end|>\n<|im_start|>assistant\n")
    src = json_grammar(SCHEMA)
    eos = tok.eos_ids
    free = SamplingParams(40, temperature=1.0, seed=5, stop_ids=eos)
    core = DecodeCore(engine.model, engine.device)
    alone = core.open(prompt, free)
    while alone.finish is None:
        core.step(core.plan([alone])[0])
        core.collect(alone)
    core.close()
    text = tok.decode(alone.out, skip_control=True)
    pieces = (tok.decode(alone.out[i : i + 2], skip_control=True).strip() for i in range(6, 30))
    stop = next(w for w in pieces if w and w.isprintable() and w in text)
    asks = [
        (SamplingParams(120, temperature=1.0, seed=3, stop_ids=eos), src, None),
        (SamplingParams(120, stop_ids=eos), src, None),
        (SamplingParams(7, temperature=1.0, seed=4, stop_ids=eos), src, None),
        (SamplingParams(13, temperature=1.0, seed=6, stop_ids=eos), None, None),
        (free, None, stop),
        (SamplingParams(20, temperature=1.0, seed=8, stop_ids=eos), "penalties", None),
    ]

    def run(checker: Catching | None, drafts: bool) -> tuple[list[tuple[list[int], str | None, list]], int]:
        vocab = GrammarVocab.of(tok)
        core = DecodeCore(engine.model, engine.device, checker, drafts=lookup_source(PromptLookup(3)) if drafts else None)
        convs, records = [], []
        for params, hook, stop_string in asks:
            kw: dict = {}
            if hook == "penalties":  # and the logprobs of what they leave
                records.append(Logprobs(3))
                kw = {"processors": [Penalties(len(prompt), 0.5, 0.5, 1.3)], "record": records[-1].record}
            elif hook is not None:
                grammar = Grammar(vocab, vocab.compile(hook), start=len(prompt))
                kw = {"processors": [grammar], "forced": grammar.forced if drafts else None}
            if stop_string is not None:
                kw["stop_text"] = StopStrings(tok.stream(skip_control=True), [stop_string])
            convs.append(core.open(prompt, params, **kw))
        while any(c.finish is None for c in convs):
            core.step(core.plan([c for c in convs if c.finish is None])[0])
            for c in convs:
                core.collect(c)
        core.close()
        logprobs = [[r.of(len(prompt) + i) for i in range(len(convs[-1].out))] for r in records]
        return [(c.out, c.finish, logprobs if c is convs[-1] else []) for c in convs], core.passes.redone

    want, _ = run(None, drafts=False)
    assert [f for _, f, _ in want] == ["stop", "stop", "length", "length", "stop", "length"], want
    assert len(want[2][0]) == 7 and len(want[3][0]) == 13 and len(want[4][0]) < 40
    got, redone = run(Catching(), drafts=True)
    assert redone > 10
    assert got == want


# --- through the server and real nodes, the official client ------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 8},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "units": {"enum": ["c", "f"]},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "now",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    },
]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("grammar-serve")
    with node_swarm(MODEL, tmp, ["0-15", "16-31"]) as (shard, peers):
        args = ["--no-mdns", *peers, "--parallel", "4", "--ctx-size", "1024", "--model-id", "m"]
        proc = spawn_server(shard, args, tmp).wait_ready(120)
        try:
            yield openai.OpenAI(base_url=proc.ready["url"], api_key="-", max_retries=0)
        finally:
            assert proc.stop() == 0, proc.log_tail()


def ask(client: openai.OpenAI, seed: int, max_tokens: int = 120, **kw: object):
    return client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Answer in JSON"}], max_tokens=max_tokens,
        temperature=1.0, seed=seed, extra_body=NO_THINKING, **kw,
    )  # fmt: skip


def test_through_nodes_every_answer_fits_its_schema_and_every_call_its_tool(served: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    texts = set()
    for seed in range(4):
        r = ask(served, seed, response_format=fmt)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        texts.add(r.choices[0].message.content)
    assert len(texts) > 1
    c = served.completions.create(
        model="m", prompt="A person:", max_tokens=120, temperature=1.0, seed=7,
        extra_body={"response_format": fmt},
    )  # fmt: skip
    jsonschema.validate(json.loads(c.choices[0].text), SCHEMA)
    r = ask(served, 0, response_format={"type": "json_object"}, max_tokens=30)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed, choice in [(0, "required"), (1, "required"), (2, "required"), (3, named)]:
        r = ask(served, seed, tools=TOOLS, tool_choice=choice, parallel_tool_calls=seed == 2)
        assert r.choices[0].finish_reason == "tool_calls" or seed == 2, r.choices[0]
        assert r.choices[0].message.tool_calls, r.choices[0]
        for call in r.choices[0].message.tool_calls:
            assert choice == "required" or call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_fifty_seeds_through_nodes_each_answer_fits_its_schema_and_each_call_its_tool(served: openai.OpenAI) -> None:
    """50 seeds under a json_schema and 50 under a forced call (required and the named function in turn), four
    at a time (the server's slots share passes): each answer validates (jsonschema), and the seeds sample."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    named = {"type": "function", "function": {"name": "get_weather"}}
    with ThreadPoolExecutor(4) as pool:
        values = list(pool.map(lambda seed: ask(served, seed, response_format=fmt), range(50)))
        calls = list(pool.map(
            lambda seed: ask(served, seed, tools=TOOLS, tool_choice="required" if seed % 2 else named,
                             parallel_tool_calls=False), range(50),
        ))  # fmt: skip
    for seed, r in enumerate(values):
        assert r.choices[0].finish_reason == "stop", (seed, r.choices[0])
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    assert len({r.choices[0].message.content for r in values}) > 40, "the seeds sample"
    for seed, r in enumerate(calls):
        assert r.choices[0].finish_reason == "tool_calls", (seed, r.choices[0])
        (call,) = r.choices[0].message.tool_calls
        assert seed % 2 or call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert len({r.choices[0].message.tool_calls[0].function.arguments for r in calls}) > 20


def test_a_schema_the_engine_cannot_compile_is_a_400_naming_response_format(served: openai.OpenAI) -> None:
    for fmt in [
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
        {"type": "json_schema", "json_schema": {"name": "x"}},
        {"type": "xml"},
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            ask(served, 0, response_format=fmt)
        assert e.value.body["param"] == "response_format", e.value.body
    ok = ask(served, 0, response_format={"type": "text"}, max_tokens=4)
    assert ok.choices[0].finish_reason in ("stop", "length")
