"""A tool call's arguments written while the model is still writing the call, as OpenAI streams them: the text
`json.dumps(arguments, ensure_ascii=False)` gives, in pieces, each written as soon as the model's text settles it
(a string's characters as they come, a number once it ends), so a coding agent sees a file being written rather
than all of it at the call's end. Whatever point the model's text stops at, `close()` ends what is open: the
pieces joined are always one valid JSON object.

- JsonArgs: the JSON family's `"arguments": {...}`, read character by character.
- XmlArgs: the Qwen XML family's `<parameter=P>\\nVALUE\\n</parameter>` list; a string parameter's value streams,
  any other is written once it ends, as the type its schema declares (typed_value).
- xml_call, json_call: a call read whole, where its head never came in the form the streaming readers follow.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

FUNCTION_START, FUNCTION_END = "<function=", "</function>"
PARAMETER_START, PARAMETER_END = "<parameter=", "</parameter>"
# What may follow the tag that ends a parameter's value; a `</parameter>` followed by anything else is part of the
# value (a file of XML). An unclosed parameter also ends at its function's end.
VALUE_ENDS = {PARAMETER_END: (PARAMETER_START, FUNCTION_END), FUNCTION_END: ()}
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_SCALAR = re.compile(r"[-+0-9.eEtruefalsn]")


def canonical(ch: str) -> str:
    """One character as json.dumps writes it inside a string."""
    return json.dumps(ch, ensure_ascii=False)[1:-1]


def held(text: str, tags: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could still be the start of one of `tags`."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


class JsonArgs:
    """A JSON object's text read as it comes (it starts at its `{`), written in its canonical form as far as the
    text settles it. A key is written once its value begins and a comma once the next item begins, so what was
    written can always be closed. Text after the object's end is kept in `rest`."""

    def __init__(self) -> None:
        self.stack: list[str] = []  # the open containers' closing characters
        self.expect = "value"  # value, first_value, first_key, key, colon, after
        self.pending = ""  # settled text waiting for the value it goes before (a comma, a key and its colon)
        self.scalar = ""  # a number or literal being read
        self.string: str | None = None  # "key" or "value" while inside a string
        self.key = ""
        self.escape = ""  # an escape sequence being read, from its backslash
        self.high = ""  # a high surrogate waiting for its low half
        self.done = False
        self.broken = ""  # why the text stopped being JSON ('' while it is)
        self.rest = ""
        self.out: list[str] = []

    def feed(self, text: str) -> None:
        for i, ch in enumerate(text):
            if self.done or self.broken:
                self.rest += text[i:] if self.done else ""
                return
            self._char(ch)

    def take(self) -> str:
        out, self.out = "".join(self.out), []
        return out

    def close(self) -> str:
        """The text that ends what is still open (a string, containers); '' where the object ended."""
        if not self.done and not self.broken and self.scalar:
            self._end_scalar()
        if self.string == "value":
            self.out.append('"')
        self.out += reversed(self.stack)
        self.stack, self.string, self.done = [], None, True
        return self.take()

    def _write(self, text: str) -> None:
        self.out.append(self.pending + text)
        self.pending = ""

    def _char(self, ch: str) -> None:
        if self.string is not None:
            self._in_string(ch)
            return
        if self.scalar:
            if _SCALAR.match(ch):
                self.scalar += ch
                return
            self._end_scalar()
            if self.broken:
                return
        if ch in " \t\r\n":
            return
        e = self.expect
        if e in ("value", "first_value"):
            if e == "first_value" and ch == "]":
                self._close(ch)
            elif ch in "{[":
                self._write(ch)
                self.stack.append("}" if ch == "{" else "]")
                self.expect = "first_key" if ch == "{" else "first_value"
            elif ch == '"':
                self._write('"')
                self.string = "value"
            elif _SCALAR.match(ch):
                self.scalar = ch
            else:
                self.broken = f"{ch!r} where a value was expected"
        elif e in ("key", "first_key"):
            if e == "first_key" and ch == "}":
                self._close(ch)
            elif ch == '"':
                self.string, self.key = "key", ""
            else:
                self.broken = f"{ch!r} where a key was expected"
        elif e == "colon":
            if ch == ":":
                self.expect = "value"
            else:
                self.broken = f"{ch!r} where ':' was expected"
        elif ch == ",":
            self.pending = ", "
            self.expect = "key" if self.stack[-1] == "}" else "value"
        elif ch in "}]":
            self._close(ch)
        else:
            self.broken = f"{ch!r} where ',' or a closing bracket was expected"

    def _close(self, ch: str) -> None:
        if not self.stack or self.stack[-1] != ch:
            self.broken = f"{ch!r} closes nothing open"
            return
        self.stack.pop()
        self.pending = ""
        self._write(ch)
        self._after_value()

    def _after_value(self) -> None:
        self.expect = "after"
        self.done = not self.stack

    def _end_scalar(self) -> None:
        try:
            value = json.loads(self.scalar)
        except json.JSONDecodeError:
            self.broken = f"{self.scalar!r} is not a number or literal"
            return
        self.scalar = ""
        self._write(json.dumps(value))
        self._after_value()

    def _in_string(self, ch: str) -> None:
        if self.escape:
            self.escape += ch
            if self.escape[1] == "u":
                if len(self.escape) < 6:
                    return
                try:
                    code = int(self.escape[2:], 16)
                except ValueError:
                    self.broken = f"bad escape {self.escape!r}"
                    return
                self.escape = ""
                if 0xD800 <= code < 0xDC00:
                    self.high = chr(code)
                    return
                if 0xDC00 <= code < 0xE000 and self.high:
                    pair, self.high = self.high + chr(code), ""
                    self._string_char(pair.encode("utf-16", "surrogatepass").decode("utf-16"))
                    return
                self._string_char(chr(code))
                return
            char = _ESCAPES.get(ch)
            self.escape = ""
            if char is None:
                self.broken = f"bad escape '\\{ch}'"
            else:
                self._string_char(char)
            return
        if ch == "\\":
            self.escape = ch
        elif ch == '"':
            self.high = ""
            if self.string == "key":
                self.pending += json.dumps(self.key, ensure_ascii=False) + ": "
                self.expect = "colon"
            else:
                self._write('"')
                self._after_value()
            self.string = None
        else:
            self._string_char(ch)

    def _string_char(self, ch: str) -> None:
        if self.high:  # a high surrogate with no low half: not a character
            self.high = ""
            ch = "\ufffd" + ch
        if self.string == "key":
            self.key += ch
        else:
            self._write("".join(canonical(c) for c in ch))


class XmlArgs:
    """A Qwen XML call's parameters (the text after `<function=NAME>`) read as they come, written as the JSON
    object of its arguments. `feed(text, final)`: `final` once the function's text is over (its `</function>` or
    `</tool_call>` read, or the answer ended)."""

    def __init__(self, properties: Mapping[str, Any]) -> None:
        self.properties = properties
        self.buf = ""
        self.key: str | None = None  # the parameter whose value is being read
        self.streams = False  # its value is a string, written as it comes
        self.sent = -1  # how much of the value's text (in buf) is written (-1: not even its key)
        self.keys: list[str] = []
        self.done = False
        self.broken = ""
        self.out: list[str] = []

    def feed(self, text: str, final: bool) -> None:
        self.buf += text
        while not self.done and (self._between(final) if self.key is None else self._value(final)):
            pass

    def take(self) -> str:
        out, self.out = "".join(self.out), []
        return out

    def close(self) -> str:
        if self.done:
            return self.take()
        if self.key is not None:  # the text stopped inside a value: what was read of it stays
            v = self.buf[1:] if self.buf.startswith("\n") else self.buf
            if self.streams:
                self._stream(self.buf, len(self.buf), ending=True)
                self.out.append('"')
            else:
                self.out.append(
                    self._prefix() + json.dumps(typed_value(v, self._schema()), ensure_ascii=False)
                )
        self.out.append("}" if self.keys else "{}")
        self.key, self.done = None, True
        return self.take()

    def _prefix(self) -> str:
        assert self.key is not None
        return ("{" if len(self.keys) == 1 else ", ") + json.dumps(self.key, ensure_ascii=False) + ": "

    def _between(self, final: bool) -> bool:
        head = self.buf.lstrip()
        if head.startswith(FUNCTION_END) or (final and not head):
            self.buf, self.done = "", True
            self.out.append("}" if self.keys else "{}")
            return False
        if head.startswith(PARAMETER_START) and ">" in head:
            at = head.index(">")
            key = head[len(PARAMETER_START) : at].strip()
            if key in self.keys:
                log.warning("a tool call names parameter %r twice: the last value is the one kept", key)
            self.key, self.buf, self.sent = key, head[at + 1 :], -1
            self.keys.append(key)
            schema = self.properties.get(key)
            self.streams = text_typed(schema if isinstance(schema, Mapping) else None)
            return True
        opening = head.startswith(PARAMETER_START) and "\n" not in head  # its key still coming
        if not final and (opening or PARAMETER_START.startswith(head) or FUNCTION_END.startswith(head)):
            return False
        self.broken = f"not a parameter: {head[:80]!r}"
        self.done = True
        return False

    def _value(self, final: bool) -> bool:
        v = self.buf
        end, consumed = value_end(v, final)
        if end is None:
            if final:  # no end tag before the function's: the value is what there is
                end, consumed = len(v), len(v)
            else:
                self._stream(v, consumed)  # consumed: how far the value is sure
                return False
        start = 1 if v.startswith("\n") else 0
        stop = end - 1 if end > start and v[end - 1] == "\n" else end
        value = v[start:stop]
        if self.streams:
            self._stream(v, stop, ending=True)
            self.out.append('"')
        else:
            self.out.append(
                self._prefix() + json.dumps(typed_value(value, self._schema()), ensure_ascii=False)
            )
        self.buf, self.key = v[consumed:], None
        return True

    def _schema(self) -> Mapping[str, Any] | None:
        schema = self.properties.get(self.key or "")
        return schema if isinstance(schema, Mapping) else None

    def _stream(self, v: str, sure: int, ending: bool = False) -> None:
        """A string value's text written up to `sure` (its first newline, the template's, left out)."""
        if not self.streams or not (v or ending):
            return
        if self.sent < 0:
            self.out.append(self._prefix() + '"')
            self.sent = 1 if v.startswith("\n") else 0
        if sure > self.sent:
            self.out.append("".join(canonical(c) for c in v[self.sent : sure]))
            self.sent = sure


def value_end(v: str, final: bool) -> tuple[int | None, int]:
    """Where a parameter's value text `v` ends: (its end, where the text after it begins), or (None, how far the
    value is sure) while the text may still end it."""
    at = 0
    while True:
        found = [(v.find(tag, at), tag) for tag in VALUE_ENDS]
        found = [(i, tag) for i, tag in found if i >= 0]
        if not found:
            sure = len(v) - held(v, tuple(t for tag in VALUE_ENDS for t in ("\n" + tag, tag)))
            return None, sure
        i, tag = min(found)
        rest = v[i + len(tag) :].lstrip()
        follows = VALUE_ENDS[tag]
        if any(rest.startswith(f) for f in follows) or (not rest and final):
            # a `</function>` stays for the parameters' reader, which ends the call at it
            return i, i + len(tag) if tag == PARAMETER_END else i
        if not final and (not rest or any(f.startswith(rest) for f in follows)):
            return None, i - 1 if i and v[i - 1] == "\n" else i
        at = i + 1


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


def text_typed(schema: Mapping[str, Any] | None) -> bool:
    """Whether a parameter's text is its value as it is (a string, or a parameter the schema says nothing of)."""
    types = _types(schema) if isinstance(schema, Mapping) else set()
    return not types or types == {"string"}


def typed_value(text: str, schema: Mapping[str, Any] | None) -> Any:
    """A parameter's text as the type its JSON schema declares: a string parameter's text as is; a number, a
    boolean (the template writes Python's True/False), null, an object or an array from its text. Text that is
    not what the schema says stays a string (the tool reports it, as it would a wrong value)."""
    if text_typed(schema):
        return text
    assert schema is not None
    types = _types(schema)
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
    try:
        v = json.loads(s)
    except json.JSONDecodeError:
        return text
    return text if isinstance(v, str) else v


# ---- a call read whole ----

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>)?\s*", re.S)
# A value ends at the `</parameter>` before the next parameter or the function's end, so one holding the tag
# itself (a file of XML) still reads whole.
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>\s*(?=<parameter=|$)", re.S)


def xml_call(inner: str, tools: Mapping[str, Mapping[str, Any]]) -> tuple[str, dict[str, Any]]:
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


def json_call(inner: str) -> tuple[str, dict[str, Any]]:
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
