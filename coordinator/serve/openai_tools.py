"""Tools and thinking in OpenAI's chat API.

The request side: `tools`, `tool_choice`, `parallel_tool_calls`, the earlier turns' `tool_calls` and `role: tool`
results, `chat_template_kwargs` and `reasoning_format` checked (a 400 naming the field) and put as the model's chat
template reads them (a call's arguments as a mapping, not OpenAI's JSON text). The answer side: the text read back
(text/tools.py) into `reasoning_content`, `content` and `tool_calls`, whole or as the deltas the `openai` client's
stream helpers accumulate (index, id, type and name first, then the arguments in pieces).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from swarm.coordinator.serve.api_error import ApiError
from swarm.coordinator.serve.openai_answer import Answer, sse_data
from swarm.coordinator.text.tools import (
    AnswerReader,
    ChatFormat,
    Family,
    Piece,
    Reading,
    collect,
    thinking_opened,
)

# llama-server's --reasoning-format: none (thinking stays in content, tags and all), deepseek (apart, in
# reasoning_content), auto (the same as deepseek for the templates served here).
REASONING_FORMATS = ("none", "deepseek", "auto")
CHOICES = ("auto", "none", "required")
TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
# what the template's own variables are: chat_template_kwargs may not set them
RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request asks of tools and thinking, checked: what B's grammar reads for `required` and a
    named function (choice, named, schemas, and `reading.family`'s call_format), and how its answer is read."""

    choice: str = "auto"  # "auto", "none", "required", or "function" (the one `named`)
    named: str | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)  # the OpenAI tool objects, as given
    parallel: bool = True  # parallel_tool_calls: False keeps the answer's first call only
    reading: Reading = field(default_factory=Reading)  # how the answer's text is read (set once rendered)

    @property
    def offered(self) -> bool:
        """Whether the model is told of tools (and its calls looked for): tools given and tool_choice not none."""
        return bool(self.tools) and self.choice != "none"


@dataclass
class ChatRequest:
    """The chat's messages and the template's other variables, ready to render."""

    messages: list[dict[str, Any]]
    variables: dict[str, Any]  # tools (where offered) and chat_template_kwargs
    tools: ToolRequest
    split_thinking: bool

    def read_as(self, fmt: ChatFormat, prompt: str) -> ToolRequest:
        """The request's tools with how an answer to the rendered `prompt` is read."""
        t = self.tools
        if t.choice in ("required", "function") and fmt.family is Family.NONE:
            raise ApiError(
                400, f"tool_choice {t.choice!r}: this model's chat template teaches no tool-call format",
                param="tool_choice",
            )  # fmt: skip
        family = fmt.family if t.offered else Family.NONE
        schemas = {f["function"]["name"]: f["function"].get("parameters") or {} for f in t.tools}
        opened = thinking_opened(prompt)
        reading = Reading(family, schemas, fmt.thinks, self.split_thinking, opened, t.parallel)
        return ToolRequest(t.choice, t.named, t.tools, t.parallel, reading)


def chat_request(
    body: Mapping[str, Any], messages: list[dict[str, Any]], reasoning_format: str
) -> ChatRequest:
    """`body`'s tool and thinking fields checked, and its (plain-content) `messages` put as templates read them."""
    tools = _tools(body.get("tools"))
    choice, named = _tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ApiError(400, "'parallel_tool_calls' must be true or false", param="parallel_tool_calls")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or RESERVED & kwargs.keys():
        raise ApiError(
            400,
            "'chat_template_kwargs' must be an object of template variables (such as {\"enable_thinking\": "
            f"false}}), not setting {sorted(RESERVED)}",
            param="chat_template_kwargs",
        )
    fmt = body.get("reasoning_format", reasoning_format)
    if fmt not in REASONING_FORMATS:
        raise ApiError(
            400, f"'reasoning_format' must be one of {list(REASONING_FORMATS)}", param="reasoning_format"
        )
    request = ToolRequest(choice, named, tools, parallel)
    variables: dict[str, Any] = dict(kwargs)
    if request.offered:
        variables["tools"] = tools
    return ChatRequest(template_messages(messages), variables, request, fmt != "none")


def _tools(given: Any) -> list[dict[str, Any]]:
    if given is None:
        return []
    if not isinstance(given, list):
        raise ApiError(400, "'tools' must be a list of {type: 'function', function: {...}}", param="tools")
    names = set()
    for i, tool in enumerate(given):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ApiError(400, f"{where}: only tools of type 'function' are supported", param="tools")
        f = tool.get("function")
        if not isinstance(f, dict):
            raise ApiError(400, f"{where}.function: an object with a 'name' is required", param="tools")
        name = f.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise ApiError(400, f"{where}.function.name: letters, digits, _ . : - (1 to 128)", param="tools")
        if name in names:
            raise ApiError(400, f"{where}.function.name: {name!r} is named twice", param="tools")
        names.add(name)
        if not isinstance(f.get("description", ""), str):
            raise ApiError(400, f"{where}.function.description must be a string", param="tools")
        params = f.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise ApiError(
                400, f"{where}.function.parameters must be a JSON schema of type 'object'", param="tools"
            )
    return given


def _tool_choice(given: Any, tools: list[dict[str, Any]]) -> tuple[str, str | None]:
    if given is None:
        return "auto", None
    if isinstance(given, str):
        if given not in CHOICES:
            raise ApiError(
                400, f"'tool_choice' must be one of {list(CHOICES)} or a function", param="tool_choice"
            )
        if given == "required" and not tools:
            raise ApiError(400, "'tool_choice' is 'required' but no 'tools' are given", param="tool_choice")
        return given, None
    f = given.get("function") if isinstance(given, dict) and given.get("type") == "function" else None
    name = f.get("name") if isinstance(f, dict) else None
    if not isinstance(name, str):
        raise ApiError(
            400, "'tool_choice' must be a string or {type: 'function', function: {name}}", param="tool_choice"
        )
    offered = [t["function"]["name"] for t in tools]
    if name not in offered:
        raise ApiError(
            400,
            f"'tool_choice' names {name!r}, which is not among the tools ({offered})",
            param="tool_choice",
        )
    return "function", name


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as chat templates read them: an assistant's tool_calls with their arguments as a mapping
    (OpenAI sends JSON text), `developer` as `system`; tool calls and tool results checked."""
    out = []
    calls: set[str] = set()  # the ids the latest assistant turn's calls gave
    for i, m in enumerate(messages):
        m = dict(m)
        role = m["role"]
        if role == "developer":
            m["role"] = "system"
        elif role == "assistant":
            reasoning = m.get("reasoning_content")
            if reasoning is not None and not isinstance(reasoning, str):
                raise ApiError(400, f"messages[{i}].reasoning_content must be a string", param="messages")
            if m.get("tool_calls") is not None:
                m["tool_calls"] = [_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in _listed(m, i)]
                calls = {c["id"] for c in m["tool_calls"] if c.get("id")}
            elif "tool_calls" in m:
                del m["tool_calls"]
        elif role == "tool":
            given = m.get("tool_call_id")
            if not isinstance(given, str):
                raise ApiError(400, f"messages[{i}].tool_call_id: a string is required", param="messages")
            if calls and given not in calls:
                raise ApiError(
                    400, f"messages[{i}].tool_call_id {given!r} answers no call of the assistant turn before it "
                    f"({sorted(calls)})", param="messages",
                )  # fmt: skip
        out.append(m)
    return out


def _listed(m: dict[str, Any], i: int) -> list[tuple[int, Any]]:
    if not isinstance(m["tool_calls"], list):
        raise ApiError(400, f"messages[{i}].tool_calls must be a list", param="messages")
    return list(enumerate(m["tool_calls"]))


def _call(c: Any, where: str) -> dict[str, Any]:
    f = c.get("function") if isinstance(c, dict) else None
    if (
        not isinstance(f, dict)
        or not isinstance(f.get("name"), str)
        or c.get("type", "function") != "function"
    ):
        raise ApiError(
            400, f"{where}: {{type: 'function', function: {{name, arguments}}}} expected", param="messages"
        )
    if c.get("id") is not None and not isinstance(c["id"], str):
        raise ApiError(400, f"{where}.id must be a string", param="messages")
    args = f.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ApiError(400, f"{where}.function.arguments is not JSON ({e})", param="messages") from None
    if not isinstance(args, dict):
        raise ApiError(400, f"{where}.function.arguments must be a JSON object", param="messages")
    return {**c, "type": "function", "function": {**f, "arguments": args}}


# ---- the answer ----


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def message(text: str, reason: str, reading: Reading) -> tuple[dict[str, Any], str]:
    """The assistant message of a whole answer, and its finish_reason ('tool_calls' where it made calls)."""
    reader = AnswerReader(reading)
    got = collect(reader.push(text) + reader.finish())
    out: dict[str, Any] = {"role": "assistant", "content": got.content or (None if got.calls else "")}
    if got.reasoning:
        out["reasoning_content"] = got.reasoning
    if got.calls:
        out["tool_calls"] = [
            {
                "id": call_id(),
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
            }
            for c in got.calls
        ]
        reason = "tool_calls" if reason == "stop" else reason
    return out, reason


class DeltaStream:
    """A streamed chat answer's text turned into the deltas of its chunks: content, reasoning_content, and each
    tool call as OpenAI streams one (its index, id, type and name with empty arguments, then the arguments in
    pieces as the model writes them)."""

    def __init__(self, reading: Reading) -> None:
        self.reader = AnswerReader(reading)
        self.calls = 0

    def push(self, text: str) -> list[dict[str, Any]]:
        return self._deltas(self.reader.push(text))

    def finish(self, reason: str) -> tuple[list[dict[str, Any]], str]:
        """The last deltas, and the finish_reason ('tool_calls' where calls were made)."""
        out = self._deltas(self.reader.finish())
        return out, "tool_calls" if self.calls and reason == "stop" else reason

    def _deltas(self, pieces: list[Piece]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for p in pieces:
            if p.kind == "call":
                head = {"index": self.calls, "id": call_id(), "type": "function"}
                out.append({"tool_calls": [{**head, "function": {"name": p.text, "arguments": ""}}]})
                self.calls += 1
                continue
            if p.kind == "arguments":
                last = out[-1]["tool_calls"][0]["function"] if out and "tool_calls" in out[-1] else None
                if last is not None and "name" not in last:
                    last["arguments"] += p.text  # one delta per push: the pieces of one push together
                else:
                    out.append({"tool_calls": [{"index": self.calls - 1, "function": {"arguments": p.text}}]})
                continue
            key = "reasoning_content" if p.kind == "reasoning" else "content"
            if out and list(out[-1]) == [key]:
                out[-1][key] += p.text
            else:
                out.append({key: p.text})
        return out


class ChunkStream:
    """A streamed answer's text as the server-sent events that carry it: a chat's deltas (DeltaStream), a plain
    completion's text as it is."""

    def __init__(self, answer: Answer, tools: ToolRequest | None) -> None:
        self.answer = answer
        self.deltas = DeltaStream(tools.reading if tools else Reading()) if answer.chat else None

    def events(self, text: str) -> list[bytes]:
        if self.deltas is None:
            return [self.answer.event(text, None)] if text else []
        return self._chunks(self.deltas.push(text))

    def end(self, reason: str) -> tuple[list[bytes], str]:
        """The events the answer's end releases, and its finish_reason."""
        if self.deltas is None:
            return [], reason
        deltas, reason = self.deltas.finish(reason)
        return self._chunks(deltas), reason

    def _chunks(self, deltas: list[dict[str, Any]]) -> list[bytes]:
        """The chunks of a push's deltas; the first carries the logprobs of the tokens come since the last chunk
        (those whose text a delta holds back go with the chunk that lets it out)."""
        a = self.answer
        out = []
        for i, delta in enumerate(deltas):
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
            if a.stream_logprobs is not None:
                choice["logprobs"] = a.stream_logprobs() if i == 0 else {"content": [], "refusal": None}
            out.append(sse_data({**a.identity(a.chunk_object), "choices": [choice]}))
        return out


def whole_chat(obj: dict[str, Any], text: str, tools: ToolRequest | None) -> dict[str, Any]:
    """A whole chat completion object (openai_answer.Answer.whole) with its message read: reasoning_content,
    content and tool_calls, and finish_reason 'tool_calls' where it made calls."""
    choice = obj["choices"][0]
    choice["message"], choice["finish_reason"] = message(
        text, choice["finish_reason"], tools.reading if tools else Reading()
    )
    return obj
