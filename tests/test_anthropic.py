"""The Anthropic Messages API of `swarm serve` (/v1/messages, /v1/messages/count_tokens): a real server process
driven by the official `anthropic` client (and raw HTTP for what the client cannot send), against the OpenAI
endpoint of the same server for the same conversation."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import anthropic
import pytest
from conftest import FIXTURES
from test_serve import KEY, MODEL, MODEL_ID, Server

from swarm.coordinator.serve.anthropic_answer import Message, Stop
from swarm.coordinator.text.chat import ChatTemplate
from swarm.coordinator.text.tokenizer import GGUFTokenizer
from swarm.coordinator.text.tools import AnswerReader, ChatFormat, Reading, call_text
from swarm.sharding.gguf_io import open_gguf, read_metadata

pytestmark = pytest.mark.slow

SYSTEM = "Be brief."
ASK = [{"role": "user", "content": "What is a list?"}]
# the official client no longer sends sampling parameters (newer Claude models take none); the API still reads
# them, as older clients and other agents send them
GREEDY: dict[str, Any] = {"extra_body": {"temperature": 0}}
TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    }
]


# a tool whose every call is short: random weights under the grammar fill an open string for ever
BOUNDED = [{**TOOLS[0], "input_schema": {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Lyon"]}, "unit": {"type": "string", "enum": ["C", "F"]}},
    "required": ["city", "unit"]}}]  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    s = Server(tmp_path_factory.mktemp("anthropic"), "--local", "--parallel", "4", "--ctx-size", "2048",
               "--api-key", KEY)  # fmt: skip
    yield s
    assert s.stop() == 0, s.proc.log_tail()


def client(s: Server, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=s.base, api_key=key, max_retries=0)


def raw(s: Server, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        s.base + path, data=body, headers={"Content-Type": "application/json", **headers}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def blocks(message: Any) -> tuple[str, str]:
    """(thinking, text) of an Anthropic message."""
    thinking = "".join(b.thinking for b in message.content if b.type == "thinking")
    return thinking, "".join(b.text for b in message.content if b.type == "text")


def openai_split(message: Any) -> tuple[str, str]:
    """(thinking, text) of an OpenAI chat message whose prompt opened a think block: its reasoning_content where
    the server gives one, else its content cut at </think>."""
    reasoning = getattr(message, "reasoning_content", None)
    if reasoning is not None:
        return reasoning.strip(), (message.content or "").strip()
    head, _, tail = message.content.partition("</think>")
    return head.strip(), tail.strip()


def test_a_message_whole_and_streamed_is_the_chat_completions_text(server: Server) -> None:
    c = client(server)
    m = c.messages.create(model=MODEL_ID, max_tokens=20, system=SYSTEM, messages=ASK, **GREEDY)  # type: ignore[arg-type]
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL_ID and m.id.startswith("msg_")
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 20
    # the fixture's chat prompt, as the OpenAI endpoint counts it (tests/test_serve.py)
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == 35
    # the template opens a think block: what the model writes before </think> is thinking
    assert m.content and m.content[0].type == "thinking"

    o = server.client().chat.completions.create(
        model=MODEL_ID, max_tokens=20, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, *ASK],  # type: ignore[list-item]
    )  # fmt: skip
    assert blocks(m) == openai_split(o.choices[0].message)
    assert o.usage is not None and o.usage.prompt_tokens == 35

    with c.messages.stream(model=MODEL_ID, max_tokens=20, system=SYSTEM, messages=ASK, **GREEDY) as s:  # type: ignore[arg-type]
        deltas = "".join(e.thinking for e in s if e.type == "thinking")
        streamed = s.get_final_message()
    assert [b.to_dict() for b in streamed.content] == [b.to_dict() for b in m.content]
    assert deltas == blocks(m)[0]
    assert streamed.stop_reason == "max_tokens" and streamed.usage.output_tokens == 20


def test_a_seeded_sampled_message_is_the_chat_completions_text(server: Server) -> None:
    sampled = {"temperature": 0.9, "top_p": 0.95, "seed": 11}
    m = client(server).messages.create(model=MODEL_ID, max_tokens=16, messages=ASK, extra_body=sampled)  # type: ignore[arg-type]
    o = server.client().chat.completions.create(model=MODEL_ID, max_tokens=16, messages=ASK, **sampled)  # type: ignore[arg-type]
    assert blocks(m) == openai_split(o.choices[0].message)
    other = client(server).messages.create(
        model=MODEL_ID, max_tokens=16, messages=ASK, extra_body={**sampled, "seed": 12}
    )  # type: ignore[arg-type]
    assert blocks(other) != blocks(m)


def test_the_stream_is_anthropics_event_sequence(server: Server) -> None:
    events = list(
        client(server).messages.create(
            model=MODEL_ID,
            max_tokens=12,
            messages=ASK,
            stream=True,
            **GREEDY,  # type: ignore[arg-type]
        )
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[0].message.content == [] and events[0].message.stop_reason is None  # type: ignore[union-attr]
    body = [k for k in kinds[1:-2] if k != "ping"]
    # each block: start, its deltas, stop; the indices count up from 0
    starts = [i for i, k in enumerate(body) if k == "content_block_start"]
    assert starts and starts[0] == 0 and body[-1] == "content_block_stop"
    assert body.count("content_block_stop") == len(starts)
    indices = [e.index for e in events if e.type == "content_block_start"]  # type: ignore[union-attr]
    assert indices == list(range(len(indices)))
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 12  # type: ignore[union-attr]


def test_stop_sequences_end_the_answer_and_are_named(server: Server) -> None:
    c = client(server)
    full = c.messages.create(model=MODEL_ID, max_tokens=32, messages=ASK, **GREEDY)  # type: ignore[arg-type]
    thinking = blocks(full)[0]
    stop = next(
        thinking[i : i + 3]
        for i in range(5, len(thinking))
        if thinking[i : i + 3].strip() == thinking[i : i + 3]
    )
    cut = c.messages.create(model=MODEL_ID, max_tokens=32, messages=ASK, stop_sequences=[stop], **GREEDY)  # type: ignore[arg-type]
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert blocks(cut)[0] == thinking[: thinking.index(stop)].rstrip()
    assert cut.usage.output_tokens < 32
    with c.messages.stream(model=MODEL_ID, max_tokens=32, messages=ASK, stop_sequences=[stop], **GREEDY) as s:  # type: ignore[arg-type]
        streamed = s.get_final_message()
    assert blocks(streamed) == blocks(cut) and streamed.stop_sequence == stop


def test_count_tokens_is_the_prompt_the_messages_read(server: Server) -> None:
    c = client(server)
    n = c.messages.count_tokens(model=MODEL_ID, system=SYSTEM, messages=ASK)  # type: ignore[arg-type]
    assert n.input_tokens == 35
    blocks_system = c.messages.count_tokens(
        model=MODEL_ID, system=[{"type": "text", "text": SYSTEM}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is a list?"}]}],
    )  # fmt: skip
    assert blocks_system.input_tokens == 35
    assert c.messages.count_tokens(model=MODEL_ID, messages=ASK).input_tokens < 35  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tokenizer() -> GGUFTokenizer:
    return GGUFTokenizer(read_metadata(open_gguf(MODEL)))


def test_tools_and_a_tool_result_turn_are_rendered_by_the_template(
    server: Server, tokenizer: GGUFTokenizer
) -> None:
    """An agent's second turn: the tools offered, the assistant's tool_use and thinking, the user's tool_result;
    the prompt is the model's template over the OpenAI form of the same conversation."""
    convo = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should look.", "signature": ""},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 2}},
        ]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ]  # fmt: skip
    openai_form = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "I should look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
    ]  # fmt: skip
    functions = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                  "parameters": t["input_schema"]}} for t in TOOLS]  # fmt: skip
    text = ChatTemplate.from_tokenizer(tokenizer).render(openai_form, tools=functions)
    assert "<tool_response>\nsunny\n</tool_response>" in text and "<parameter=city>\nParis" in text
    assert '"name": "get_weather"' in text
    expected = len(tokenizer.encode(text, parse_special=True))

    c = client(server)
    n = c.messages.count_tokens(model=MODEL_ID, system=SYSTEM, messages=convo, tools=TOOLS)  # type: ignore[arg-type]
    assert n.input_tokens == expected
    m = c.messages.create(model=MODEL_ID, max_tokens=8, system=SYSTEM, messages=convo, tools=TOOLS, **GREEDY)  # type: ignore[arg-type]
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == expected
    assert m.stop_reason in ("max_tokens", "end_turn", "tool_use")


def error_of(s: Server, body: dict[str, Any], path: str = "/v1/messages", key: str = KEY) -> tuple[int, dict]:
    return raw(s, path, json.dumps(body).encode(), {"x-api-key": key})


BASE = {"model": MODEL_ID, "max_tokens": 8, "messages": ASK}


@pytest.mark.parametrize(
    ("change", "status", "kind", "names"),
    [
        ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
        ({"max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
        ({"messages": [{"role": "user", "content": [{"type": "video", "x": 1}]}]}, 400, "invalid_request_error",
         "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "invalid_request_error",
         "messages[0].content[0].text"),
        ({"messages": [{"role": "tool", "content": "x"}]}, 400, "invalid_request_error", "messages[0].role"),
        ({"messages": [*ASK, {"role": "assistant", "content": "It is"}]}, 400, "invalid_request_error", "prefill"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]}, 400,
         "invalid_request_error", "tool_use_id"),
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, 400, "invalid_request_error",
         "tool_choice.name"),
        ({"tool_choice": {"type": "any"}}, 400, "invalid_request_error", "tool_choice"),
        ({"tools": [{"name": "x"}]}, 400, "invalid_request_error", "tools[0].input_schema"),
        ({"temperature": 1.5}, 400, "invalid_request_error", "temperature"),
        ({"stop_sequences": "x"}, 400, "invalid_request_error", "stop_sequences"),
        ({"system": [{"type": "image"}]}, 400, "invalid_request_error", "system[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64",
          "media_type": "image/png", "data": "AAAA"}}]}]}, 400, "invalid_request_error", "picture"),
        ({"output_config": {"format": {"type": "xml"}}}, 400, "invalid_request_error", "output_config.format"),
        ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object", "required": 5}}}},
         400, "invalid_request_error", "output_config.format: the schema cannot be used"),
        ({"tools": [{**TOOLS[0], "name": "no spaces"}]}, 400, "invalid_request_error", "tools[0].name"),
        ({"tools": [{**TOOLS[0], "input_schema": {"type": "array"}}]}, 400, "invalid_request_error",
         "tools[0].input_schema"),
        ({"tools": [{**TOOLS[0], "input_schema": {"type": "object", "required": 5}}],
          "tool_choice": {"type": "any"}}, 400, "invalid_request_error", "tools: the input_schema of 'get_weather'"),
        ({"model": "claude-opus"}, 404, "not_found_error", "claude-opus"),
    ],
)  # fmt: skip
def test_bad_requests_are_anthropic_errors_naming_the_field(
    server: Server, change: dict[str, Any], status: int, kind: str, names: str
) -> None:
    body = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    for stream in (False, True):
        got, err = error_of(server, {**body, "stream": stream})
        assert got == status and err["type"] == "error", err
        assert err["error"]["type"] == kind and names in err["error"]["message"], err
    if "max_tokens" not in names:  # count_tokens reads the same fields but max_tokens
        got, err = error_of(server, body, "/v1/messages/count_tokens")
        assert got == status and err["error"]["type"] == kind, err


def test_a_wrong_key_or_body_is_an_anthropic_error(server: Server) -> None:
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(server, "wrong").messages.create(model=MODEL_ID, max_tokens=4, messages=ASK)  # type: ignore[arg-type]
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError):
        client(server).messages.create(model=MODEL_ID, max_tokens=4, messages=[])
    got, err = raw(server, "/v1/messages", b"{not json", {"x-api-key": KEY})
    assert got == 400 and err["error"]["type"] == "invalid_request_error"
    # the key as a bearer token (Claude Code's ANTHROPIC_AUTH_TOKEN)
    got, m = raw(server, "/v1/messages", json.dumps(BASE).encode(), {"Authorization": f"Bearer {KEY}"})
    assert got == 200 and m["type"] == "message"
    got, err = raw(server, "/v1/messages/count_tokens", json.dumps(BASE).encode(), {})
    assert got == 401 and err["error"]["type"] == "authentication_error"


def test_the_server_serves_on_after_bad_requests(server: Server) -> None:
    m = client(server).messages.create(model=MODEL_ID, max_tokens=4, messages=ASK, **GREEDY)  # type: ignore[arg-type]
    assert m.usage.output_tokens == 4


def test_the_events_of_an_answer_with_calls_accumulate_to_its_whole_message(tokenizer: GGUFTokenizer) -> None:
    """Thinking, text and two calls in the form the fixture's template teaches, read as they stream (one
    character at a time): the official client's stream accumulator rebuilds from the events the very message
    sent whole, each call's input from its input_json_delta pieces."""
    from anthropic.lib.streaming._messages import accumulate_event

    fmt = ChatFormat.of_template(tokenizer.chat_template or "")
    assert fmt.family.value == "qwen-xml" and fmt.thinks  # Qwen3.5's template
    calls = [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Lyon"})]
    text = "I should look.\n</think>\n\nLet me check." + "".join(
        "\n\n" + call_text(fmt.family, name, args) for name, args in calls
    )
    reading = Reading(
        fmt.family, {t["name"]: t["input_schema"] for t in TOOLS}, fmt.thinks, True, "<think>\n"
    )
    reader = AnswerReader(reading)
    msg = Message(MODEL_ID, 30, 10)
    sent = [*msg.start_events()]
    for ch in text:
        sent += msg.events(reader.push(ch))
    sent += msg.events(reader.finish())
    sent += msg.end_events(Stop("tool_use"), 40)

    snapshot = None
    json_bufs: dict[int, bytes] = {}
    for e in sent:
        name, data = e.decode().removesuffix("\n\n").split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        body = json.loads(data[len("data: ") :])
        assert body["type"] == name[len("event: ") :]
        if body["type"] != "ping":
            snapshot = accumulate_event(event=body, current_snapshot=snapshot, json_bufs=json_bufs)
    assert snapshot is not None
    assert [b.to_dict() for b in snapshot.content] == msg.content
    assert [b["type"] for b in msg.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert [(b["name"], b["input"]) for b in msg.content[2:]] == calls
    assert msg.content[0]["thinking"] == "I should look." and msg.content[1]["text"] == "Let me check."
    assert snapshot.stop_reason == "tool_use" and snapshot.stop_details is None and snapshot.usage.output_tokens == 40
    assert snapshot.usage.input_tokens == 20 and snapshot.usage.cache_read_input_tokens == 10


def test_a_forced_call_is_a_tool_use_block_and_its_result_the_next_turn(server: Server) -> None:
    """tool_choice naming a tool: the grammar makes the fixture's random weights call it; the call comes back as
    a tool_use block (stop_reason tool_use), the same call the OpenAI endpoint gives, whole and streamed; the
    agent's next turn sends its tool_result back."""
    c = client(server)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    # without thinking: the grammar forces the call from the answer's first token (thinking, the random weights
    # would think past any max_tokens first)
    kw: dict[str, Any] = {"model": MODEL_ID, "max_tokens": 300, "messages": ask, "tools": BOUNDED,
                          "thinking": {"type": "disabled"}, **GREEDY}  # fmt: skip
    m = c.messages.create(tool_choice={"type": "tool", "name": "get_weather"}, **kw)
    assert m.stop_reason == "tool_use", m.content
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    assert uses[0].input["city"] in ("Paris", "Lyon") and uses[0].input["unit"] in ("C", "F")
    anyone = c.messages.create(tool_choice={"type": "any"}, **kw)  # some tool: the only one here
    assert anyone.stop_reason == "tool_use" and [b.name for b in anyone.content if b.type == "tool_use"] == [
        "get_weather"
    ]

    functions = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                  "parameters": t["input_schema"]}} for t in BOUNDED]  # fmt: skip
    o = server.client().chat.completions.create(
        model=MODEL_ID, max_tokens=300, messages=ask, tools=functions, temperature=0,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    calls = o.choices[0].message.tool_calls
    assert calls and json.loads(calls[0].function.arguments) == uses[0].input  # type: ignore[union-attr]
    assert m.usage.output_tokens == o.usage.completion_tokens  # type: ignore[union-attr]

    with c.messages.stream(tool_choice={"type": "tool", "name": "get_weather"}, **kw) as s:
        streamed = s.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "input", None)) for b in streamed.content] == [
        (b.type, getattr(b, "input", None)) for b in m.content
    ]

    after = [
        *ask,
        {"role": "assistant", "content": [b.to_dict() for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny"}]},
    ]
    n = c.messages.count_tokens(model=MODEL_ID, messages=after, tools=BOUNDED, thinking={"type": "disabled"})  # type: ignore[arg-type]
    nxt = c.messages.create(**{**kw, "messages": after, "max_tokens": 8})
    assert nxt.usage.input_tokens + (nxt.usage.cache_read_input_tokens or 0) == n.input_tokens
    assert (
        n.input_tokens
        > m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) + m.usage.output_tokens - 8
    )


def test_structured_output_is_text_that_fits_the_schema(server: Server) -> None:
    """output_config.format: the grammar holds the text to the schema (the fixture's random weights), whole and
    streamed, and the OpenAI endpoint's response_format gives the same text."""
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
              "n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["answer", "n"],
              "additionalProperties": False}  # fmt: skip
    c = client(server)
    kw: dict[str, Any] = {"model": MODEL_ID, "max_tokens": 60, "messages": ASK, "thinking": {"type": "disabled"},
                          "output_config": {"format": {"type": "json_schema", "schema": schema}}, **GREEDY}  # fmt: skip
    m = c.messages.create(**kw)
    assert [b.type for b in m.content] == ["text"] and m.stop_reason == "end_turn"
    got = json.loads(blocks(m)[1])
    assert got["answer"] in ("yes", "no") and 0 <= got["n"] <= 9 and set(got) == {"answer", "n"}
    with c.messages.stream(**kw) as s:
        assert blocks(s.get_final_message()) == blocks(m)
    o = server.client().chat.completions.create(
        model=MODEL_ID, max_tokens=60, messages=ASK, temperature=0,  # type: ignore[arg-type]
        response_format={"type": "json_schema", "json_schema": {"name": "output", "schema": schema}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    assert o.choices[0].message.content == blocks(m)[1]


VISION = FIXTURES / "qwen35moe-vision"


def test_a_picture_block_is_read_as_the_chat_completions_image(tmp_path: Path) -> None:
    """An image block (base64) is the picture an image_url data: URL gives the OpenAI endpoint: the same prompt,
    the same text."""
    s = Server(tmp_path, "--local", "--parallel", "1", "--ctx-size", "256", "--api-key", KEY,
               "--mmproj", str(VISION / "mmproj-f32.gguf"), source=VISION / "model-f32.gguf")  # fmt: skip
    try:
        data = base64.b64encode((VISION / "image_A_96x96.png").read_bytes()).decode()
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
        ask = [{"role": "user", "content": [image, {"type": "text", "text": "What do you see here?"}]}]
        m = client(s).messages.create(model="model-f32", max_tokens=8, messages=ask, **GREEDY)  # type: ignore[arg-type]
        url = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + data}}
        o = s.client().chat.completions.create(
            model="model-f32", max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": [url, {"type": "text", "text": "What do you see here?"}]}],  # type: ignore[list-item]
        )  # fmt: skip
        plain = [{"role": "user", "content": "What do you see here?"}]
        without = client(s).messages.count_tokens(model="model-f32", messages=plain).input_tokens  # type: ignore[arg-type]
        assert o.usage is not None and o.usage.prompt_tokens > without + 2  # the picture's rows and marks
        assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == o.usage.prompt_tokens
        assert blocks(m) == openai_split(o.choices[0].message)
        assert (
            client(s).messages.count_tokens(model="model-f32", messages=ask).input_tokens
            == o.usage.prompt_tokens
        )  # type: ignore[arg-type]
    finally:
        assert s.stop() == 0, s.proc.log_tail()


def test_an_answer_cut_by_the_context_says_so(tmp_path: Path) -> None:
    """max_tokens beyond what the server's context leaves: the answer runs to the context's end and says
    model_context_window_exceeded (Anthropic's reason for it); one cut by max_tokens still says max_tokens."""
    s = Server(tmp_path, "--local", "--parallel", "1", "--ctx-size", "48", "--api-key", KEY)
    try:
        c = client(s)
        m = c.messages.create(model=MODEL_ID, max_tokens=1000, messages=ASK, **GREEDY)  # type: ignore[arg-type]
        assert m.stop_reason == "model_context_window_exceeded", m
        assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) + m.usage.output_tokens == 48
        with c.messages.stream(model=MODEL_ID, max_tokens=1000, messages=ASK, **GREEDY) as stream:  # type: ignore[arg-type]
            streamed = stream.get_final_message()
        assert streamed.stop_reason == "model_context_window_exceeded" and blocks(streamed) == blocks(m)
        short = c.messages.create(model=MODEL_ID, max_tokens=3, messages=ASK, **GREEDY)  # type: ignore[arg-type]
        assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    finally:
        assert s.stop() == 0, s.proc.log_tail()
