"""An answer in Anthropic's shapes: the pieces the answer's text is read into (text/tools.py AnswerReader:
reasoning, content, calls) as content blocks (thinking, text, tool_use), in the whole message or as the
server-sent events of a streamed one (message_start, ping, content_block_start / _delta / _stop per block,
message_delta with the stop reason and usage, message_stop)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from swarm.coordinator.decode.grammar import DEAD_END
from swarm.coordinator.text.tools import Piece

# the block each kind of piece goes into
BLOCKS = {"reasoning": "thinking", "content": "text", "call": "tool_use", "arguments": "tool_use"}


@dataclass
class Message:
    """One answer's identity, and its blocks as they are given (whole, or as events)."""

    model: str
    input_tokens: int
    cached: int
    message_id: str = field(default_factory=lambda: "msg_" + secrets.token_hex(12))
    content: list[dict[str, Any]] = field(default_factory=list)
    open_kind: str | None = None  # the kind of the streamed block still open
    inputs: dict[int, str] = field(default_factory=dict)  # each tool_use block's input, as JSON text

    def usage(self, output_tokens: int) -> dict[str, Any]:
        return {"input_tokens": self.input_tokens - self.cached, "output_tokens": output_tokens,
                "cache_read_input_tokens": self.cached, "cache_creation_input_tokens": 0}  # fmt: skip

    def add(self, pieces: list[Piece]) -> None:
        """Pieces into the whole message's content."""
        for piece in pieces:
            self._add(piece)

    def _add(self, piece: Piece) -> None:
        kind = BLOCKS[piece.kind]
        if piece.kind == "call":
            self.content.append({"type": kind, "id": "toolu_" + secrets.token_hex(12), "name": piece.text,
                                 "input": {}})  # fmt: skip
            self.inputs[len(self.content) - 1] = ""
        elif piece.kind == "arguments":
            at = len(self.content) - 1
            self.inputs[at] += piece.text
            try:  # whole once the call's last piece has come
                self.content[at]["input"] = json.loads(self.inputs[at])
            except json.JSONDecodeError:
                pass
        elif self.content and self.content[-1]["type"] == kind:
            self.content[-1][kind] += piece.text
        else:
            self.content.append(
                {"type": kind, kind: piece.text, **({"signature": ""} if kind == "thinking" else {})}
            )

    def whole(self, stop: Stop, output_tokens: int) -> dict[str, Any]:
        return {**self._head(), "content": self.content, **stop.fields(), "usage": self.usage(output_tokens)}

    def _head(self) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model}

    # ---- streamed ----

    def start_events(self) -> Iterator[bytes]:
        head = {
            **self._head(),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": self.usage(0),
        }
        yield event("message_start", {"type": "message_start", "message": head})
        yield event("ping", {"type": "ping"})

    def events(self, pieces: list[Piece]) -> Iterator[bytes]:
        for piece in pieces:
            yield from self._events(piece)

    def _events(self, piece: Piece) -> Iterator[bytes]:
        """The events of one piece: a new block where its kind differs from the open one (each call its own)."""
        kind = BLOCKS[piece.kind]
        if kind == self.open_kind and piece.kind != "call":
            if piece.kind == "arguments":
                delta = {"type": "input_json_delta", "partial_json": piece.text}
            else:
                delta = {"type": f"{kind}_delta", kind: piece.text}
            yield event("content_block_delta", {"type": "content_block_delta", "index": len(self.content) - 1,
                                                "delta": delta})  # fmt: skip
            self._add(piece)
            return
        yield from self.close_events()
        self._add(piece)
        index, block = len(self.content) - 1, dict(self.content[-1])
        if piece.kind != "call":
            block[kind] = ""
        yield event(
            "content_block_start", {"type": "content_block_start", "index": index, "content_block": block}
        )
        if piece.kind != "call":
            delta = {"type": f"{kind}_delta", kind: piece.text}
            yield event(
                "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
            )
        self.open_kind = kind

    def close_events(self) -> Iterator[bytes]:
        if self.open_kind is not None:
            yield event("content_block_stop", {"type": "content_block_stop", "index": len(self.content) - 1})
            self.open_kind = None

    def end_events(self, stop: Stop, output_tokens: int) -> Iterator[bytes]:
        yield from self.close_events()
        yield event("message_delta", {"type": "message_delta", "delta": stop.fields(),
                                      "usage": self.usage(output_tokens)})  # fmt: skip
        yield event("message_stop", {"type": "message_stop"})


def event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


@dataclass(frozen=True)
class Stop:
    """Why an answer ended, in Anthropic's words: its stop_reason, the stop sequence that ended it, and
    stop_details (None where the reason needs none)."""

    reason: str
    sequence: str | None = None
    details: dict[str, Any] | None = None

    def fields(self) -> dict[str, Any]:
        """The message's (or message_delta's) stop fields."""
        return {"stop_reason": self.reason, "stop_sequence": self.sequence, "stop_details": self.details}


# A grammar that left no token to go on with (the OpenAI endpoint's finish_reason "grammar") has no stop_reason
# of its own in Anthropic's API, whose clients know only theirs. "refusal" is the one that is true of it: output
# stopped mid-answer by something other than the model, the content not an answer to use or continue as it
# is, and stop_details (Anthropic's shape for a refusal that maps to no named category: category null, an
# explanation) says what stopped it. Each other reason would be acted on wrongly: end_turn says the answer is
# finished (a half-written tool_use would be run, half a JSON value parsed), max_tokens and pause_turn invite the
# client to raise the limit or send the turn back to go on, which meets the same dead end again.
GRAMMAR_DEAD_END = Stop("refusal", None, {
    "type": "refusal", "category": None,
    "explanation": "the answer's grammar (a tool's input_schema, output_config.format or grammar) left no token "
                   "to go on with: the answer stopped unfinished",
})  # fmt: skip


def stop_reason(finish: str, calls: bool, found: str | None, capped: bool = False) -> Stop:
    """Why an answer that ended with the core's `finish` ("stop", "length", or decode/grammar.py's DEAD_END)
    ended: `found`, the stop sequence the core ended it at (decode/core.py StopStrings), if any; `capped`: the
    context, not max_tokens, set the length it could reach."""
    if finish == DEAD_END:
        return GRAMMAR_DEAD_END
    if finish == "length":
        return Stop("model_context_window_exceeded" if capped else "max_tokens")
    if calls:
        return Stop("tool_use")
    if found is not None:
        return Stop("stop_sequence", found)
    return Stop("end_turn")
