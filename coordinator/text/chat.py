"""Chat prompts: the GGUF's `tokenizer.chat_template` rendered with jinja2, the way transformers renders it.

The environment matches what model authors write their templates against (transformers'
`apply_chat_template`): a sandbox (templates come with downloaded files), `trim_blocks` and
`lstrip_blocks`, the loop-control extension (`break` / `continue`), a `tojson` filter that keeps non-ASCII
text as is, and the globals `raise_exception(msg)` and `strftime_now(fmt)`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from gguf import Keys
from jinja2.sandbox import ImmutableSandboxedEnvironment

from swarm.coordinator.text.tokenizer import GGUFTokenizer
from swarm.sharding.errors import UserError

log = logging.getLogger(__name__)

# Used when a GGUF has no template: plain ChatML, the format every Qwen model is trained on.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class TemplateRaised(UserError):
    """The template refused the conversation (its own `raise_exception`, e.g. 'No user query found')."""


def _raise_exception(message: str) -> None:
    raise TemplateRaised(f"the chat template rejects this conversation: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson HTML-escapes <, >, & and ' — wrong for prompts, so templates get plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> jinja2.Environment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols],
        keep_trailing_newline=False,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template. `source=None` (a GGUF without one) falls back to ChatML with a warning."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "") -> None:
        if not source:
            log.warning("the model has no tokenizer.chat_template; formatting chats as plain ChatML")
            source = CHATML_TEMPLATE
            self.is_fallback = True
        else:
            self.is_fallback = False
        self.source: str = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise UserError(
                f"the model's chat template does not compile (line {e.lineno}: {e.message}); "
                "use --prompt without --chat, or a GGUF with a working template"
            ) from e

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], bos_token: str = "", eos_token: str = "") -> ChatTemplate:
        """The template of a GGUF's metadata (`tokenizer.chat_template`), ChatML when it has none."""
        source = meta.get(Keys.Tokenizer.CHAT_TEMPLATE)
        return cls(source if isinstance(source, str) else None, bos_token, eos_token)

    @classmethod
    def from_tokenizer(cls, tokenizer: GGUFTokenizer) -> ChatTemplate:
        """The template the tokenizer's GGUF carries, with its BOS/EOS texts as `bos_token`/`eos_token`."""

        def text(token_id: int | None) -> str:
            return (
                tokenizer.tokens[token_id]
                if token_id is not None and 0 <= token_id < tokenizer.vocab_size
                else ""
            )

        return cls(tokenizer.chat_template, text(tokenizer.bos_id), text(tokenizer.eos_id))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]).

        enable_thinking: passed to the template only when given (Qwen3.5 templates think by default and
        pre-fill an empty <think></think> block when it is False). Extra keyword arguments reach the
        template as variables, as in transformers.
        """
        if not messages:
            raise UserError("a chat needs at least one message")
        context: dict[str, Any] = {
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **extra,
        }
        if tools is not None:
            context["tools"] = [dict(t) for t in tools]
        if enable_thinking is not None:
            context["enable_thinking"] = enable_thinking
        try:
            return self._template.render(**context)
        except TemplateRaised:
            raise
        except jinja2.TemplateError as e:
            raise UserError(f"the model's chat template failed on this conversation: {e}") from e


def render_chat(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = None,
    **extra: Any,
) -> str:
    """One-shot `ChatTemplate(template).render(...)`."""
    return ChatTemplate(template).render(
        messages, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking, **extra
    )


def prompt_ids(tokenizer: GGUFTokenizer, prompt: str, chat: bool, system: str | None = None) -> list[int]:
    """A prompt's token ids: as text, or (`chat`) as one user turn, after an optional system turn, rendered by
    the model's chat template."""
    if not chat:
        return tokenizer.encode(prompt, parse_special=False)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    text = ChatTemplate.from_tokenizer(tokenizer).render(messages, add_generation_prompt=True)
    return tokenizer.encode(text, parse_special=True)
