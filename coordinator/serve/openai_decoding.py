"""What an OpenAI request asks of how its tokens are picked, beyond SamplingParams: the form of its answer
(`response_format` json_object / json_schema, the call a `tool_choice` "required" or a named function asks
for, or llama-server's `grammar`: a grammar, decode/grammar.py), penalties (`presence_penalty`,
`frequency_penalty`, `repetition_penalty`, decode/penalties.py) and `logprobs` / `top_logprobs`
(decode/logprobs.py), checked (a 400 naming the field) and turned into the decode core's hooks: logits
processors, forced drafts, a record of each token's row."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from swarm.coordinator.decode.grammar import (
    DEAD_END,
    Grammar,
    GrammarError,
    GrammarVocab,
    answer_grammar,
    in_thinking,
    json_schema_lark,
)
from swarm.coordinator.decode.logprobs import Logprobs
from swarm.coordinator.decode.penalties import Penalties
from swarm.coordinator.decode.tool_grammar import calls_lark, tool_schemas, value_or_calls_lark
from swarm.coordinator.serve.api_error import ApiError
from swarm.coordinator.text.tokenizer import GGUFTokenizer
from swarm.coordinator.text.tools import call_format

MAX_TOP_LOGPROBS = 20  # as OpenAI's chat API allows (its legacy completions: 5)


@dataclass
class Decoding:
    """One request's hooks into the decode core, and what its answer's end reads back from them."""

    processors: tuple[Any, ...] = ()
    grammar: Grammar | None = None
    logprobs: Logprobs | None = None
    start: int = 0  # the answer's first position (the prompt's length)
    tokens: list[int] = field(default_factory=list)  # the answer's tokens as they came

    @property
    def forced(self) -> Any:
        """The core's `forced` draft source (the grammar's fast-forward tokens), or None."""
        return self.grammar.forced if self.grammar is not None else None

    @property
    def record(self) -> Any:
        return self.logprobs.record if self.logprobs is not None else None

    def finish_reason(self, reason: str) -> str:
        """The answer's finish reason: 'grammar' where its grammar left no token to go on with."""
        if self.grammar is not None and reason == "stop" and self.grammar.ended_by(self.tokens) == DEAD_END:
            return DEAD_END
        return reason

    def answer_logprobs(
        self, tokenizer: GGUFTokenizer, chat: bool
    ) -> Callable[[], dict[str, Any] | None] | None:
        """What gives the whole answer's `logprobs` object once it has come (None: none asked for)."""
        if self.logprobs is None:
            return None
        return lambda: self.logprobs_of(tokenizer, chat, 0, len(self.tokens))

    def stream_logprobs(
        self, tokenizer: GGUFTokenizer, chat: bool
    ) -> Callable[[], dict[str, Any] | None] | None:
        """What gives, at each streamed chunk, the `logprobs` of the tokens come since the last (None: none
        asked for)."""
        if self.logprobs is None:
            return None
        sent = [0]

        def since() -> dict[str, Any] | None:
            begin, sent[0] = sent[0], len(self.tokens)
            return self.logprobs_of(tokenizer, chat, begin, sent[0])

        return since

    def logprobs_of(self, tokenizer: GGUFTokenizer, chat: bool, begin: int, end: int) -> dict[str, Any]:
        """OpenAI's `logprobs` object (the chat one, or the legacy completions' with text_offset counted from
        the answer's start) for the answer's tokens [begin, end), EOS left out."""
        assert self.logprobs is not None
        content, offsets = [], []
        at = sum(len(tokenizer.token_bytes(t).decode("utf-8", errors="replace")) for t in self.tokens[:begin])
        for i in range(begin, end):
            token, entry = self.tokens[i], self.logprobs.of(self.start + i)
            if entry is None or token in tokenizer.eos_ids:
                continue
            top = [_token(tokenizer, t, lp) for t, lp in entry.top]
            content.append({**_token(tokenizer, token, entry.logprob), "top_logprobs": top})
            offsets.append(at)
            at += len(content[-1]["token"])
        if chat:
            return {"content": content, "refusal": None}
        return {
            "tokens": [e["token"] for e in content],
            "token_logprobs": [e["logprob"] for e in content],
            "top_logprobs": [_first_of_each(e["top_logprobs"]) for e in content],
            "text_offset": offsets,
        }


def _first_of_each(top: list[dict[str, Any]]) -> dict[str, float]:
    """token text -> logprob, the likelier where two tokens have the same text (the legacy shape is a map)."""
    out: dict[str, float] = {}
    for t in top:
        out.setdefault(t["token"], t["logprob"])
    return out


def _token(tokenizer: GGUFTokenizer, token: int, logprob: float) -> dict[str, Any]:
    raw = tokenizer.token_bytes(token)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def decoding(
    body: Mapping[str, Any],
    tokenizer: GGUFTokenizer,
    prompt: Sequence[int],
    *,
    chat: bool,
    tools: Any = None,
    thinking: bool | None = None,
) -> Decoding:
    """The request's hooks. `tools`: a chat's openai_tools.ToolRequest (None: no tools); `thinking`: whether the
    answer starts inside a thinking block (None: read from the prompt's text)."""
    start = len(prompt)
    if thinking is None:
        thinking = in_thinking(tokenizer.decode(prompt[-8:]))
    processors: list[Any] = []
    penalties = Penalties(
        start,
        presence=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition=_number(body, "repetition_penalty", 1.0, 0.01, 10.0),
    )
    if penalties.active:
        processors.append(penalties)
    grammar = _grammar(body, tokenizer, start, tools, thinking)
    if grammar is not None:
        processors.append(grammar)  # last: a penalty cannot lift a token the grammar forbids
    return Decoding(tuple(processors), grammar, _logprobs(body, chat), start)


def _grammar(
    body: Mapping[str, Any], tokenizer: GGUFTokenizer, start: int, tools: Any, thinking: bool
) -> Any:
    if body.get("grammar") is not None:
        return _own_grammar(body, tokenizer, start, tools)
    value = _response_format(body.get("response_format"))
    calls = None
    if tools is not None and tools.offered and (tools.choice != "auto" or value is not None):
        fmt = call_format(tools.reading.family)
        if fmt is not None:
            offered = tool_schemas(tools.tools)
            if tools.choice == "function":
                offered = {tools.named: offered[tools.named]}
            try:
                calls = calls_lark(fmt, offered, tools.parallel)
            except GrammarError as e:
                raise ApiError(400, f"tools: {e}", param="tools") from None
    if tools is not None and tools.choice in ("required", "function"):
        if calls is None:
            return None  # openai_tools said why (a template with no call format) already
        value, calls, param = calls, None, "tool_choice"
    else:
        param = "response_format"
    if value is None:
        return None
    vocab = GrammarVocab.of(tokenizer)
    try:
        src = vocab.compile(answer_grammar(value_or_calls_lark(value, calls), thinking))
        return Grammar(vocab, src, start)
    except GrammarError as e:
        what = "the schema" if param == "response_format" else "a tool's parameters schema"
        raise ApiError(400, f"{param}: {what} cannot be used: {e}", param=param) from None


def _own_grammar(body: Mapping[str, Any], tokenizer: GGUFTokenizer, start: int, tools: Any) -> Grammar:
    """llama-server's `grammar`: the whole answer held to a grammar the client wrote (GBNF, or Lark as llguidance
    reads it), thinking included where the prompt opened a thinking block."""
    given = body["grammar"]
    if not isinstance(given, str) or not given.strip():
        raise ApiError(400, "'grammar' must be a grammar's text (GBNF or Lark)", param="grammar")
    forced = tools is not None and tools.choice in ("required", "function")
    if forced or body.get("response_format") not in (None, {"type": "text"}):
        raise ApiError(
            400, "'grammar' holds the whole answer: it goes with no response_format and no forced tool_choice",
            param="grammar",
        )  # fmt: skip
    vocab = GrammarVocab.of(tokenizer)
    try:
        return Grammar(vocab, vocab.compile(any_to_lark(given)), start)
    except (GrammarError, GbnfToLarkError) as e:
        raise ApiError(400, f"grammar: {e}", param="grammar") from None


def _response_format(given: Any) -> str | None:
    """The Lark value of a response_format (None: free text)."""
    if given is None:
        return None
    kind = given.get("type") if isinstance(given, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_lark(given.get("schema") or {"type": "object"})
    if kind == "json_schema":
        spec = given.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict | bool):
            raise ApiError(
                400, "response_format: json_schema needs {name, schema: a JSON schema object, strict}",
                param="response_format",
            )  # fmt: skip
        try:
            return json_schema_lark(schema)
        except GrammarError as e:
            raise ApiError(400, f"response_format: {e}", param="response_format") from None
    raise ApiError(
        400, "response_format: 'type' must be 'text', 'json_object' or 'json_schema'", param="response_format"
    )


def _logprobs(body: Mapping[str, Any], chat: bool) -> Logprobs | None:
    given = body.get("logprobs")
    if chat:
        if given is None or given is False:
            if body.get("top_logprobs") is not None:
                raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
            return None
        if given is not True:
            raise ApiError(400, "'logprobs' must be true or false", param="logprobs")
        top = body.get("top_logprobs", 0)
        param = "top_logprobs"
    else:
        if given is None:
            return None
        top, param = given, "logprobs"
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"'{param}' must be an integer in [0, {MAX_TOP_LOGPROBS}]", param=param)
    return Logprobs(top)


def _number(body: Mapping[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    """A numeric field within [lo, hi] (`default` where it is absent)."""
    v = body.get(name, default)
    if v is None:
        return default
    ok = isinstance(v, int | float) and not isinstance(v, bool) and lo <= v <= hi
    if ok:
        return float(v)
    raise ApiError(400, f"'{name}' must be a number in [{lo}, {hi}]", param=name)
