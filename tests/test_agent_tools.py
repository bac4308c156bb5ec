"""Tools and thinking in `swarm serve`'s /v1/chat/completions, driven by the official `openai` client: tools and
earlier turns rendered by the model's own template, chat_template_kwargs, reasoning_content apart (whole and
streamed), the 400s naming the field, and the tool-call deltas as the client's stream helpers accumulate them."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk
from test_serve import KEY, MODEL, MODEL_ID, Server

from swarm.coordinator.serve.openai_answer import Answer
from swarm.coordinator.serve.openai_tools import ChunkStream, template_messages
from swarm.coordinator.text.chat import ChatTemplate
from swarm.coordinator.text.tokenizer import GGUFTokenizer
from swarm.coordinator.text.tools import Family, Reading, ToolCall, call_text, read_answer
from swarm.sharding.gguf_io import open_gguf, read_metadata

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                # bounded, so that a random model's call ends within a few dozen tokens
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "now", "parameters": {"type": "object", "properties": {}}},
    },
]
ASK = [{"role": "user", "content": "Weather in Paris for 2 days?"}]
CALLED = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_7",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
        }
    ],
}
RESULT = {"role": "tool", "tool_call_id": "call_7", "content": '{"sky": "clear"}'}
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 16}


def test_tool_call_deltas_accumulate_in_the_openai_clients_stream_state() -> None:
    """The chunks a streamed answer with text and two calls becomes, fed to the client's own accumulator (what
    `client.chat.completions.stream` runs): the final message has the content, reasoning and both calls."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    reading = Reading(Family.QWEN_XML, schemas, thinks=True, opened="<think>\n")
    text = (
        "Two tools.\n</think>\n\nLooking.\n\n"
        + call_text(Family.QWEN_XML, "get_weather", {"city": "Paris", "days": 2})
        + "\n"
        + call_text(Family.QWEN_XML, "now", {})
    )
    answer = Answer("chatcmpl-1", 0, True, "m", False, 0.0)
    cuts = [[text[i : i + 1] for i in range(len(text))], [text[i : i + 7] for i in range(0, len(text), 7)]]
    cuts += [[text[:i], text[i:]] for i in range(len(text) + 1)]  # split in two at every character
    for parts in cuts:
        chunks = ChunkStream(answer, _request(reading))
        events = [e for part in parts for e in chunks.events(part)]
        last, reason = chunks.end("stop")
        assert reason == "tool_calls"
        state = ChatCompletionStreamState(input_tools=TOOLS)
        for e in [answer.role_event(), *events, *last, answer.event(None, reason)]:
            state.handle_chunk(ChatCompletionChunk.model_validate(json.loads(e[len(b"data: ") :])))
        final = state.get_final_completion().choices[0]
        assert final.finish_reason == "tool_calls"
        assert final.message.content == "Looking."
        assert final.message.model_extra["reasoning_content"] == "Two tools."
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls]
        assert calls == [("get_weather", {"city": "Paris", "days": 2}), ("now", {})]
        assert len({c.id for c in final.message.tool_calls}) == 2
        if len(parts) == len(text):  # one character at a time: the arguments come in pieces as written
            bodies = [json.loads(e[len(b"data: ") :])["choices"][0]["delta"] for e in events]
            pieces = [d["tool_calls"][0]["function"]["arguments"] for d in bodies if "tool_calls" in d]
            assert pieces[0] == "" and len(pieces) > 6
            assert "".join(pieces) == '{"city": "Paris", "days": 2}{}'


def _request(reading: Reading) -> Any:
    from swarm.coordinator.serve.openai_tools import ToolRequest

    return ToolRequest("auto", None, TOOLS, True, reading)


def test_the_chat_templates_arguments_are_a_mapping() -> None:
    got = template_messages([*ASK, CALLED, RESULT])
    assert got[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 2}
    assert CALLED["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris", "days": 2}'  # not changed


# ---- a real server ----


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    s = Server(tmp_path_factory.mktemp("agent"), "--local", "--parallel", "4", "--ctx-size", "4096",
               "--api-key", KEY)  # fmt: skip
    yield s
    assert s.stop() == 0, s.proc.log_tail()


@pytest.fixture(scope="module")
def rendered() -> Any:
    """The prompt's token count as the fixture's own template renders a conversation (tools as given)."""
    tokenizer = GGUFTokenizer(read_metadata(open_gguf(MODEL)))
    template = ChatTemplate.from_tokenizer(tokenizer)

    def count(messages: list[dict], **variables: Any) -> int:
        text = template.render(template_messages(messages), add_generation_prompt=True, **variables)
        return len(tokenizer.encode(text, parse_special=True))

    return count


@pytest.mark.slow
def test_tools_and_earlier_turns_are_rendered_by_the_models_template(server: Server, rendered: Any) -> None:
    """An agent's second turn (its call, the tool's result) is answered, not a 500, and the prompt is the template's
    own rendering of it with the tools; tool_choice none tells the model of no tools."""
    c = server.client()
    turn = [*ASK, CALLED, RESULT]
    r = c.chat.completions.create(model=MODEL_ID, messages=turn, tools=TOOLS, **GREEDY)  # type: ignore[arg-type]
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == rendered(turn, tools=TOOLS)
    none = c.chat.completions.create(model=MODEL_ID, messages=turn, tools=TOOLS, tool_choice="none", **GREEDY)  # type: ignore[arg-type]
    assert none.usage.prompt_tokens == rendered(turn) < r.usage.prompt_tokens
    # chat_template_kwargs reach the template: no thinking, an empty block pre-filled
    quiet = c.chat.completions.create(
        model=MODEL_ID,
        messages=ASK,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        **GREEDY,
    )  # type: ignore[arg-type]
    assert quiet.usage.prompt_tokens == rendered(ASK, enable_thinking=False) > rendered(ASK)
    assert quiet.choices[0].message.model_extra.get("reasoning_content") is None


@pytest.mark.slow
def test_reasoning_apart_whole_and_streamed(server: Server) -> None:
    """The template opens <think>: the answer's thinking comes as reasoning_content, whole and streamed alike, and
    reasoning_format none leaves it in content as the model wrote it."""
    c = server.client()
    raw = c.chat.completions.create(
        model=MODEL_ID, messages=ASK, extra_body={"reasoning_format": "none"}, **GREEDY
    )  # type: ignore[arg-type]
    text = raw.choices[0].message.content
    assert text.startswith("<think>\n")
    want = read_answer(text[len("<think>\n") :], Reading(thinks=True, opened="<think>\n"))
    whole = c.chat.completions.create(model=MODEL_ID, messages=ASK, **GREEDY)  # type: ignore[arg-type]
    message = whole.choices[0].message
    assert (message.model_extra.get("reasoning_content") or "", message.content) == (
        want.reasoning,
        want.content,
    )
    assert want.reasoning  # the random model thinks for a while before any </think>
    streamed = {"content": "", "reasoning_content": ""}
    for chunk in c.chat.completions.create(model=MODEL_ID, messages=ASK, stream=True, **GREEDY):  # type: ignore[arg-type]
        for choice in chunk.choices:
            streamed["content"] += choice.delta.content or ""
            streamed["reasoning_content"] += (choice.delta.model_extra or {}).get("reasoning_content") or ""
    assert streamed == {"content": want.content, "reasoning_content": want.reasoning}


BAD: list[tuple[dict[str, Any], str, str]] = [
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "nope",
    ),
    ({"tool_choice": "required"}, "tool_choice", "no 'tools'"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "one of"),
    ({"tools": {"get_weather": {}}}, "tools", "a list"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools", "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "type 'function'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools", "parameters"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "named twice"),
    # a forced call's grammar is built from the parameters: ones a JSON schema never holds are the client's error
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": 5}}}],
      "tool_choice": "required"}, "tools", "'required' must be a list"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": ["a"]}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools", "'properties' must be an object"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "template variables"),
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs", "an object"),
    ({"reasoning_format": "hidden"}, "reasoning_format", "one of"),
]
BAD_TURNS: list[tuple[list[dict[str, Any]], str]] = [
    ([*ASK, CALLED, {"role": "tool", "content": "x"}], "messages[2].tool_call_id"),
    ([*ASK, CALLED, {**RESULT, "tool_call_id": "call_9"}], "answers no call"),
    ([*ASK, {**CALLED, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{x"}}]}, RESULT],
     "messages[1].tool_calls[0].function.arguments is not JSON"),
    ([*ASK, {**CALLED, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "[1]"}}]}, RESULT],
     "a JSON object"),
    ([*ASK, {**CALLED, "tool_calls": [{"function": {"arguments": "{}"}}]}, RESULT], "messages[1].tool_calls[0]"),
    ([*ASK, {**CALLED, "tool_calls": {"id": "x"}}, RESULT], "must be a list"),
]  # fmt: skip


@pytest.mark.slow
def test_bad_tools_and_tool_turns_are_400s_naming_the_field(server: Server) -> None:
    for extra, param, says in BAD + [({"messages": m}, "messages", s) for m, s in BAD_TURNS]:
        body = {"model": MODEL_ID, "messages": ASK, "max_tokens": 4, **extra}
        status, err, _ = server.raw("/v1/chat/completions", json.dumps(body).encode())
        assert status == 400, (extra, err)
        assert err["error"]["param"] == param and says in err["error"]["message"], (extra, err)
    # the official client's shape of the same
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(
            model=MODEL_ID,
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "x"}},
        )  # type: ignore[arg-type]
    assert e.value.body["param"] == "tool_choice"
    ok = server.client().chat.completions.create(model=MODEL_ID, messages=[*ASK, CALLED, RESULT], **GREEDY)  # type: ignore[arg-type]
    assert ok.choices[0].message.role == "assistant"


def test_a_call_read_back_as_the_client_sends_it_again() -> None:
    """A call as the answer gives it (arguments as JSON text) goes back into the template as the mapping the
    template reads, and the template writes the same call text the parser read it from."""
    text = call_text(Family.QWEN_XML, "get_weather", {"city": "Paris", "days": 2})
    got = read_answer(text, Reading(Family.QWEN_XML, {"get_weather": TOOLS[0]["function"]["parameters"]}))
    assert got.calls == [ToolCall("get_weather", {"city": "Paris", "days": 2})]
    sent = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps(got.calls[0].arguments)}}]}  # fmt: skip
    template = ChatTemplate(read_metadata(open_gguf(MODEL))["tokenizer.chat_template"])
    prompt = template.render(
        template_messages([*ASK, sent, {**RESULT, "tool_call_id": "call_1"}]), tools=TOOLS
    )
    assert text in prompt


@pytest.mark.parametrize("family", ["qwen35", "qwen3", "chatml"])
def test_a_jobs_reading_follows_its_template(family: str) -> None:
    """The chat job of an agent's second turn, for each kind of template: the earlier call written in the
    template's own form, the tools in the prompt, and the answer read in that family's form."""
    from test_tools import QWEN3_STYLE

    from swarm.coordinator.serve.api_error import ApiError
    from swarm.coordinator.serve.openai_request import JobReader
    from swarm.coordinator.text.chat import CHATML_TEMPLATE

    tokenizer = GGUFTokenizer(read_metadata(open_gguf(MODEL)))
    source = {"qwen35": tokenizer.chat_template, "qwen3": QWEN3_STYLE, "chatml": CHATML_TEMPLATE}[family]
    jobs = JobReader(tokenizer, ChatTemplate(source), 4096)
    body = {"model": MODEL_ID, "messages": [*ASK, CALLED, RESULT], "tools": TOOLS}
    job = jobs.chat_job(body)
    prompt = tokenizer.decode(job.prompt)
    reading = job.tools.reading
    want = {"qwen35": Family.QWEN_XML, "qwen3": Family.JSON, "chatml": Family.NONE}[family]
    assert reading.family is want and reading.opened == ("<think>\n" if family == "qwen35" else "")
    if want is not Family.NONE:
        assert call_text(want, "get_weather", {"city": "Paris", "days": 2}) in prompt
        assert '"name": "now"' in prompt  # the tools, as the template lists them
        none = jobs.chat_job({**body, "tool_choice": "none"})
        assert none.tools.reading.family is Family.NONE and '"name": "now"' not in tokenizer.decode(
            none.prompt
        )
    else:
        with pytest.raises(ApiError) as e:
            jobs.chat_job({**body, "tool_choice": "required"})
        assert e.value.param == "tool_choice" and "no tool-call format" in e.value.message


# ---- an agent's turns, in process and through nodes ----


# the client's stream helper takes only strict tools (it parses their arguments)
STRICT = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
# the call the grammar makes the answer (get_weather: arguments to type and compare); at once, not after a random
# model's free thinking
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}
CALL: dict[str, Any] = {"temperature": 0, "max_tokens": 120, "extra_body": {"chat_template_kwargs": {
    "enable_thinking": False}}}  # fmt: skip


def turns(c: openai.OpenAI) -> list[Any]:
    """An agent's conversation with the server: tools offered (a named one: the grammar makes the answer its call), the
    call sent back as the client got it with the tool's result, and the next answer; whole and streamed (the
    client's stream helper). Everything the answers hold but the calls' random ids."""
    out: list[Any] = []
    messages: list[Any] = list(ASK)
    first = c.chat.completions.create(
        model=MODEL_ID, messages=messages, tools=STRICT, tool_choice=NAMED, **CALL
    )  # type: ignore[arg-type]
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.tool_calls, first
    with c.chat.completions.stream(
        model=MODEL_ID, messages=messages, tools=STRICT, tool_choice=NAMED, **CALL
    ) as s:  # type: ignore[arg-type]
        streamed = s.get_final_completion().choices[0].message
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in streamed.tool_calls] == calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for name, args in calls:
        jsonschema.validate(args, schemas[name])
    assert [name for name, _ in calls] == ["get_weather"] and "city" in calls[0][1]
    out += [
        calls,
        message.content,
        message.model_extra.get("reasoning_content"),
        first.usage.completion_tokens,
    ]
    messages.append(message.model_dump(exclude_none=True))  # sent back as the client got it
    for t in message.tool_calls:
        messages.append(
            {"role": "tool", "tool_call_id": t.id, "content": json.dumps({"sky": "clear", "c": 21})}
        )
    second = c.chat.completions.create(model=MODEL_ID, messages=messages, tools=STRICT, **GREEDY)  # type: ignore[arg-type]
    reply = second.choices[0].message
    out += [reply.content, reply.model_extra.get("reasoning_content"), second.usage.prompt_tokens]
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    return out


@pytest.mark.slow
def test_an_agent_loop_in_process_and_through_three_nodes(server: Server, tmp_path: Any) -> None:
    from conftest import node_swarm

    here = turns(server.client())
    with node_swarm(MODEL, tmp_path, ["0-2", "3-5", "6-7"]) as (shard, peers):
        s = Server(tmp_path, "--no-mdns", *peers, "--parallel", "2", "--model-id", MODEL_ID, source=shard)
        try:
            assert turns(s.client(key="-")) == here
        finally:
            assert s.stop() == 0
