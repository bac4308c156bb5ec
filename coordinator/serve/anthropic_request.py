"""An Anthropic Messages request, checked and put in the OpenAI chat form JobReader reads (openai_request.py),
so both APIs make the same Job: the same template rendering, tools, sampling and decode core.

system → a system message; text blocks → text; image blocks → image_url parts (data: URLs); an assistant's
tool_use blocks → its tool_calls, its thinking blocks → reasoning_content; a user's tool_result blocks → tool
messages; tools' input_schema → function parameters; tool_choice auto/any/tool/none → auto/required/a named
function/none; stop_sequences → stop; thinking {"type": "disabled"} → enable_thinking false for the template;
output_config.format (a JSON schema) → response_format json_schema; swarm's own seed and grammar as they are.
Whatever is wrong raises ApiError naming the field (anthropic.py answers it in Anthropic's error shape).
"""

from __future__ import annotations

import json
from typing import Any

from swarm.coordinator.serve.api_error import ApiError
from swarm.coordinator.serve.openai_request import MAX_STOPS

ROLES = ("user", "assistant")


def openai_body(body: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI chat body that asks for what the Anthropic `body` asks for."""
    limit = body.get("max_tokens")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ApiError(400, "max_tokens: a positive integer is required", param="max_tokens")
    # thinking comes back apart, in thinking blocks, whatever the server's --reasoning-format
    out = {"model": body.get("model"), "max_tokens": limit, "reasoning_format": "deepseek"}
    out.update(sampling(body), **tools(body), **output(body))
    out["messages"] = system(body.get("system")) + messages(body.get("messages"))
    return out


# Words of the OpenAI chat form that JobReader's errors may name, and the Anthropic request's words for them.
OPENAI_WORDS = (
    ("response_format", "output_config.format"),
    (".function.parameters", ".input_schema"),
    (".function.name", ".name"),
    ("a tool's parameters schema", "a tool's input_schema"),
    ("the parameters schema of", "the input_schema of"),
)


def in_anthropic_words(e: ApiError) -> ApiError:
    """An error JobReader raised reading the OpenAI form of an Anthropic request, naming the field as the client
    sent it (output_config.format, not response_format; a tool's input_schema and name, not its function's)."""
    message, param = e.message, e.param
    for theirs, ours in OPENAI_WORDS:
        message = message.replace(theirs, ours)
        param = ours if param == theirs else param
    return ApiError(e.status, message, e.kind, param, e.code, e.headers)


def prompt_body(body: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI chat body of a count_tokens request (no max_tokens: only the prompt counts)."""
    return openai_body({**body, "max_tokens": 1})


def sampling(body: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, hi in (("temperature", 1.0), ("top_p", 1.0)):
        v = body.get(name)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= hi:
                raise ApiError(400, f"{name}: a number in [0, {hi:g}]", param=name)
            out[name] = v
    # top_k is Anthropic's; seed and llama-server's grammar (GBNF or Lark, holding the whole answer) are swarm's, as
    # in the OpenAI API (JobReader checks all three)
    for name in ("top_k", "seed", "grammar"):
        if body.get(name) is not None:
            out[name] = body[name]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ApiError(400, "stop_sequences: a list of non-empty strings", param="stop_sequences")
        if len(stops) > MAX_STOPS:
            raise ApiError(400, f"stop_sequences: at most {MAX_STOPS} here", param="stop_sequences")
        out["stop"] = stops
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled", "adaptive"):
            raise ApiError(400, "thinking.type: 'enabled', 'adaptive' or 'disabled'", param="thinking")
        out["chat_template_kwargs"] = {"enable_thinking": kind != "disabled"}
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise ApiError(400, "metadata: an object", param="metadata")
    return out


def output(body: dict[str, Any]) -> dict[str, Any]:
    """Structured output (output_config.format, or the beta's output_format) as a json_schema response_format:
    the text held to the schema by the grammar."""
    config, fmt = body.get("output_config"), body.get("output_format")
    if config is not None:
        if not isinstance(config, dict):
            raise ApiError(400, "output_config: an object", param="output_config")
        fmt = config.get("format", fmt)
    if fmt is None:
        return {}
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or not isinstance(fmt.get("schema"), dict)
    ):
        raise ApiError(
            400, "output_config.format: {'type': 'json_schema', 'schema': {...}}", param="output_config"
        )
    return {
        "response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    }


def system(given: Any) -> list[dict[str, Any]]:
    """The system message of `system`: a string, or a list of text blocks (joined by blank lines)."""
    if given is None or given == "" or given == []:
        return []
    if isinstance(given, str):
        return [{"role": "system", "content": given}]
    if not isinstance(given, list):
        raise ApiError(400, "system: a string or a list of text blocks", param="system")
    texts = []
    for i, block in enumerate(given):
        if (
            not isinstance(block, dict)
            or block.get("type") != "text"
            or not isinstance(block.get("text"), str)
        ):
            raise ApiError(
                400, f"system[{i}]: a text block ({{'type': 'text', 'text': ...}})", param="system"
            )
        texts.append(block["text"])
    return [{"role": "system", "content": "\n\n".join(texts)}]


def messages(given: Any) -> list[dict[str, Any]]:
    if not isinstance(given, list) or not given:
        raise ApiError(400, "messages: a non-empty list of {role, content} objects", param="messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(given):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}].role: 'user' or 'assistant'", param="messages")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
        elif isinstance(content, list):
            out += (assistant if m["role"] == "assistant" else user)(content, f"messages[{i}]")
        else:
            raise ApiError(400, f"messages[{i}].content: a string or a list of blocks", param="messages")
    if given[-1].get("role") == "assistant":
        raise ApiError(400, f"messages[{len(given) - 1}]: the last turn must be the user's (an assistant turn "
                       "to continue, a prefill, is not read here)", param="messages")  # fmt: skip
    return out


def user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """A user turn's blocks: tool_result blocks become tool messages (in place), the rest one user message."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _kind(block, at, ("text", "image", "tool_result"))
        if kind == "tool_result":
            if parts:
                out.append({"role": "user", "content": parts})
                parts = []
            out.append(tool_result(block, at))
        else:
            parts.append(part(block, at))
    if parts:
        out.append({"role": "user", "content": parts})
    return out


def assistant(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """An assistant turn's blocks: its text, its thinking as reasoning_content, its tool_use as tool_calls."""
    texts, thoughts, calls = [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _kind(block, at, ("text", "thinking", "redacted_thinking", "tool_use"))
        if kind == "text":
            texts.append(_text(block, "text", at))
        elif kind == "thinking":
            thoughts.append(_text(block, "thinking", at))
        elif kind == "tool_use":
            name, args = block.get("name"), block.get("input")
            if not isinstance(name, str) or not name or not isinstance(args, dict):
                raise ApiError(
                    400, f"{at}: a tool_use block needs a 'name' and an 'input' object", param="messages"
                )
            tool_id = block.get("id")
            if not isinstance(tool_id, str) or not tool_id:
                raise ApiError(400, f"{at}.id: a tool_use block needs its id", param="messages")
            calls.append({"id": tool_id, "type": "function", "function": {"name": name, "arguments": args}})
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thoughts:
        message["reasoning_content"] = "\n\n".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return [message]


def tool_result(block: dict[str, Any], at: str) -> dict[str, Any]:
    tool_id = block.get("tool_use_id")
    if not isinstance(tool_id, str) or not tool_id:
        raise ApiError(400, f"{at}.tool_use_id: the id of the tool_use block it answers", param="messages")
    content = block.get("content", "")
    if isinstance(content, list):  # text (and image) blocks
        content = [part(b, f"{at}.content[{k}]") for k, b in enumerate(content)]
        if all(p["type"] == "text" for p in content):
            content = "".join(p["text"] for p in content)
    elif not isinstance(content, str):
        raise ApiError(400, f"{at}.content: a string or a list of text blocks", param="messages")
    return {"role": "tool", "tool_call_id": tool_id, "content": content}


def part(block: Any, at: str) -> dict[str, Any]:
    """A text or image block as an OpenAI content part."""
    if _kind(block, at, ("text", "image")) == "text":
        return {"type": "text", "text": _text(block, "text", at)}
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not media.startswith("image/") or not isinstance(data, str):
            raise ApiError(
                400, f"{at}.source: base64 needs 'media_type' (image/...) and 'data'", param="messages"
            )
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if kind == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise ApiError(400, f"{at}.source: {{'type': 'base64', 'media_type', 'data'}} or {{'type': 'url', 'url'}}",
                   param="messages")  # fmt: skip


def tools(body: dict[str, Any]) -> dict[str, Any]:
    """tools and tool_choice in OpenAI's form (JobReader renders and enforces them)."""
    given, choice = body.get("tools"), body.get("tool_choice")
    out: dict[str, Any] = {}
    names = []
    if given is not None:
        if not isinstance(given, list):
            raise ApiError(400, "tools: a list of {name, description, input_schema}", param="tools")
        functions = []
        for i, t in enumerate(given):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
                raise ApiError(400, f"tools[{i}].name: each tool needs a name", param="tools")
            if t.get("type", "custom") != "custom" or not isinstance(t.get("input_schema"), dict):
                raise ApiError(400, f"tools[{i}].input_schema: an object (a JSON schema); only custom tools run "
                               "here, not Anthropic's server tools", param="tools")  # fmt: skip
            description = t.get("description", "")
            if not isinstance(description, str):
                raise ApiError(400, f"tools[{i}].description: a string", param="tools")
            names.append(t["name"])
            functions.append({"type": "function", "function": {"name": t["name"], "description": description,
                              "parameters": t["input_schema"]}})  # fmt: skip
        if functions:
            out["tools"] = functions
    if choice is None:
        return out
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise ApiError(400, "tool_choice.type: 'auto', 'any', 'tool' or 'none'", param="tool_choice")
    if kind in ("any", "tool") and not names:
        raise ApiError(400, f"tool_choice: '{kind}' needs tools", param="tool_choice")
    if kind == "tool":
        name = choice.get("name")
        if name not in names:
            raise ApiError(400, f"tool_choice.name: {name!r} is none of the tools ({', '.join(names)})",
                           param="tool_choice")  # fmt: skip
        out["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    if choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    return out


def _kind(block: Any, at: str, allowed: tuple[str, ...]) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in allowed:
        raise ApiError(400, f"{at}.type: {json.dumps(kind)} is not a block here ({', '.join(allowed)})",
                       param="messages")  # fmt: skip
    return kind


def _text(block: dict[str, Any], field: str, at: str) -> str:
    text = block.get(field)
    if not isinstance(text, str):
        raise ApiError(400, f"{at}.{field}: a string", param="messages")
    return text
