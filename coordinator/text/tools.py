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

from swarm.coordinator.text.call_stream import (
    FUNCTION_END,
    FUNCTION_START,
    PARAMETER_END,
    PARAMETER_START,
    JsonArgs,
    XmlArgs,
    held,
    json_call,
    xml_call,
)

log = logging.getLogger(__name__)

THINK_START, THINK_END = "<think>", "</think>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"


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


@dataclass(frozen=True)
class Piece:
    """A piece of an answer: text of its content or reasoning, a tool call begun (`text` its tool's name), or a
    piece of that call's arguments (their JSON text; a call's pieces joined are one JSON object)."""

    kind: str  # "content", "reasoning", "call" or "arguments"
    text: str = ""


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
    calls: list[tuple[str, list[str]]] = []
    for p in pieces:
        if p.kind == "content":
            out.content += p.text
        elif p.kind == "reasoning":
            out.reasoning += p.text
        elif p.kind == "call":
            calls.append((p.text, []))
        else:
            calls[-1][1].append(p.text)
    out.calls = [ToolCall(name, json.loads("".join(args))) for name, args in calls]
    return out


# A call's head, once read, makes it a call: the name of an offered tool and the start of its arguments.
_JSON_HEAD = re.compile(r'<tool_call>\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')
_XML_HEAD = re.compile(r"(?:<tool_call>)?\s*<function=([^>\n]+)>\s*(?=<parameter=|</function>)")


class AnswerReader:
    """Reads an answer's text as it streams into pieces: reasoning, content and tool calls, each call's arguments
    as the model writes them once its head is read (text/call_stream.py). Holds back only what could still be the
    start of a tag (and, where calls are looked for, content's trailing whitespace, which a call that follows
    drops). Every split of the same text gives the same pieces, joined."""

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
        self.args: JsonArgs | XmlArgs | None = None  # the arguments of the call being read, once its head is
        self.fed = 0  # how much of the call's text they were given
        self.keep = True  # whether the call being read is kept (parallel_tool_calls false keeps the first)
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
            keep = 0 if final else held(self.buf, (THINK_END,))
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
        keep = 0 if final else held(self.buf, tuple(self.starts))
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
        """A call, its arguments written as they come once its head is read (_head); before that, read whole
        at its end, and left as text where it does not parse."""
        end_tag = CALL_END if self.call_tag == CALL_START else FUNCTION_END
        end = self.buf.find(end_tag)
        over = end >= 0 or final
        block = self.buf[:end] if end >= 0 else self.buf
        if not over:
            block = block[: len(block) - held(block, (end_tag,))]
        if self.args is None and not self._head(block):
            if not over:
                return False
            self._whole_call(self.buf if end < 0 else self.buf[: end + len(end_tag)])
        elif self.args is not None:
            self._feed(block[self.fed :], over)
            self.fed = len(block)
            if not over:
                return False
            self.args = None
            self.fresh, self.space = True, ""
        self.buf = "" if end < 0 else self.buf[end + len(end_tag) :]
        self.state = "text"
        return True

    def _head(self, block: str) -> bool:
        """Whether `block` begins with the head of a call of an offered tool; if so the call is begun."""
        if self.reading.family is Family.JSON:
            m = _JSON_HEAD.match(block)
            name = json.loads(m.group(1)) if m else None
        else:
            m = _XML_HEAD.match(block)
            name = m.group(1).strip() if m else None
        if m is None or name not in self.reading.tools:
            return False
        if self.reading.family is Family.JSON:
            self.args = JsonArgs()
        else:
            properties = self.reading.tools[name].get("properties") or {}
            self.args = XmlArgs(properties if isinstance(properties, Mapping) else {})
        self.keep = not self.calls or self.reading.parallel
        if not self.keep:
            log.info("parallel_tool_calls is false: a further call (%s) is dropped", name)
        self.calls += 1
        self.fed = m.end()
        self._emit(Piece("call", name))
        return True

    def _feed(self, text: str, over: bool) -> None:
        args = self.args
        assert args is not None
        if isinstance(args, XmlArgs):
            args.feed(text, over)
        else:
            args.feed(text)
        self._emit(Piece("arguments", args.take()))
        if not over:
            return
        self._emit(Piece("arguments", args.close()))
        tail = args.rest.strip() if isinstance(args, JsonArgs) else args.buf.strip()
        if args.broken or (isinstance(args, JsonArgs) and tail != "}"):
            log.warning(
                "a tool call's text stops fitting its form (%s): its arguments are those read before",
                args.broken or f"{tail[:80]!r} after the arguments",
            )

    def _emit(self, piece: Piece) -> None:
        if self.keep and (piece.text or piece.kind == "call"):
            self.out.append(piece)

    def _whole_call(self, block: str) -> None:
        call = parse_call(block, self.reading)
        if call is None:
            log.warning("a tool call that does not parse stays text: %r", block[:200])
            self.space = self.before
            self._content(block)
            return
        if self.calls and not self.reading.parallel:
            log.info("parallel_tool_calls is false: a further call (%s) is dropped", call.name)
        else:
            self.out.append(Piece("call", call.name))
            self.out.append(Piece("arguments", json.dumps(call.arguments, ensure_ascii=False)))
        self.calls += 1
        self.fresh, self.space = True, ""


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
            name, arguments = xml_call(inner, reading.tools)
        else:
            name, arguments = json_call(inner)
    except ValueError as e:
        log.debug("tool call not read: %s", e)
        return None
    if name not in reading.tools:
        log.warning("the model called %r, a tool it was not offered", name)
        return None
    return ToolCall(name, arguments)
