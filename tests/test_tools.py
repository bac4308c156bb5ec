"""Tool calls and thinking read back from an answer's text (coordinator/text/tools.py): each family's parser on the
exact text its template writes, streamed split at every character, mixed with text, several calls, malformed ones."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import gguf
import pytest
from conftest import FIXTURES

from swarm.coordinator.text.call_stream import typed_value
from swarm.coordinator.text.chat import CHATML_TEMPLATE, ChatTemplate
from swarm.coordinator.text.tools import (
    AnswerReader,
    ChatFormat,
    Family,
    Reading,
    ToolCall,
    call_format,
    call_text,
    collect,
    read_answer,
    thinking_opened,
)


def fixture_template() -> str:
    """The real Qwen3.5 template every fixture GGUF carries."""
    reader = gguf.GGUFReader(FIXTURES / "qwen35moe-tiny" / "model-f32.gguf")
    return reader.fields["tokenizer.chat_template"].contents()


# Qwen3 / Qwen3-Next's own template (the JSON form of calls, in <tool_call>), as Qwen3-0.6B carries it: the fixture
# GGUFs all carry Qwen3.5's.
QWEN3_STYLE = (Path(__file__).parent / "fixtures" / "templates" / "qwen3.jinja").read_text()

TOOLS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "metric": {"type": "boolean"},
            "where": {"type": "object"},
            "hours": {"type": "array"},
            "zip": {"type": "string"},
            "scale": {"type": "number"},
            "note": {"type": ["string", "null"]},
        },
    },
    "write_file": {"type": "object", "properties": {"path": {"type": "string"}, "text": {"type": "string"}}},
}
ARGS = {"city": "Paris", "days": 3, "where": {"lat": 48.8, "lon": 2.3}, "hours": [9, 12], "zip": "75001"}
WRITE = {"path": "a.xml", "text": "<a>\n  </parameter> inside\n</a>\n"}


def openai_calls(*calls: tuple[str, dict]) -> list[dict]:
    return [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(calls)
    ]


def assistant_text(template: str, message: dict) -> str:
    """What the template writes for an assistant turn after a user's question: the model's own words, from
    after the generation prompt to <|im_end|>."""
    messages = [{"role": "user", "content": "Weather?"}, message]
    full = ChatTemplate(template).render(messages, add_generation_prompt=False)
    turn = full[full.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n") :]
    assert turn.endswith("<|im_end|>\n")
    return turn[: -len("<|im_end|>\n")]


def every_split(text: str, reading: Reading) -> list:
    """The answer read with the text cut in two at every place, and one character at a time."""
    outs = []
    for i in range(len(text) + 1):
        r = AnswerReader(reading)
        outs.append(collect(r.push(text[:i]) + r.push(text[i:]) + r.finish()))
    r = AnswerReader(reading)
    outs.append(collect([p for ch in text for p in r.push(ch)] + r.finish()))
    return outs


def reading_for(fmt: ChatFormat, opened: str = "", **kw: object) -> Reading:
    return Reading(fmt.family, TOOLS, fmt.thinks, opened=opened, **kw)  # type: ignore[arg-type]


def test_families_are_chosen_from_the_templates_text() -> None:
    assert ChatFormat.of_template(fixture_template()) == ChatFormat(Family.QWEN_XML, True)
    assert ChatFormat.of_template(QWEN3_STYLE) == ChatFormat(Family.JSON, True)
    assert ChatFormat.of_template(CHATML_TEMPLATE) == ChatFormat(Family.NONE, False)
    assert call_format(Family.NONE) is None
    assert call_format(Family.QWEN_XML).start == "<tool_call>\n"


@pytest.mark.parametrize("thinking", [True, False])
def test_qwen35_calls_as_the_template_writes_them(thinking: bool) -> None:
    """The real Qwen3.5 template's assistant turn (reasoning, text, two calls) read back, however it streams."""
    template = fixture_template()
    message = {
        "role": "assistant",
        "content": "Let me look.",
        "reasoning_content": "The user wants weather." if thinking else "",
        "tool_calls": openai_calls(("get_weather", ARGS), ("write_file", WRITE)),
    }
    text = assistant_text(template, message)
    assert text.startswith("<think>\n") and "<function=get_weather>\n<parameter=city>\nParis\n" in text
    # the prompt opened <think>: the model's answer starts inside it
    prompt = ChatTemplate(template).render([{"role": "user", "content": "Weather?"}])
    opened = thinking_opened(prompt)
    assert opened == "<think>\n"
    answer = text[len(opened) :]
    reading = reading_for(ChatFormat.of_template(template), opened)
    want = read_answer(answer, reading)
    assert want.content == "Let me look."
    assert want.reasoning == ("The user wants weather." if thinking else "")
    assert want.calls == [ToolCall("get_weather", ARGS), ToolCall("write_file", WRITE)]
    assert all(got == want for got in every_split(answer, reading))


def test_qwen3_json_calls_as_the_template_writes_them() -> None:
    message = {
        "role": "assistant",
        "content": "Checking.",
        "reasoning_content": "Two calls.",
        "tool_calls": openai_calls(("get_weather", {"city": "Oslo", "days": 2}), ("write_file", WRITE)),
    }
    text = assistant_text(QWEN3_STYLE, message)
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>' in text
    )
    reading = reading_for(ChatFormat.of_template(QWEN3_STYLE))  # the model opens <think> itself
    want = read_answer(text, reading)
    assert (want.content, want.reasoning) == ("Checking.", "Two calls.")
    assert want.calls == [ToolCall("get_weather", {"city": "Oslo", "days": 2}), ToolCall("write_file", WRITE)]
    assert all(got == want for got in every_split(text, reading))


@pytest.mark.parametrize("family", [Family.QWEN_XML, Family.JSON])
def test_call_text_is_what_the_parser_reads_and_the_template_writes(family: Family) -> None:
    """call_format/call_text, the form B's grammar forces, read back whole; for the XML family byte for byte the
    template's own rendering of the same call."""
    args = {"city": "Rome", "days": 4, "where": {"lat": 1}}
    text = call_text(family, "get_weather", args)
    got = read_answer(text, Reading(family, TOOLS))
    assert got.calls == [ToolCall("get_weather", args)] and got.content == ""
    if family is Family.QWEN_XML:
        rendered = assistant_text(
            fixture_template(),
            {"role": "assistant", "content": "", "tool_calls": openai_calls(("get_weather", args))},
        )
        assert rendered.endswith(text)


def test_text_before_and_between_calls_and_whitespace() -> None:
    reading = Reading(Family.QWEN_XML, TOOLS)
    one = call_text(Family.QWEN_XML, "get_weather", {"city": "A"})
    two = call_text(Family.QWEN_XML, "write_file", {"path": "p", "text": "x"})
    text = f"Sure, two lookups:\n\n{one}\n{two}\n"
    got = read_answer(text, reading)
    assert got.content == "Sure, two lookups:"
    assert [c.name for c in got.calls] == ["get_weather", "write_file"]
    assert all(g == got for g in every_split(text, reading))
    # without calls the content is the text as it was, trailing whitespace included
    assert read_answer("  plain\n", reading).content == "  plain\n"
    # parallel_tool_calls false keeps the first call only
    first = read_answer(text, Reading(Family.QWEN_XML, TOOLS, parallel=False))
    assert [c.name for c in first.calls] == ["get_weather"]
    # tools not offered (tool_choice none): a call is left as text
    assert read_answer(text, Reading(Family.NONE, TOOLS)).content == text


def test_streaming_holds_back_only_a_possible_tag() -> None:
    r = AnswerReader(Reading(Family.QWEN_XML, TOOLS, thinks=True))
    assert [p.text for p in r.push("Hello <b")] == ["Hello <b"]
    assert [p.text for p in r.push("> and <tool")] == ["> and"]  # " <tool" may start a call
    assert [p.text for p in r.push("box>")] == [" <toolbox>"]
    # a call: its name once its head is read, then its arguments as they come (the value's last newline held:
    # the template writes one before </parameter>)
    assert r.push(" <tool_call>\n<function=get_weather>\n") == []
    got = r.push("<parameter=city>\nX\n")
    assert [(p.kind, p.text) for p in got] == [("call", "get_weather"), ("arguments", '{"city": "X')]
    got = r.push("</parameter>\n</function>\n</tool_call>")
    assert [(p.kind, p.text) for p in got] == [("arguments", '"}')]
    assert r.finish() == []
    # reasoning streams as it comes; only what may be </think> waits
    r = AnswerReader(Reading(Family.QWEN_XML, TOOLS, thinks=True, opened="<think>\n"))
    assert [(p.kind, p.text) for p in r.push("I think </th")] == [("reasoning", "I think")]
    assert [(p.kind, p.text) for p in r.push("ink>\n\nYes.")] == [("content", "Yes.")]


def test_thinking_the_model_opens_and_reasoning_format_none() -> None:
    fmt = ChatFormat.of_template(QWEN3_STYLE)
    text = "<think>\nHmm.\n</think>\n\nHello."
    got = read_answer(text, reading_for(fmt))
    assert (got.reasoning, got.content) == ("Hmm.", "Hello.")
    # reasoning-format none: the thinking stays in the content, as written (the prompt's <think> included)
    assert read_answer(text, reading_for(fmt, split_thinking=False)).content == text
    opened = read_answer("Hmm.\n</think>\n\nHello.", reading_for(fmt, "<think>\n", split_thinking=False))
    assert opened.content == "<think>\nHmm.\n</think>\n\nHello."
    assert all(g == got for g in every_split(text, reading_for(fmt)))
    # enable_thinking false: the prompt closes the block itself, the answer is all content
    prompt = ChatTemplate(fixture_template()).render(
        [{"role": "user", "content": "x"}], enable_thinking=False
    )
    assert thinking_opened(prompt) == ""
    # a call inside the reasoning is reasoning, not a call; an answer cut inside its thinking is reasoning
    call = call_text(Family.QWEN_XML, "get_weather", {"city": "A"})
    inside = read_answer(
        f"maybe {call}\n</think>\n\nok", Reading(Family.QWEN_XML, TOOLS, True, opened="<think>")
    )
    assert inside.calls == [] and inside.reasoning.startswith("maybe <tool_call>") and inside.content == "ok"
    cut = read_answer("still thinking\n", Reading(Family.QWEN_XML, TOOLS, True, opened="<think>"))
    assert (cut.reasoning, cut.content) == ("still thinking", "")


@pytest.mark.parametrize(
    ("family", "block"),
    [
        (Family.QWEN_XML, "<tool_call>\njust words\n</tool_call>"),
        (Family.QWEN_XML, "<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>"),  # a tool not offered
        (Family.QWEN_XML, "<tool_call>\n<function=get_weather>\nstray\n</function>\n</tool_call>"),
        (Family.JSON, '<tool_call>\n{"name": "get_weather", "arguments": []}\n</tool_call>'),
        (Family.JSON, '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'),
        (Family.JSON, '<tool_call>\n{"arguments": {}}\n</tool_call>'),
        (Family.JSON, '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>'),
    ],
)
def test_a_malformed_call_stays_text_and_is_logged(
    family: Family, block: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A call whose head (an offered tool's name, its arguments begun) never comes is text."""
    reading = Reading(family, TOOLS)
    good = call_text(family, "write_file", {"path": "p", "text": "t"})
    text = f"Try: {block}\n{good}"
    with caplog.at_level(logging.WARNING, logger="swarm.coordinator.text.tools"):
        got = read_answer(text, reading)
    assert got.content == f"Try: {block}"
    assert got.calls == [ToolCall("write_file", {"path": "p", "text": "t"})]
    assert any("does not parse" in r.message for r in caplog.records)
    assert all(g == got for g in every_split(text, reading))


def test_an_answer_cut_inside_a_call() -> None:
    reading = Reading(Family.QWEN_XML, TOOLS)
    whole = "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n</function>"
    assert read_answer(whole, reading).calls == [ToolCall("get_weather", {"city": "A"})]
    assert read_answer("<tool_call>\n<function=get_wea", reading).content == "<tool_call>\n<function=get_wea"
    # the XML family also reads a call its model wrote without <tool_call>
    bare = read_answer("<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>", reading)
    assert bare.calls == [ToolCall("get_weather", {"days": 2})]
    js = Reading(Family.JSON, TOOLS)
    as_text = read_answer('<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"B\\"}"}', js)
    assert as_text.calls == [ToolCall("get_weather", {"city": "B"})]


def test_parameter_text_becomes_the_schemas_type() -> None:
    props = TOOLS["get_weather"]["properties"]
    assert typed_value("3", props["days"]) == 3
    assert typed_value("True", props["metric"]) is True  # the template writes Python's booleans
    assert typed_value("false", props["metric"]) is False
    assert typed_value('{"a": [1]}', props["where"]) == {"a": [1]}
    assert typed_value("[1, 2]", props["hours"]) == [1, 2]
    assert typed_value("007", props["zip"]) == "007"  # a string stays a string, however it looks
    assert typed_value("2.5", props["scale"]) == 2.5 and typed_value("2", props["scale"]) == 2
    assert typed_value("null", props["note"]) is None and typed_value("hi", props["note"]) == "hi"
    assert typed_value("three", props["days"]) == "three"  # not what the schema says: the tool reports it
    assert typed_value("5", None) == "5"  # a parameter the schema does not name stays text
    assert typed_value("5", {"anyOf": [{"type": "integer"}, {"type": "string"}]}) == 5
    assert typed_value("1", {"enum": ["1", "2"]}) == "1"


@pytest.mark.parametrize(
    ("family", "block", "args"),
    [
        # an unclosed parameter ends at its function's end
        (Family.QWEN_XML, "<function=get_weather>\n<parameter=city>\nA\n</function>", {"city": "A"}),
        # a value cut off by the call's end
        (Family.QWEN_XML, "<tool_call>\n<function=get_weather>\n<parameter=city>\nPa</tool_call>", {"city": "Pa"}),
        # a value cut off: the keys whose values had begun
        (Family.JSON, '{"name": "get_weather", "arguments": {"days": 2, "city": \n', {"days": 2}),
        (Family.JSON, '{"name": "get_weather", "arguments": {"city": "Pa', {"city": "Pa\n"}),
        (Family.JSON, '{"name": "get_weather", "arguments": {"hours": [1, 2, oops]}}', {"hours": [1, 2]}),
        (Family.JSON, '{"name": "get_weather", "arguments": {"days": 2}, "x": 1}', {"days": 2}),
    ],
)
def test_a_call_broken_after_its_head_keeps_the_arguments_read(
    family: Family, block: str, args: dict, caplog: pytest.LogCaptureFixture
) -> None:
    """Once its head is read a call is a call (its arguments have streamed to the client): text after that which
    stops fitting the form ends its arguments where they were, closed so that they are still JSON, and is
    logged."""
    reading = Reading(family, TOOLS)
    text = f"<tool_call>\n{block}\n</tool_call>" if family is Family.JSON else block
    with caplog.at_level(logging.WARNING, logger="swarm.coordinator.text.tools"):
        got = read_answer(text, reading)
    assert got.calls == [ToolCall("get_weather", args)] and got.content == ""
    assert all(g == got for g in every_split(text, reading))
    if family is Family.JSON:
        assert any("stops fitting" in r.message for r in caplog.records)


def streamed_arguments(text: str, reading: Reading, step: int = 1) -> tuple[list[str], list[str]]:
    """Each call's arguments as the reader gives them while `text` comes `step` characters at a time, and the
    text that had come when each piece was given."""
    r, pieces, seen = AnswerReader(reading), [], []
    for i in range(0, len(text), step):
        for p in r.push(text[i : i + step]):
            if p.kind == "arguments":
                pieces.append(p.text)
                seen.append(text[: i + step])
    pieces += [p.text for p in r.finish() if p.kind == "arguments"]
    return pieces, seen


@pytest.mark.parametrize("family", [Family.QWEN_XML, Family.JSON])
def test_arguments_stream_as_the_model_writes_them(family: Family) -> None:
    """A long string argument (a file) streams while the model writes it, not when the call ends; joined, the
    pieces are json.dumps of the arguments whatever the split."""
    body = "".join(f"line {i} </parameter> <b>\u00e9 \\ \"q\"\n" for i in range(40))
    args = {"path": "a.txt", "text": body}
    text = call_text(family, "write_file", args)
    reading = Reading(family, TOOLS)
    for step in (1, 2, 5, 17, len(text)):
        pieces, seen = streamed_arguments(text, reading, step)
        assert "".join(pieces) == json.dumps(args, ensure_ascii=False)
    pieces, seen = streamed_arguments(text, reading)
    joined = ""
    for piece, so_far in zip(pieces, seen, strict=False):
        joined += piece
        if "line 20" in joined:  # half the file is out while the call is far from its end
            assert "</tool_call>" not in so_far and "line 39" not in so_far
            break
    else:
        raise AssertionError("the file's text did not stream")


def test_json_arguments_are_written_canonically_as_they_come() -> None:
    """The JSON family's arguments as the model may write them (escapes, surrogate pairs, exponents, nesting,
    no spaces) come out as json.dumps of what they mean, however they are split."""
    raw = (
        '{"a":1e2,"b" : [true,false,null,{"c":-0.5}],"d":"\\u00e9\\ud83d\\ude00\\n\\t\\"\\\\","e":{},"f":[],'
        '"g":"caf\u00e9 \ud83d\ude00"}'
    )
    text = f'<tool_call>\n{{"name": "write_file", "arguments": {raw}}}\n</tool_call>'
    reading = Reading(Family.JSON, TOOLS)
    want = json.dumps(json.loads(raw), ensure_ascii=False)
    for step in (1, 3, len(text)):
        assert "".join(streamed_arguments(text, reading, step)[0]) == want
    assert all(g.calls == [ToolCall("write_file", json.loads(raw))] for g in every_split(text, reading))
