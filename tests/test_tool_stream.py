"""Tool calls streamed by a real `swarm serve` to the official clients, in both call families, on the templates the
models carry: Qwen3.5's XML form (the template every fixture GGUF carries) and Qwen3 / Qwen3-Next's JSON form
(Qwen3's own template, tests/fixtures/templates/qwen3.jinja, written into a copy of the qwen3moe fixture: the
fixtures carry Qwen3.5's). A forced call's arguments come as the model writes them, in pieces, and the clients'
stream helpers put together what the whole answer holds. Also a grammar (`grammar`, llama-server's field) that
leaves no token to go on with: its own finish reason (Anthropic's endpoint: a refusal saying so), and the server
serves on."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import anthropic
import gguf
import jsonschema
import openai
import pytest
from conftest import FIXTURES
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata
from test_serve import KEY, Server

from swarm.coordinator.text.chat import ChatTemplate
from swarm.coordinator.text.tools import ChatFormat, Family, Reading, read_answer

pytestmark = pytest.mark.slow

QWEN3_TEMPLATE = Path(__file__).parent / "fixtures" / "templates" / "qwen3.jinja"
BASE = FIXTURES / "qwen3moe-tiny" / "model-f32.gguf"
PARAMETERS = {
    "type": "object",
    # bounded, so that a random model's call ends within a few dozen tokens
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1,
                   "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}  # fmt: skip
TOOLS: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS, "strict": True}}]
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}
ASK: Any = [{"role": "user", "content": "Weather in Paris for 2 days?"}]
CALL: Any = {"temperature": 0, "max_tokens": 120, "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}


def template_of(path: Path) -> str:
    return gguf.GGUFReader(path).fields["tokenizer.chat_template"].contents()


def with_template(source: Path, template: str, out: Path) -> Path:
    """A copy of a GGUF with another chat template."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch=arch, endianess=reader.endianess)
    new = {"tokenizer.chat_template": MetadataDetails(gguf.GGUFValueType.STRING, template)}
    copy_with_new_metadata(reader, writer, new, [])
    return out


def test_the_fixtures_carry_qwen35s_template_and_qwen3s_is_the_json_family() -> None:
    for model in ("qwen3next-tiny", "qwen3moe-tiny", "qwen35moe-tiny"):
        fmt = ChatFormat.of_template(template_of(FIXTURES / model / "model-f32.gguf"))
        assert fmt == ChatFormat(Family.QWEN_XML, True), model
    assert ChatFormat.of_template(QWEN3_TEMPLATE.read_text()) == ChatFormat(Family.JSON, True)


@pytest.fixture(scope="module", params=["qwen3.5-xml", "qwen3-json"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("tool-stream")
    model = BASE
    if request.param == "qwen3-json":
        model = with_template(BASE, QWEN3_TEMPLATE.read_text(), tmp / "qwen3moe-qwen3-template.gguf")
    s = Server(tmp, "--local", "--parallel", "4", "--ctx-size", "2048", "--api-key", KEY, "--model-id", "m", source=model)
    s.family = Family.JSON if request.param == "qwen3-json" else Family.QWEN_XML  # type: ignore[attr-defined]
    s.template = template_of(model)  # type: ignore[attr-defined]
    yield s
    assert s.stop() == 0, s.proc.log_tail()


def test_a_forced_calls_arguments_stream_to_the_openai_client(server: Server) -> None:
    c = server.client()
    whole = c.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=NAMED, **CALL)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, PARAMETERS)
    pieces = []
    with c.chat.completions.stream(model="m", messages=ASK, tools=TOOLS, tool_choice=NAMED, **CALL) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                pieces.append(event.arguments_delta)
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    (streamed,) = final.message.tool_calls
    assert (streamed.function.name, streamed.function.arguments) == ("get_weather", call.function.arguments)
    assert streamed.function.parsed_arguments == args  # the helper parsed a strict tool's arguments
    assert "".join(pieces) == call.function.arguments
    assert len([p for p in pieces if p]) >= 3, pieces  # as the model wrote them, not all at the call's end
    # the call as the template writes it (the model's own words) reads back as the same call
    turn = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": args}}]}  # fmt: skip
    text = ChatTemplate(server.template).render([*ASK, turn], add_generation_prompt=False)  # type: ignore[attr-defined]
    family = server.family  # type: ignore[attr-defined]
    said = text[text.rindex("<tool_call>") : text.rindex("</tool_call>") + len("</tool_call>")]
    assert ('{"name": "get_weather", "arguments": ' in said) == (family is Family.JSON)
    assert read_answer(said, Reading(family, {"get_weather": PARAMETERS})).calls[0].arguments == args


def test_a_forced_tool_use_streams_to_the_anthropic_client(server: Server) -> None:
    # the tool as the Anthropic request is put for the template (a description, no "strict"): the same prompt
    same: Any = [{"type": "function", "function": {"name": "get_weather", "description": "", "parameters": PARAMETERS}}]
    openai_call = server.client().chat.completions.create(
        model="m", messages=ASK, tools=same, tool_choice=NAMED, **CALL
    ).choices[0].message.tool_calls[0]  # fmt: skip
    c = anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0)
    kw: Any = {
        "model": "m", "max_tokens": 120, "messages": ASK, "tool_choice": {"type": "tool", "name": "get_weather"},
        "tools": [{"name": "get_weather", "input_schema": PARAMETERS}], "thinking": {"type": "disabled"},
        "extra_body": {"temperature": 0},
    }  # fmt: skip
    pieces = []
    with c.messages.stream(**kw) as stream:
        for event in stream:
            if event.type == "input_json":
                pieces.append(event.partial_json)
        message = stream.get_final_message()
    assert message.stop_reason == "tool_use"
    (block,) = [b for b in message.content if b.type == "tool_use"]
    assert block.input == json.loads(openai_call.function.arguments)
    assert "".join(pieces) == openai_call.function.arguments and len([p for p in pieces if p]) >= 3
    assert c.messages.create(**kw).content[-1].input == block.input


# a grammar whose answer is "ab" then a lexeme no text is (letters and digits at once): nothing can follow "ab"
DEAD_END = 'start: "ab" B\nB: /[a-z]+/ & /[0-9]+/\n'


def test_a_grammar_with_no_way_on_ends_with_its_reason_and_the_server_serves_on(server: Server) -> None:
    c = server.client()
    kw: Any = {"model": "m", "messages": ASK, "max_tokens": 40, "temperature": 0,
               "extra_body": {"grammar": DEAD_END, "chat_template_kwargs": {"enable_thinking": False}}}  # fmt: skip
    other: list[Any] = []
    beside = threading.Thread(
        target=lambda: other.append(c.chat.completions.create(model="m", messages=ASK, max_tokens=30))
    )
    beside.start()  # an answer decoding beside the one that dies
    dead = c.chat.completions.create(**kw).choices[0]
    beside.join(timeout=300)
    assert (dead.finish_reason, dead.message.content) == ("grammar", "ab")
    chunks = list(c.chat.completions.create(stream=True, **kw))
    assert chunks[-1].choices[0].finish_reason == "grammar"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "ab"
    assert other and other[0].usage.completion_tokens > 0  # the answer beside it went on to its end
    # a GBNF grammar as llama-server takes it, and one that does not compile
    gbnf = c.chat.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "grammar": 'root ::= "ok" [0-9]'}})
    assert gbnf.choices[0].finish_reason == "stop" and gbnf.choices[0].message.content[:2] == "ok"
    for bad in ["root ::= (", 'start: "a" & ', 7]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(**{**kw, "extra_body": {"grammar": bad}})
        assert e.value.body["param"] == "grammar", e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(**kw, tools=TOOLS, tool_choice="required")
    assert e.value.body["param"] == "grammar"
    after = c.chat.completions.create(model="m", messages=ASK, max_tokens=5)
    assert after.choices[0].finish_reason == "length"


def test_a_grammar_with_no_way_on_is_a_refusal_to_the_anthropic_client(server: Server) -> None:
    """Anthropic's API has no stop reason for a grammar's dead end: it is stop_reason "refusal" (anthropic_answer.py
    says why), with stop_details saying the grammar stopped it, whole and streamed; a grammar that ends well is
    end_turn with no details, one that does not compile a 400 in Anthropic's shape."""
    c = anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0)
    kw: Any = {"model": "m", "max_tokens": 40, "messages": ASK, "thinking": {"type": "disabled"},
               "extra_body": {"temperature": 0, "grammar": DEAD_END}}  # fmt: skip
    dead = c.messages.create(**kw)
    assert (dead.stop_reason, dead.stop_sequence, [b.type for b in dead.content]) == ("refusal", None, ["text"])
    assert dead.content[0].text == "ab"  # type: ignore[union-attr]
    details = dead.stop_details
    assert details is not None and details.type == "refusal" and details.category is None
    assert details.explanation is not None and "grammar" in details.explanation
    with c.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    texts = [(b.type, getattr(b, "text", None)) for b in streamed.content]
    assert (streamed.stop_reason, streamed.stop_details, texts) == ("refusal", details, [("text", "ab")])
    ok = c.messages.create(**{**kw, "extra_body": {"temperature": 0, "grammar": 'root ::= "ok" [0-9]'}})
    assert (ok.stop_reason, ok.stop_details) == ("end_turn", None) and ok.content[0].text[:2] == "ok"  # type: ignore[union-attr]
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(**{**kw, "extra_body": {"grammar": "root ::= ("}})
    assert e.value.body["error"]["type"] == "invalid_request_error", e.value.body  # type: ignore[index]
    assert e.value.body["error"]["message"].startswith("grammar"), e.value.body  # type: ignore[index]
