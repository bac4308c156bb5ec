"""An answer in OpenAI's shapes: the whole completion object, or the server-sent events of a streamed one
(chunks, the usage chunk, an error object), with llama-server's timings; and the stop strings that cut it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from swarm.coordinator.serve.api_error import ApiError
from swarm.coordinator.serve.scheduler import Request


class StopMatcher:
    """Cuts generated text at the first stop string; while streaming, holds back a tail that could still
    become one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0

    def push(self, piece: str) -> tuple[str, bool]:
        """(text safe to send now, whether a stop string was reached)."""
        self.text += piece
        hits = [i for i in (self.text.find(s, max(0, self.sent - len(s))) for s in self.stops) if i >= 0]
        if hits:
            cut = min(hits)
            out, self.sent = self.text[self.sent : cut], cut
            self.text = self.text[:cut]
            return out, True
        safe = max(self.sent, len(self.text) - self.hold) if self.stops else len(self.text)
        out, self.sent = self.text[self.sent : safe], safe
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent :], len(self.text)
        return out


@dataclass(frozen=True)
class Answer:
    """One completion's identity in every object it sends back (OpenAI's id, created, model, object)."""

    completion_id: str
    created: int
    chat: bool
    model: str
    include_usage: bool
    started: float
    logprobs: Callable[[], dict[str, Any] | None] | None = None  # the answer's, once it is whole
    stream_logprobs: Callable[[], dict[str, Any] | None] | None = None  # those come since the last chunk

    @property
    def whole_object(self) -> str:
        """The object name of the answer sent at once."""
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        """The object name of a streamed piece."""
        return "chat.completion.chunk" if self.chat else "text_completion"

    def identity(self, object_name: str) -> dict[str, Any]:
        return {"id": self.completion_id, "object": object_name, "created": self.created, "model": self.model}

    def whole(self, text: str, reason: str, req: Request) -> dict[str, Any]:
        """The completion object of an answer sent at once."""
        logprobs = self.logprobs() if self.logprobs is not None else None
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": logprobs}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            **self.identity(self.whole_object),
            "choices": [choice],
            "usage": usage(req),
            "timings": timings(req),
        }

    def role_event(self) -> bytes:
        """A streamed chat's first chunk: the assistant's role, no text yet."""
        return sse_data({**self.identity("chat.completion.chunk"), "choices": [{"index": 0, "delta": {
            "role": "assistant", "content": ""}, "finish_reason": None}]})  # fmt: skip

    def event(self, piece: str | None, reason: str | None, extra: dict[str, Any] | None = None) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {} if piece is None else {"content": piece}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": piece or "", "finish_reason": reason, "logprobs": None}
        if self.stream_logprobs is not None:
            # the tokens' come since the last chunk (a chat's deltas go out as openai_tools.ChunkStream's chunks,
            # each with its tokens'; this last chunk has those of the tokens no delta carried, EOS left out)
            choice["logprobs"] = self.stream_logprobs()
        return sse_data({**self.identity(self.chunk_object), "choices": [choice], **(extra or {})})

    def usage_event(self, req: Request) -> bytes:
        return sse_data({**self.identity(self.chunk_object), "choices": [], "usage": usage(req)})


def error_event(e: ApiError) -> bytes:
    """An error met mid-stream, once the status line has gone out."""
    return sse_data({"error": {"message": e.message, "type": e.kind, "param": None, "code": e.code}})


def sse_data(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def usage(req: Request) -> dict[str, Any]:
    return {
        "prompt_tokens": len(req.prompt),
        "completion_tokens": req.produced,
        "total_tokens": len(req.prompt) + req.produced,
        "prompt_tokens_details": {"cached_tokens": req.cached},
    }


def timings(req: Request) -> dict[str, Any]:
    """llama-server's figures: prompt tokens read (not taken from held state) and how long that took."""
    end = time.monotonic()
    decode = end - (req.first_token or end)
    return {
        "cache_n": req.cached,
        "prompt_n": len(req.prompt) - req.cached,
        "prompt_ms": 1000 * req.prompt_seconds,
        "predicted_n": req.produced,
        "predicted_ms": 1000 * decode,
        "queue_ms": 1000 * ((req.admitted or end) - req.submitted),
    }
