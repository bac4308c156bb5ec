"""Tool calls and thinking in a model's own words: the call format a chat template teaches (its family), and an
answer's text read back into reasoning, content and tool calls, whole or as it streams.

The family is chosen from the template's text the way llama.cpp's chat parser chooses (markers only that family's
templates write):
- QWEN_XML (Qwen3.5/3.6, Qwen3-Coder): a template that writes `<tool_call>`, `<function=` and `<parameter=`.
  A call is `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`;
  a parameter's text becomes the type its tool's JSON schema declares.
- JSON (Qwen3, Qwen3-Next, Hermes): one that writes `<tool_call>` alone. A call is
  `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`.
- NONE: no call format (a ChatML fallback): an answer is content and thinking only.
Thinking is a `<think>…</think>` block at the start of an answer, or the rest of a `<think>` the generation prompt
already opened (Qwen3.5 thinks by default; `enable_thinking: false` pre-fills an empty block instead).

Everything here is a pure function of text: the serve layer (serve/openai_tools.py) turns the pieces into API shapes
and B's grammar (decode/grammar.py) reads `call_format` for the form a forced call must take.
"""

from __future__ import annotations

import enum
import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

THINK_START, THINK_END = "<think>", "</think>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
FUNCTION_START, FUNCTION_END = "<function=", "</function>"
PARAMETER_START, PARAMETER_END = "<parameter=", "</parameter>"


class Family(enum.Enum):
    NONE = "none"
    QWEN_XML = "qwen-xml"
    JSON = "json"


@dataclass(frozen=True)
class ChatFormat:
    """What a chat template teaches: its call family, and whether it knows `<think>` blocks."""

    family: Family
    thinks: bool

    @classmethod
    def of_template(cls, source: str) -> ChatFormat:
        if CALL_START in source and FUNCTION_START in source and PARAMETER_START in source:
            family = Family.QWEN_XML
        elif CALL_START in source:
            family = Family.JSON
        else:
            family = Family.NONE
        return cls(family, THINK_START in source)


def thinking_opened(prompt: str) -> str:
    """The `<think>` a rendered prompt ends inside ('<think>\\n'), or '' where it opens none: the answer to such a
    prompt starts in its reasoning (llama.cpp's 'thinking forced open')."""
    if not prompt.rstrip().endswith(THINK_START):
        return ""
    return prompt[prompt.rindex(THINK_START) :]


@dataclass(frozen=True)
class CallFormat:
    """The form of the calls of one family, for a grammar that forces one (`tool_choice` required or a named
    function) and for anything that writes a call as the model would.

    A turn of calls is `start` + call + (`between` + `start` + call)* … each call closed by `end`. A call's body:
    - QWEN_XML: `<function=NAME>\\n`, then per argument `<parameter=P>\\nVALUE\\n</parameter>\\n`, then `</function>`.
      VALUE is the text itself for a string parameter (it must not hold `\\n</parameter>`), JSON for any other.
    - JSON: one JSON object `{"name": NAME, "arguments": ARGS}`, ARGS the object the tool's schema describes.
    `call_text` writes one; `read_answer` reads what a grammar built on this produces.
    """

    family: Family
    start: str = CALL_START + "\n"
    end: str = "\n" + CALL_END
    between: str = "\n"


def call_format(family: Family) -> CallFormat | None:
    """The call form of `family`; None for Family.NONE (no calls)."""
    return None if family is Family.NONE else CallFormat(family)


def call_text(family: Family, name: str, arguments: Mapping[str, Any]) -> str:
    """One call, `<tool_call>` to `</tool_call>`, as the family's template writes it."""
    if family is Family.QWEN_XML:
        params = "".join(
            f"{PARAMETER_START}{k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n"
            f"{PARAMETER_END}\n"
            for k, v in arguments.items()
        )
        body = f"{FUNCTION_START}{name}>\n{params}{FUNCTION_END}"
    elif family is Family.JSON:
        body = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
    else:
        raise ValueError("a template without a call format writes no calls")
    return f"{CALL_START}\n{body}\n{CALL_END}"


@dataclass(frozen=True)
class Reading:
    """How one answer's text is read."""

    family: Family = Family.NONE  # NONE: calls are not looked for (no tools offered, or tool_choice none)
    # each offered tool's name -> its parameters' JSON schema
    tools: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    thinks: bool = False  # the template knows <think> blocks
    split_thinking: bool = True  # reasoning apart from content (else it stays in content, tags and all)
    opened: str = ""  # the <think> the prompt opened (thinking_opened): the answer starts in its reasoning
    parallel: bool = True  # False: only the first call is kept


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def json_pieces(self) -> list[str]:
        """The arguments' JSON text in pieces, one per argument, as a stream sends them; joined: valid JSON."""
        items = [json.dumps({k: v}, ensure_ascii=False)[1:-1] for k, v in self.arguments.items()]
        if not items:
            return ["{}"]
        return ["{" + items[0]] + [", " + s for s in items[1:]] + ["}"]


@dataclass(frozen=True)
class Piece:
    """A piece of an answer: text of its content or reasoning, or one whole tool call."""

    kind: str  # "content", "reasoning" or "call"
    text: str = ""
    call: ToolCall | None = None


@dataclass
class ReadAnswer:
    """An answer read whole."""

    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def read_answer(text: str, reading: Reading) -> ReadAnswer:
    """The whole text of an answer read at once: the same pieces as any streaming of it (AnswerReader)."""
    reader = AnswerReader(reading)
    return collect(reader.push(text) + reader.finish())


def collect(pieces: Sequence[Piece]) -> ReadAnswer:
    out = ReadAnswer()
    for p in pieces:
        if p.kind == "content":
            out.content += p.text
        elif p.kind == "reasoning":
            out.reasoning += p.text
        elif p.call is not None:
            out.calls.append(p.call)
    return out


def _held(text: str, tags: Sequence[str]) -> int:
    """How many characters at the end of `text` could still be the start of one of `tags`."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


class AnswerReader:
    """Reads an answer's text as it streams into pieces: reasoning, content and whole tool calls. Holds back only
    what could still be the start of a tag (and, where calls are looked for, content's trailing whitespace, which
    a call that follows drops). Every split of the same text gives the same pieces, joined."""

    def __init__(self, reading: Reading) -> None:
        self.reading = reading
        self.buf = ""
        self.state = "think" if reading.opened and reading.thinks else "start"
        self.calls = 0
        # content starts here: its leading whitespace is dropped (after </think>, after a call)
        self.fresh = False
        self.space = ""  # content's trailing whitespace, held while a call may follow
        self.rspace = ""  # reasoning's trailing whitespace, dropped at </think>
        self.lead = True  # reasoning's leading whitespace is dropped
        self.call_tag = ""  # the tag the call being read started with
        self.before = ""  # the whitespace before it
        self.starts = (
            []
            if reading.family is Family.NONE
            else [CALL_START, FUNCTION_START]
            if reading.family is Family.QWEN_XML
            else [CALL_START]
        )
        self.out: list[Piece] = []
        if self.state == "think" and not reading.split_thinking:
            self.out.append(Piece("content", reading.opened))

    def push(self, text: str) -> list[Piece]:
        self.buf += text
        self._run(final=False)
        out, self.out = self.out, []
        return out

    def finish(self) -> list[Piece]:
        self._run(final=True)
        if self.space and not self.calls:
            self.out.append(Piece("content", self.space))
        self.space = ""
        out, self.out = self.out, []
        return out

    # ---- the states ----

    def _run(self, final: bool) -> None:
        while self.buf:
            if self.state == "start" and not self._start(final):
                return
            if self.state == "think" and not self._think(final):
                return
            if self.state == "text" and not self._text(final):
                return
            if self.state == "call" and not self._call(final):
                return

    def _start(self, final: bool) -> bool:
        """At the answer's start: a <think> block the model opens itself, or none."""
        head = self.buf.lstrip()
        if self.reading.thinks and head.startswith(THINK_START):
            at = self.buf.index(THINK_START) + len(THINK_START)
            if not self.reading.split_thinking:
                self.out.append(Piece("content", self.buf[:at]))
            self.buf, self.state = self.buf[at:], "think"
            return True
        if self.reading.thinks and THINK_START.startswith(head) and not final:
            return False
        self.state = "text"
        return True

    def _think(self, final: bool) -> bool:
        end = self.buf.find(THINK_END)
        if end < 0:
            keep = 0 if final else _held(self.buf, [THINK_END])
            self._reason(self.buf[: len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep :]
            return False
        self._reason(self.buf[:end])
        if not self.reading.split_thinking:
            self.out.append(Piece("content", THINK_END))
        self.buf, self.state = self.buf[end + len(THINK_END) :], "text"
        self.fresh = self.reading.split_thinking  # reasoning-format none: the text stays as it was
        return True

    def _reason(self, text: str) -> None:
        if not self.reading.split_thinking:
            if text:
                self.out.append(Piece("content", text))
            return
        text = self.rspace + text
        if self.lead:
            text = text.lstrip()
            self.lead = not text
        body = text.rstrip()
        self.rspace = text[len(body) :]
        if body:
            self.out.append(Piece("reasoning", body))

    def _text(self, final: bool) -> bool:
        found = [(self.buf.find(t), t) for t in self.starts]
        found = [(i, t) for i, t in found if i >= 0]
        if found:
            at, tag = min(found)
            self._content(self.buf[:at])
            self.before, self.space = self.space, ""  # put back if the call does not parse
            self.buf, self.state, self.call_tag = self.buf[at:], "call", tag
            return True
        keep = 0 if final else _held(self.buf, self.starts)
        self._content(self.buf[: len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep :]
        return False

    def _content(self, text: str) -> None:
        text, self.space = self.space + text, ""
        if self.fresh:
            text = text.lstrip()
            self.fresh = not text
        if self.starts:
            body = text.rstrip()
            text, self.space = body, text[len(body) :]
        if text:
            self.out.append(Piece("content", text))

    def _call(self, final: bool) -> bool:
        end_tag = CALL_END if self.call_tag == CALL_START else FUNCTION_END
        end = self.buf.find(end_tag)
        if end < 0 and not final:
            return False
        block = self.buf if end < 0 else self.buf[: end + len(end_tag)]
        self.buf = "" if end < 0 else self.buf[end + len(end_tag) :]
        call = parse_call(block, self.reading)
        self.state = "text"
        if call is None:
            log.warning("a tool call that does not parse stays text: %r", block[:200])
            self.space = self.before
            self._content(block)
            return True
        if self.calls and not self.reading.parallel:
            log.info("parallel_tool_calls is false: a further call (%s) is dropped", call.name)
        else:
            self.out.append(Piece("call", call=call))
        self.calls += 1
        self.fresh, self.space = True, ""
        return True


# ---- one call ----


def parse_call(block: str, reading: Reading) -> ToolCall | None:
    """One call's text (from its start tag to its end tag, the end tag missing where the answer stopped inside it)
    as a ToolCall, or None where it does not parse or names no offered tool."""
    inner = block
    if inner.startswith(CALL_START):
        inner = inner[len(CALL_START) :]
        inner = inner[: -len(CALL_END)] if inner.endswith(CALL_END) else inner
    inner = inner.strip()
    try:
        if reading.family is Family.QWEN_XML:
            name, arguments = _xml_call(inner, reading.tools)
        else:
            name, arguments = _json_call(inner)
    except ValueError as e:
        log.debug("tool call not read: %s", e)
        return None
    if name not in reading.tools:
        log.warning("the model called %r, a tool it was not offered", name)
        return None
    return ToolCall(name, arguments)


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>)?\s*", re.S)
# A value ends at the `</parameter>` before the next parameter or the function's end, so one holding the tag
# itself (a file of XML) still reads whole.
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>\s*(?=<parameter=|$)", re.S)


def _xml_call(inner: str, tools: Mapping[str, Mapping[str, Any]]) -> tuple[str, dict[str, Any]]:
    m = _FUNCTION.fullmatch(inner)
    if m is None:
        raise ValueError("no <function=NAME> … </function>")
    name, body = m.group(1).strip(), m.group(2).strip()
    properties = (tools.get(name) or {}).get("properties") or {}
    arguments: dict[str, Any] = {}
    at = 0
    for p in _PARAMETER.finditer(body):
        if p.start() != at:
            raise ValueError(f"text between parameters: {body[at : p.start()]!r}")
        at = p.end()
        value = p.group(2)
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        key = p.group(1).strip()
        arguments[key] = typed_value(value, properties.get(key) if isinstance(properties, Mapping) else None)
    if at != len(body):
        raise ValueError(f"not a parameter: {body[at:]!r}")
    return name, arguments


def _json_call(inner: str) -> tuple[str, dict[str, Any]]:
    try:
        obj = json.loads(inner)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("not an object with a 'name'")
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ValueError("'arguments' is text that is not JSON") from None
    if not isinstance(arguments, dict):
        raise ValueError("'arguments' is not an object")
    return obj["name"], arguments


def _types(schema: Mapping[str, Any]) -> set[str]:
    t = schema.get("type")
    found = (
        {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()
    )
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            if isinstance(sub, Mapping):
                found |= _types(sub)
    if not found and isinstance(schema.get("enum"), list):
        found = {"string" if isinstance(v, str) else "json" for v in schema["enum"]}
    return found


def typed_value(text: str, schema: Mapping[str, Any] | None) -> Any:
    """A parameter's text as the type its JSON schema declares: a string parameter's text as is; a number, a
    boolean (the template writes Python's True/False), null, an object or an array from its text. Text that is
    not what the schema says stays a string (the tool reports it, as it would a wrong value)."""
    types = _types(schema) if isinstance(schema, Mapping) else set()
    if not types or types == {"string"}:
        return text
    s = text.strip()
    if "null" in types and s in ("null", "None"):
        return None
    if "boolean" in types and s.lower() in ("true", "false"):
        return s.lower() == "true"
    if "integer" in types and re.fullmatch(r"-?\d+", s):
        return int(s)
    if "number" in types:
        try:
            v = float(s)
        except ValueError:
            pass
        else:
            return int(v) if v.is_integer() and re.fullmatch(r"-?\d+", s) else v
    if types - {"string"}:
        try:
            v = json.loads(s)
        except json.JSONDecodeError:
            pass
        else:
            if not isinstance(v, str):
                return v
    return text
