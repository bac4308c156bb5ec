"""An OpenAI request body, checked and turned into a Job: prompt tokens (the GGUF's chat template for
chats), sampling parameters and stop strings. Whatever is wrong raises ApiError, an OpenAI error object."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swarm.coordinator.decode.sampling import SamplingParams
from swarm.coordinator.serve.api_error import ApiError
from swarm.coordinator.serve.openai_decoding import Decoding, decoding
from swarm.coordinator.serve.openai_tools import ToolRequest, chat_request
from swarm.coordinator.serve.picture_source import picture_bytes
from swarm.coordinator.text.chat import ChatTemplate
from swarm.coordinator.text.tokenizer import GGUFTokenizer
from swarm.coordinator.text.tools import ChatFormat
from swarm.sharding.errors import UserError

MAX_STOPS = 4  # stop strings per request, as OpenAI allows
# A plain completion's prompt keeps a checkpoint this many tokens before its end (llama-server's choice): a
# client that sends it again with its answer appended continues from the slot's whole state, and one that
# changes only the last tokens from there (the pass that reads the prompt's end keeps it: no pass of its own).
COMPLETION_TAIL = 4


@dataclass
class Job:
    """What one request asks for, in tokens."""

    prompt: list[int]
    params: SamplingParams
    stops: list[str]
    mark: int | None = None  # where the scheduler keeps a checkpoint before the prompt's end
    pictures: Any = None  # the prompt's pictures (models.base.PictureRows), or None
    keys: list[int] | None = None  # the prompt as slots match it (pictures.PicturePrompt.keys)
    tools: ToolRequest | None = None  # a chat's tools and how its answer is read (openai_tools.py)
    # its grammar, penalties and logprobs: the decode core's hooks (openai_decoding.py)
    decoding: Decoding | None = None


class JobReader:
    """Reads request bodies into Jobs for one model: its tokenizer, its chat template, the server's context."""

    def __init__(
        self,
        tokenizer: GGUFTokenizer,
        template: ChatTemplate,
        ctx_size: int,
        vision: Any = None,
        allow_image_urls: bool = False,
        reasoning_format: str = "auto",
    ) -> None:
        self.tokenizer, self.template, self.ctx_size = tokenizer, template, ctx_size
        self.format = ChatFormat.of_template(template.source)  # the template's call family, its thinking
        self.reasoning_format = reasoning_format  # the server's default (openai_tools.REASONING_FORMATS)
        self.vision = vision  # the vision tower (text.pictures.PictureEncoder), None: no pictures
        self.allow_image_urls = allow_image_urls

    def sampling(self, body: dict[str, Any], n_prompt: int) -> tuple[SamplingParams, list[str]]:
        room = self.ctx_size - n_prompt
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
            min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
            seed=seed,
            stop_ids=self.tokenizer.eos_ids,
        )
        return params, stops

    def check_context(self, prompt: list[int], picture_rows: int = 0) -> None:
        if not prompt:
            raise ApiError(400, "the prompt is empty after tokenization", param="prompt")
        if len(prompt) >= self.ctx_size:
            of = f" ({picture_rows} of them its pictures' rows)" if picture_rows else ""
            fix = (
                ": shorten it, or send smaller pictures (or start the server with a lower --image-max-tokens)"
            )
            raise ApiError(
                400,
                f"the prompt has {len(prompt)} tokens{of} but the context is {self.ctx_size} tokens "
                "(the server's --ctx-size)" + (fix if picture_rows else ": shorten it"),
                code="context_length_exceeded",
                param="messages",
            )

    def chat_job(self, body: dict[str, Any]) -> Job:
        plain, images = _plain_messages(body.get("messages"))
        chat = chat_request(body, plain, self.reasoning_format)
        try:
            text = self.template.render(chat.messages, add_generation_prompt=True, **chat.variables)
        except UserError as e:
            raise ApiError(400, str(e), param="messages") from None
        if not images:
            prompt = self.tokenizer.encode(text, parse_special=True)
            pictures = keys = None
        else:
            prompt, pictures, keys = self._with_pictures(text, images)
        self.check_context(prompt, int(pictures.at.numel()) if pictures is not None else 0)
        params, stops = self.sampling(body, len(prompt))
        mark = self._turn_end(chat.messages, text, prompt, chat.variables)
        tools = chat.read_as(self.format, text)
        hooks = decoding(body, self.tokenizer, prompt, chat=True, tools=tools, thinking=bool(tools.reading.opened))
        return Job(prompt, params, stops, mark, pictures, keys, tools, hooks)

    def _with_pictures(self, text: str, images: list[Any]) -> tuple[list[int], Any, list[int]]:
        """(prompt tokens, pictures, keys) of a chat's text whose pictures stand at pictures.MARKER."""
        from swarm.coordinator.text.pictures import picture_prompt

        if self.vision is None:
            raise ApiError(
                400, "this model reads no pictures here: the server runs without a vision tower (start "
                "`swarm serve` with --mmproj FILE, the model's mmproj GGUF)", param="messages",
            )  # fmt: skip
        data = [picture_bytes(src, i, self.allow_image_urls) for i, src in images]
        try:
            p = picture_prompt(self.tokenizer, self.vision, text, data)
        except UserError as e:
            raise ApiError(400, f"a picture cannot be used: {e}", param="messages") from None
        return p.tokens, p.pictures, p.keys

    def _turn_end(
        self, messages: list[dict[str, Any]], text: str, prompt: list[int], variables: dict[str, Any]
    ) -> int | None:
        """Where the conversation ends before the generation prompt: a chat app sends it again with the
        answer and a new turn after that point (a template re-renders a past answer in its own way, e.g.
        without its reasoning), so a checkpoint there is the one it can continue from. None where the
        prompt's text or tokens do not end with the generation prompt's (only that tail is tokenized again)."""
        try:
            head = self.template.render(messages, add_generation_prompt=False, **variables)
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
        hooks = decoding(body, tokenizer, prompt, chat=False)
        return Job(prompt, params, stops, max(len(prompt) - COMPLETION_TAIL, 0) or None, decoding=hooks)


def _plain_messages(messages: Any) -> tuple[list[dict[str, Any]], list[tuple[int, Any]]]:
    """The chat's messages with every content a plain string (text content parts joined, each picture part
    as pictures.MARKER), and the pictures' sources in order, with the index of their message."""
    from swarm.coordinator.text.pictures import MARKER

    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "missing 'messages': a list of {role, content} objects", param="messages")
    plain = []
    images: list[tuple[int, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] needs a 'role' and a 'content'", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text, and pictures as image_url parts
            texts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                elif kind == "image_url":
                    url = part.get("image_url")
                    images.append((i, url.get("url") if isinstance(url, dict) else url))
                    texts.append(MARKER)
                else:
                    raise ApiError(
                        400, f"messages[{i}]: content parts must be text or image_url ones", param="messages"
                    )
            if images and any(MARKER in t for t in texts if t != MARKER):
                raise ApiError(400, f"messages[{i}]: the text holds {MARKER}, the mark of a picture's place",
                               param="messages")  # fmt: skip
            content = "".join(texts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or content parts", param="messages")
        plain.append({**m, "content": content})
    return plain, images


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
        raise ApiError(400, f"'{name}' must be a number in [{lo}, {hi}]", param=name)
    return float(v)
