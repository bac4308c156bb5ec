"""The OpenAI-compatible HTTP face of `swarm serve`, on Starlette (served by uvicorn).

/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics. A request is validated here,
turned into prompt tokens (the GGUF's chat template for chats), handed to the Scheduler, and its tokens
come back as text: all at once, or streamed as server-sent events. Errors are OpenAI error objects.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from swarm.coordinator.chat import ChatTemplate
from swarm.coordinator.generate import SamplingParams
from swarm.coordinator.serve import scheduler as sched
from swarm.coordinator.serve.metrics import ServeMetrics
from swarm.sharding.errors import UserError

log = logging.getLogger(__name__)

MAX_STOPS = 4  # stop strings per request, as OpenAI allows
# A plain completion's prompt keeps a checkpoint this many tokens before its end (llama-server's choice): a
# client that sends it again with its answer appended continues from the slot's whole state, and one that
# changes only the last tokens from there (the pass that reads the prompt's end keeps it: no pass of its own).
COMPLETION_TAIL = 4


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
        code: str | None = None, headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


@dataclass
class ServeConfig:
    model_id: str
    api_key: str | None
    ctx_size: int
    retry_after: int = 1  # seconds a client told "queue full" should wait


@dataclass
class Job:
    """What one request asks for, in tokens."""

    prompt: list[int]
    params: SamplingParams
    stops: list[str]
    mark: int | None = None  # where the scheduler keeps a checkpoint before the prompt's end


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


def build_app(
    engine: Any, scheduler: sched.Scheduler, config: ServeConfig, metrics: ServeMetrics
) -> Starlette:
    return OpenAIApi(engine, scheduler, config, metrics).app()


class OpenAIApi:
    """The endpoints over one engine and its scheduler. In the order a request meets them: the key, the body,
    the job (prompt tokens and sampling), the run through the scheduler, then the answer (whole or streamed)."""

    def __init__(
        self, engine: Any, scheduler: sched.Scheduler, config: ServeConfig, metrics: ServeMetrics
    ) -> None:
        self.tokenizer = engine.tokenizer
        self.template = ChatTemplate.from_tokenizer(self.tokenizer)
        self.scheduler, self.config, self.metrics = scheduler, config, metrics

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completion, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics_page, methods=["GET"]),
            ],
            exception_handlers={404: _not_found, 405: _bad_method},
        )

    # ---- a request, checked and turned into a job ----

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

    def sampling(self, body: dict[str, Any], n_prompt: int) -> tuple[SamplingParams, list[str]]:
        room = self.config.ctx_size - n_prompt
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is None:
            max_tokens = room
        elif isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ApiError(400, "'max_tokens' must be a positive integer", param="max_tokens")
        else:
            max_tokens = min(limit, room)
        if body.get("n", 1) != 1:
            raise ApiError(400, "only n=1 is supported: send several requests instead", param="n")
        top_k = body.get("top_k", 0)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ApiError(400, "'top_k' must be a non-negative integer", param="top_k")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ApiError(400, "'seed' must be an integer", param="seed")
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
        if (
            not isinstance(stops, list)
            or not all(isinstance(s, str) for s in stops)
            or len(stops) > MAX_STOPS
        ):
            raise ApiError(
                400, f"'stop' must be a string or a list of up to {MAX_STOPS} strings", param="stop"
            )
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
            top_k=top_k,
            seed=seed,
            stop_ids=self.tokenizer.eos_ids,
        )
        return params, stops

    def check_context(self, prompt: list[int]) -> None:
        if not prompt:
            raise ApiError(400, "the prompt is empty after tokenization", param="prompt")
        if len(prompt) >= self.config.ctx_size:
            raise ApiError(
                400,
                f"the prompt has {len(prompt)} tokens but the context is {self.config.ctx_size} tokens "
                "(the server's --ctx-size): shorten it",
                code="context_length_exceeded",
                param="messages",
            )

    def chat_job(self, body: dict[str, Any]) -> Job:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "missing 'messages': a list of {role, content} objects", param="messages")
        plain = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, f"messages[{i}] needs a 'role' and a 'content'", param="messages")
            content = m.get("content")
            if isinstance(content, list):  # content parts: only text ones here
                texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
                if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                    raise ApiError(
                        400, f"messages[{i}]: only text content parts are supported", param="messages"
                    )
                content = "".join(texts)  # type: ignore[arg-type]
            if content is None:
                content = ""
            if not isinstance(content, str):
                raise ApiError(400, f"messages[{i}].content must be a string or text parts", param="messages")
            plain.append({**m, "content": content})
        try:
            text = self.template.render(plain, add_generation_prompt=True)
        except UserError as e:
            raise ApiError(400, str(e), param="messages") from None
        prompt = self.tokenizer.encode(text, parse_special=True)
        self.check_context(prompt)
        params, stops = self.sampling(body, len(prompt))
        return Job(prompt, params, stops, self._turn_end(plain, text, prompt))

    def _turn_end(self, messages: list[dict[str, Any]], text: str, prompt: list[int]) -> int | None:
        """Where the conversation ends before the generation prompt: a chat app sends it again with the
        answer and a new turn after that point (a template re-renders a past answer in its own way, e.g.
        without its reasoning), so a checkpoint there is the one it can continue from. None where the
        prompt's text or tokens do not end with the generation prompt's (only that tail is tokenized again)."""
        try:
            head = self.template.render(messages, add_generation_prompt=False)
        except UserError:
            return None
        if not text.startswith(head):
            return None
        tail = self.tokenizer.encode(text[len(head) :], parse_special=True)
        n = len(prompt) - len(tail)
        return n if 0 < n < len(prompt) and prompt[n:] == tail else None

    def completion_job(self, body: dict[str, Any]) -> Job:
        tokenizer = self.tokenizer
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, str):
            prompt = tokenizer.encode(p, parse_special=False)
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            if not all(0 <= t < tokenizer.vocab_size for t in p):
                raise ApiError(400, f"token ids must lie in [0, {tokenizer.vocab_size})", param="prompt")
            prompt = list(p)
        else:
            raise ApiError(400, "missing 'prompt': a string or a list of token ids", param="prompt")
        self.check_context(prompt)
        params, stops = self.sampling(body, len(prompt))
        return Job(prompt, params, stops, max(len(prompt) - COMPLETION_TAIL, 0) or None)

    # ---- the job through the scheduler ----

    async def run(self, job: Job, request: Request) -> AsyncIterator[tuple[str, str | None, sched.Request]]:
        """(text, finish_reason or None, the scheduler's request) as the tokens come."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[list[int] | sched.Done] = asyncio.Queue()

        def put(x: list[int] | sched.Done) -> None:
            loop.call_soon_threadsafe(events.put_nowait, x)

        scheduler = self.scheduler
        req = sched.Request(job.prompt, job.params, put, put, mark=job.mark)
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
                    yield tail, ev.finish_reason if ev.finish_reason != "cancelled" else "stop", req
                    return
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
        return await self.complete(request, "chat", self.chat_job)

    async def completion(self, request: Request) -> Response:
        return await self.complete(request, "completion", self.completion_job)

    async def complete(self, request: Request, kind: str, make: Callable[[dict[str, Any]], Job]) -> Response:
        started = time.monotonic()
        chat = kind == "chat"
        try:
            self.check_key(request)
            body = await self.body_of(request)
            job = make(body)
            stream = body.get("stream", False)
            options = body.get("stream_options") or {}
            if not isinstance(stream, bool) or not isinstance(options, dict):
                raise ApiError(
                    400, "'stream' must be true or false and 'stream_options' an object", param="stream"
                )
            answer = _Answer(
                ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12), int(time.time()), chat,
                self.config.model_id, bool(options.get("include_usage", False)), started,
            )  # fmt: skip
            gen = self.run(job, request)
            if stream:
                first = await anext(gen, None)  # errors before the first token still get a status
                self.metrics.request(kind, 200)
                return StreamingResponse(
                    self.sse(gen, first, answer, kind),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"},
                )
            text, reason, req = "", "stop", None
            async for piece, fin, r in gen:
                text, req = text + piece, r
                reason = fin or reason
            assert req is not None
            self.metrics.finished(req, started, kind)
            choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            return JSONResponse(
                {
                    **answer.head(answer.obj),
                    "choices": [choice],
                    "usage": _usage(req),
                    "timings": _timings(req),
                }
            )
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
        a: _Answer,
        kind: str,
    ) -> AsyncIterator[bytes]:
        req = first[2] if first else None
        reason = None
        try:
            if a.chat:
                yield _data({**a.head("chat.completion.chunk"), "choices": [{"index": 0, "delta": {
                    "role": "assistant", "content": ""}, "finish_reason": None}]})  # fmt: skip
            if first is not None:
                req, reason = first[2], first[1]
                if first[0]:
                    yield a.event(first[0], None)
            if reason is None:
                async for piece, fin, r in gen:
                    req, reason = r, fin
                    if piece:
                        yield a.event(piece, None)
        except ApiError as e:
            yield _data({"error": {"message": e.message, "type": e.kind, "param": None, "code": e.code}})
            return
        finally:
            await gen.aclose()  # a client gone mid-stream: `run` cancels its request, freeing the slot
        yield a.event(None if a.chat else "", reason or "stop", {"timings": _timings(req)} if req else None)
        if a.include_usage and req is not None:
            yield _data({**a.head(a.chunk), "choices": [], "usage": _usage(req)})
        yield b"data: [DONE]\n\n"
        if req is not None:
            self.metrics.finished(req, a.started, kind, count=False)

    # ---- the other endpoints ----

    async def models(self, request: Request) -> Response:
        try:
            self.check_key(request)
        except ApiError as e:
            return e.response()
        return JSONResponse(
            {"object": "list", "data": [{"id": self.config.model_id, "object": "model", "created": 0,
             "owned_by": "swarm", "context_length": self.config.ctx_size}]}
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


@dataclass(frozen=True)
class _Answer:
    """One completion's identity in every object it sends back (OpenAI's id, created, model, object)."""

    rid: str
    created: int
    chat: bool
    model: str
    include_usage: bool
    started: float

    @property
    def obj(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk(self) -> str:
        """The object name of a streamed piece."""
        return "chat.completion.chunk" if self.chat else "text_completion"

    def head(self, obj: str) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def event(self, piece: str | None, reason: str | None, extra: dict[str, Any] | None = None) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {} if piece is None else {"content": piece}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": piece or "", "finish_reason": reason, "logprobs": None}
        return _data({**self.head(self.chunk), "choices": [choice], **(extra or {})})


def _data(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
        raise ApiError(400, f"'{name}' must be a number in [{lo}, {hi}]", param=name)
    return float(v)


def _usage(req: sched.Request) -> dict[str, Any]:
    return {
        "prompt_tokens": len(req.prompt),
        "completion_tokens": req.produced,
        "total_tokens": len(req.prompt) + req.produced,
        "prompt_tokens_details": {"cached_tokens": req.cached},
    }


def _timings(req: sched.Request) -> dict[str, Any]:
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


async def _not_found(request: Request, exc: Exception) -> Response:
    return ApiError(404, f"no route {request.url.path}; see /v1/models, /v1/chat/completions").response()


async def _bad_method(request: Request, exc: Exception) -> Response:
    return ApiError(405, f"{request.method} is not allowed on {request.url.path}").response()
