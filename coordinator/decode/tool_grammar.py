"""The grammar of an answer that must call a tool (`tool_choice` "required" or a named function), in the form the
model's template teaches (text/tools.py CallFormat: Qwen3.5's XML form, Qwen3's JSON-in-<tool_call> form), each
call's arguments held to its tool's JSON schema (llguidance's Lark with `%json{}` schemas embedded); and the
grammar of an answer that may be a JSON value or calls (response_format beside tools the model may call).

The Lark written here is a value for decode/grammar.py's answer_grammar (which adds a thinking block where the
prompt opened one).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from swarm.coordinator.decode.grammar import GrammarError, json_schema_lark
from swarm.coordinator.text.tools import (
    FUNCTION_END,
    FUNCTION_START,
    PARAMETER_END,
    PARAMETER_START,
    CallFormat,
    Family,
)


def calls_lark(fmt: CallFormat, tools: Mapping[str, Mapping[str, Any]], parallel: bool = True) -> str:
    """A value (the expression `calls`, then its rules) that is one call (or several, `parallel`) of one of
    `tools` (name -> parameters' JSON schema). Rules are named by the tool's place, so any tool name is safe."""
    if not tools:
        raise ValueError("a call grammar needs at least one tool")
    rules, names = [], []
    for i, (name, schema) in enumerate(tools.items()):
        rule = f"c{i}"
        names.append(rule)
        if fmt.family is Family.QWEN_XML:
            rules += _xml_call(rule, name, _object(schema))
        elif fmt.family is Family.JSON:
            call = {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": _object(schema)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            rules.append(f"{rule}: {json_schema_lark(call)}")
        else:
            raise ValueError(f"no call form for the {fmt.family.value!r} family")
    more = f" ({_lit(fmt.between)} call)*" if parallel else ""
    one = f"call: {_lit(fmt.start)} ({' | '.join(names)}) {_lit(fmt.end)}"
    return "\n".join(["calls", f"calls: call{more}", one, *rules]) + "\n"


def _xml_call(rule: str, name: str, schema: dict[str, Any]) -> list[str]:
    """`<function=NAME>\\n`, each parameter `<parameter=P>\\nVALUE\\n</parameter>\\n` (the schema's required ones
    always, the others where the model gives them, in the schema's order), `</function>`. A string's VALUE is
    its text (anything not holding `\\n</parameter>`, within maxLength), any other's its JSON. A GrammarError where
    the schema's properties or required are not what a JSON schema holds there."""
    props, required = schema.get("properties") or {}, schema.get("required") or []
    if not isinstance(props, Mapping):
        raise GrammarError(f"the parameters schema of {name!r}: 'properties' must be an object")
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise GrammarError(f"the parameters schema of {name!r}: 'required' must be a list of property names")
    parts, rules = [], []
    for j, (param, sub) in enumerate(props.items()):
        sub = sub if isinstance(sub, Mapping) else {}
        head, part = _lit(f"{PARAMETER_START}{param}>\n"), f"{rule}_{j}"
        words = _words(sub)
        if words is not None:  # the template writes a string as its text: one of these words
            rules.append(f"{part}: {head} ({' | '.join(_lit(w) for w in words)}) {_lit(PARAMETER_END_LINE)}")
        elif sub.get("type") == "string":
            at_most = sub.get("maxLength")
            text = "(.|\\n)*" if not isinstance(at_most, int) else f"(.|\\n){{0,{at_most}}}"
            # the value ends at the first closing tag (lazily), which the rule takes in with it
            rules.append(f"{part}: {head} {part}v")
            rules.append(f"{part}v[suffix={_lit(PARAMETER_END_LINE)}]: /{text}/")
        else:
            rules.append(f"{part}: {head} {json_schema_lark(sub)} {_lit(PARAMETER_END_LINE)}")
        parts.append(part if param in required else f"{part}?")
    opening = _lit(f"{FUNCTION_START}{name}>\n")
    return [f"{rule}: {opening} {' '.join(parts)} {_lit(FUNCTION_END)}", *rules]


# what closes a parameter's value in the XML form (the value's own newline, the tag, the line's end)
PARAMETER_END_LINE = f"\n{PARAMETER_END}\n"


def _words(schema: Mapping[str, Any]) -> list[str] | None:
    """The strings a string-valued enum or const allows, else None."""
    if isinstance(schema.get("const"), str):
        return [schema["const"]]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(w, str) for w in enum):
        return enum
    return None


def _object(schema: Any) -> dict[str, Any]:
    return dict(schema) if isinstance(schema, Mapping) else {"type": "object"}


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def value_or_calls_lark(value: str, calls: str | None) -> str:
    """A value that is the JSON `value` (a one-line Lark expression) or, where tools may be called, calls."""
    if calls is None:
        return value
    assert calls.startswith("calls\n"), "calls_lark's value"
    return f"(answer | calls)\nanswer: {value}\n{calls.removeprefix('calls' + chr(10))}"


def tool_schemas(tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """OpenAI tool objects -> name -> parameters' JSON schema."""
    return {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
