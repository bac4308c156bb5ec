"""The OpenAI-compatible HTTP face of `swarm serve`, on Starlette (served by uvicorn).

/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics; the pages beside them are page.py's.
A request is checked here (the key, the model), read into a Job (swarm.coordinator.serve.openai_request:
prompt tokens, the GGUF's chat template for chats), handed to the Scheduler, and its tokens come back as
text (openai_answer's shapes): all at once, or streamed as server-sent events. Errors are OpenAI error
objects.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from swarm.coordinator.decode.core import StopStrings
from swarm.coordinator.serve import scheduler as sched
from swarm.coordinator.serve.metrics import ServeMetrics
from swarm.coordinator.serve.openai_answer import Answer, StopMatcher, error_event, timings
from swarm.coordinator.serve.openai_decoding import Decoding
from swarm.coordinator.serve.openai_request import ApiError, Job, JobReader
from swarm.coordinator.serve.openai_tools import ChunkStream, whole_chat
from swarm.coordinator.text.chat import ChatTemplate
from swarm.sharding.errors import UserError

log = logging.getLogger(__name__)


@dataclass
class ServeConfig:
    model_id: str
    api_key: str | None
    ctx_size: int
    retry_after: int = 1  # seconds a client told "queue full" should wait
    allow_image_urls: bool = False  # fetch pictures given as http(s) URLs (else only data: URLs)
    reasoning_format: str = "auto"  # thinking apart in reasoning_content, or "none": left in content
    invite: str | None = None  # what nodes join this coordinator with (--listen), for the map page


def build_app(
    engine: Any, scheduler: sched.Scheduler, config: ServeConfig, metrics: ServeMetrics
) -> Starlette:
    from swarm.coordinator.serve.anthropic import anthropic_routes
    from swarm.coordinator.serve.page import page_routes
    from swarm.coordinator.serve.watch import SwarmWatch

    api = OpenAIApi(engine, scheduler, config, metrics)
    watch = SwarmWatch(engine, scheduler, metrics, config.model_id).start()
    pages = page_routes(watch, api.check_key, config.invite, config.api_key is not None)
    return api.app([*pages, *anthropic_routes(api)])


class OpenAIApi:
    """The endpoints over one engine and its scheduler. In the order a request meets them: the key, the body,
    the job (self.jobs: prompt tokens and sampling), the run through the scheduler, then the answer (whole or
    streamed)."""

    def __init__(
        self, engine: Any, scheduler: sched.Scheduler, config: ServeConfig, metrics: ServeMetrics
    ) -> None:
        self.tokenizer = engine.tokenizer
        self.vision = getattr(engine, "vision", None)  # text.pictures.PictureEncoder, None: no pictures
        self.jobs = JobReader(
            self.tokenizer, ChatTemplate.from_tokenizer(self.tokenizer), config.ctx_size, self.vision,
            config.allow_image_urls, config.reasoning_format,
        )  # fmt: skip
        self.scheduler, self.config, self.metrics = scheduler, config, metrics

    def app(self, pages: Sequence[Route] = ()) -> Starlette:
        """The API's routes, and `pages` beside them (the chat at /, the swarm's map at /swarm: page.py)."""
        return Starlette(
            routes=[
                *pages,
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completion, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics_page, methods=["GET"]),
            ],
            exception_handlers={404: _not_found, 405: _bad_method},
        )

    # ---- a request, checked (read into a job by self.jobs) ----

    def check_key(self, request: Request) -> None:
        if self.config.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth.lower().startswith("bearer ") else ""
        if not secrets.compare_digest(given.encode(), self.config.api_key.encode()):
            raise ApiError(
                401,
                "missing or wrong API key: send it as 'Authorization: Bearer KEY' (the server's --api-key)",
                "authentication_error",
                code="invalid_api_key",
            )

    async def body_of(self, request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not JSON ({e})") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "missing 'model': give the id /v1/models lists", param="model")
        if model != self.config.model_id:
            raise ApiError(
                404,
                f"model {model!r} does not exist here; this server serves {self.config.model_id!r}",
                code="model_not_found",
                param="model",
            )
        return body

    # ---- the job through the scheduler ----

    async def run(self, job: Job, request: Request) -> AsyncIterator[tuple[str, str | None, sched.Request]]:
        """(text, finish_reason or None, the scheduler's request) as the tokens come."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[list[int] | sched.Done] = asyncio.Queue()

        def put(x: list[int] | sched.Done) -> None:
            loop.call_soon_threadsafe(events.put_nowait, x)

        scheduler = self.scheduler
        stop_text = StopStrings(self.tokenizer.stream(skip_control=True), job.stops) if job.stops else None
        hooks = job.decoding if job.decoding is not None else Decoding()  # grammar, penalties, logprobs
        req = sched.Request(
            job.prompt, job.params, put, put, mark=job.mark, pictures=job.pictures, keys=job.keys, stop_text=stop_text,
            processors=hooks.processors, forced=hooks.forced, record=hooks.record,
        )  # fmt: skip
        try:
            scheduler.submit(req)
        except sched.QueueFull:
            raise ApiError(
                429,
                f"{scheduler.queue_depth()} requests are waiting already; try again shortly",
                "rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(self.config.retry_after)},
            ) from None
        except UserError as e:
            raise ApiError(400, str(e)) from None
        detok = self.tokenizer.stream(skip_control=True)
        stop = StopMatcher(job.stops)
        finished = False
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(events.get(), timeout=1.0)
                except TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                if isinstance(ev, sched.Done):
                    if ev.finish_reason == "error":
                        raise ApiError(ev.status, ev.error or "generation failed", "server_error")
                    finished = True
                    tail = stop.push(detok.flush())[0] + stop.flush()
                    reason = hooks.finish_reason(ev.finish_reason)  # 'grammar': it left no token to go on
                    yield tail, reason if reason != "cancelled" else "stop", req
                    return
                hooks.tokens.extend(ev)
                text = "".join(detok.push(t) for t in ev if t not in job.params.stop_ids)
                piece, hit = stop.push(text)
                if hit:
                    finished = True
                    scheduler.cancel(req)
                    yield piece, "stop", req
                    return
                if piece:
                    yield piece, None, req
        finally:
            if not finished:
                scheduler.cancel(req)  # the client went away: free the slot at once

    # ---- the answer ----

    async def chat(self, request: Request) -> Response:
        return await self.complete(request, "chat", self.jobs.chat_job)

    async def completion(self, request: Request) -> Response:
        return await self.complete(request, "completion", self.jobs.completion_job)

    async def complete(self, request: Request, kind: str, make: Callable[[dict[str, Any]], Job]) -> Response:
        started = time.monotonic()
        chat = kind == "chat"
        try:
            self.check_key(request)
            body = await self.body_of(request)
            # pictures are decoded and encoded beside the event loop (seconds, for a big vision tower)
            job = await asyncio.to_thread(make, body) if self.vision is not None else make(body)
            stream = body.get("stream", False)
            options = body.get("stream_options") or {}
            if not isinstance(stream, bool) or not isinstance(options, dict):
                raise ApiError(
                    400, "'stream' must be true or false and 'stream_options' an object", param="stream"
                )
            answer = Answer(
                ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12), int(time.time()), chat,
                self.config.model_id, bool(options.get("include_usage", False)), started,
                job.decoding.answer_logprobs(self.tokenizer, chat) if job.decoding is not None else None,
                job.decoding.stream_logprobs(self.tokenizer, chat) if job.decoding is not None else None,
            )  # fmt: skip
            gen = self.run(job, request)
            if stream:
                first = await anext(gen, None)  # errors before the first token still get a status
                self.metrics.request(kind, 200)
                return StreamingResponse(
                    self.sse(gen, first, answer, kind, ChunkStream(answer, job.tools)),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"},
                )
            text, reason, req = "", "stop", None
            async for piece, fin, r in gen:
                text, req = text + piece, r
                reason = fin or reason
            assert req is not None
            self.metrics.finished(req, started, kind)
            whole = answer.whole(text, reason, req)
            return JSONResponse(whole_chat(whole, text, job.tools) if chat else whole)
        except ApiError as e:
            self.metrics.request(kind, e.status)
            return e.response()
        except Exception as e:  # a bug, not the client's fault: still an OpenAI error object
            log.exception("%s request failed", kind)
            self.metrics.request(kind, 500)
            return ApiError(500, f"internal error: {e}", "server_error").response()

    async def sse(
        self,
        gen: AsyncIterator[tuple[str, str | None, sched.Request]],
        first: tuple[str, str | None, sched.Request] | None,
        a: Answer,
        kind: str,
        chunks: ChunkStream,
    ) -> AsyncIterator[bytes]:
        req = first[2] if first else None
        reason = None
        try:
            if a.chat:
                yield a.role_event()
            if first is not None:
                req, reason = first[2], first[1]
                for event in chunks.events(first[0]):
                    yield event
            if reason is None:
                async for piece, fin, r in gen:
                    req, reason = r, fin
                    for event in chunks.events(piece):
                        yield event
        except ApiError as e:
            yield error_event(e)
            return
        finally:
            await gen.aclose()  # a client gone mid-stream: `run` cancels its request, freeing the slot
        last, reason = chunks.end(reason or "stop")
        for event in last:
            yield event
        yield a.event(None if a.chat else "", reason, {"timings": timings(req)} if req else None)
        if a.include_usage and req is not None:
            yield a.usage_event(req)
        yield b"data: [DONE]\n\n"
        if req is not None:
            self.metrics.finished(req, a.started, kind, count=False)

    # ---- the other endpoints ----

    async def models(self, request: Request) -> Response:
        try:
            self.check_key(request)
        except ApiError as e:
            return e.response()
        # what the model reads: "image" where a vision tower is loaded (image_url content parts)
        reads = ["text", "image"] if self.vision is not None else ["text"]
        return JSONResponse(
            {"object": "list", "data": [{"id": self.config.model_id, "object": "model", "created": 0,
             "owned_by": "swarm", "context_length": self.config.ctx_size, "input_modalities": reads}]}
        )  # fmt: skip

    async def health(self, request: Request) -> Response:
        scheduler = self.scheduler
        why = scheduler.admit_check() if scheduler.admit_check else None
        if why:
            return JSONResponse({"status": "degraded", "error": why}, status_code=503)
        return JSONResponse(
            {"status": "ok", "slots": len(scheduler.slots), "active": scheduler.active(),
             "queued": scheduler.queue_depth()}
        )  # fmt: skip

    async def metrics_page(self, request: Request) -> Response:
        body, ctype = self.metrics.render(self.scheduler)
        return Response(body, media_type=ctype)


async def _not_found(request: Request, exc: Exception) -> Response:
    return ApiError(404, f"no route {request.url.path}; see /v1/models, /v1/chat/completions").response()


async def _bad_method(request: Request, exc: Exception) -> Response:
    return ApiError(405, f"{request.method} is not allowed on {request.url.path}").response()
