"""The Anthropic Messages API of `swarm serve`: POST /v1/messages and /v1/messages/count_tokens, beside the
OpenAI routes (api.py) and over the same machinery.

A request is checked (the key as `x-api-key` or `Authorization: Bearer`, the model), put in the OpenAI chat
form (anthropic_request.py) and read by the OpenAI API's JobReader into the same Job a chat completion makes;
the OpenAI API's `run` takes it through the scheduler, and the text that comes back is cut into content blocks
and sent as a message or as Anthropic's events (anthropic_answer.py). Errors are Anthropic error objects.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from swarm.coordinator.serve.anthropic_answer import Message, Stop, event, stop_reason
from swarm.coordinator.serve.anthropic_request import in_anthropic_words, openai_body, prompt_body
from swarm.coordinator.serve.api_error import ApiError
from swarm.coordinator.serve.openai_request import Job
from swarm.coordinator.text.tools import AnswerReader, Reading

log = logging.getLogger(__name__)

# Anthropic's error types by HTTP status
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_routes(api: Any) -> list[Route]:
    """The routes of the Anthropic API over `api`, the OpenAI API (api.py OpenAIApi): its job reader, its
    run through the scheduler, its config and metrics."""
    a = AnthropicApi(api)
    return [
        Route("/v1/messages", a.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", a.count_tokens, methods=["POST"]),
    ]


def error_response(e: ApiError) -> JSONResponse:
    kind = ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return JSONResponse(
        {"type": "error", "error": {"type": kind, "message": e.message}},
        status_code=e.status,
        headers=e.headers,
    )


def error_event(e: ApiError) -> bytes:
    """An error met mid-stream, once the status line has gone out."""
    return event("error", {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"),
                                                      "message": e.message}})  # fmt: skip


class AnthropicApi:
    def __init__(self, api: Any) -> None:
        self.api = api

    def check_key(self, request: Request) -> None:
        key = self.api.config.api_key
        if key is None:
            return
        auth = request.headers.get("authorization", "")
        given = request.headers.get("x-api-key") or (auth[7:] if auth.lower().startswith("bearer ") else "")
        if not secrets.compare_digest(given.encode(), key.encode()):
            raise ApiError(401, "missing or wrong API key: send it as 'x-api-key: KEY' or 'Authorization: "
                           "Bearer KEY' (the server's --api-key)", "authentication_error")  # fmt: skip

    async def job(self, request: Request, count: bool = False) -> tuple[dict[str, Any], Job]:
        self.check_key(request)
        body = await self.api.body_of(request)
        chat = (prompt_body if count else openai_body)(body)
        make = self.api.jobs.chat_job
        try:
            # pictures are decoded and encoded beside the event loop (seconds, for a big vision tower)
            return body, await asyncio.to_thread(make, chat) if self.api.vision is not None else make(chat)
        except ApiError as e:
            raise in_anthropic_words(e) from None

    async def count_tokens(self, request: Request) -> Response:
        try:
            _, job = await self.job(request, count=True)
        except ApiError as e:
            self.api.metrics.request("count_tokens", e.status)
            return error_response(e)
        except Exception as e:
            log.exception("count_tokens failed")
            return error_response(ApiError(500, f"internal error: {e}"))
        self.api.metrics.request("count_tokens", 200)
        return JSONResponse({"input_tokens": len(job.prompt)})

    async def messages(self, request: Request) -> Response:
        started = time.monotonic()
        try:
            body, job = await self.job(request)
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise ApiError(400, "stream: true or false", param="stream")
            reader = AnswerReader(job.tools.reading if job.tools is not None else Reading())
            # the context left less room than max_tokens asked for: an answer cut there ran out of context
            capped = job.params.max_tokens < body["max_tokens"]
            gen = self.api.run(job, request)
            if stream:
                first = await anext(gen, None)  # errors before the first token still get a status
                self.api.metrics.request("messages", 200)
                return StreamingResponse(
                    self.events(gen, first, job, reader, started, capped),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"},
                )
            msg = Message(self.api.config.model_id, len(job.prompt), 0)
            finish, req = "stop", None
            async for piece, fin, r in gen:
                req, finish = r, fin or finish
                msg.add(reader.push(piece))
            msg.add(reader.finish())
            assert req is not None
            msg.cached = req.cached
            self.api.metrics.finished(req, started, "messages")
            return JSONResponse(msg.whole(self.reason(finish, msg, req, capped), req.produced))
        except ApiError as e:
            self.api.metrics.request("messages", e.status)
            return error_response(e)
        except Exception as e:  # a bug, not the client's fault: still an Anthropic error object
            log.exception("messages request failed")
            self.api.metrics.request("messages", 500)
            return error_response(ApiError(500, f"internal error: {e}"))

    async def events(
        self, gen: AsyncIterator[tuple[str, str | None, Any]], first: tuple[str, str | None, Any] | None,
        job: Job, reader: AnswerReader, started: float, capped: bool = False,
    ) -> AsyncIterator[bytes]:  # fmt: skip
        req = first[2] if first else None
        msg = Message(self.api.config.model_id, len(job.prompt), req.cached if req else 0)
        finish = "stop"
        try:
            for e in msg.start_events():
                yield e
            async for piece, fin, r in _after(first, gen):
                req, finish = r, fin or finish
                for e in msg.events(reader.push(piece)):
                    yield e
            for e in msg.events(reader.finish()):
                yield e
        except ApiError as e:
            yield error_event(e)
            return
        finally:
            await gen.aclose()  # a client gone mid-stream: `run` cancels its request, freeing the slot
        produced = req.produced if req is not None else 0
        for e in msg.end_events(self.reason(finish, msg, req, capped), produced):
            yield e
        if req is not None:
            self.api.metrics.finished(req, started, "messages", count=False)

    def reason(self, finish: str, msg: Message, req: Any, capped: bool = False) -> Stop:
        calls = any(b["type"] == "tool_use" for b in msg.content)
        found = req.stop_text.found if req is not None and req.stop_text is not None else None
        return stop_reason(finish, calls, found, capped)


async def _after(first: Any, gen: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """`first`, taken from `gen` already, then the rest of `gen` (nothing more where `first` ended it)."""
    if first is not None:
        yield first
        if first[1] is not None:
            return
    async for x in gen:
        yield x
