"""What the serve scheduler (scheduler.py) keeps per request and per slot."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from swarm.coordinator.decode.core import Conversation
from swarm.coordinator.decode.sampling import SamplingParams

# A checkpoint this many tokens before a prompt's end, where its request names no better place (Request.mark):
# a conversation sent again usually differs from what a slot holds only from the last turn's generation
# prompt on. The pass that reads past that place keeps the state there (Entry.mark: the DeltaNet layers run
# their rule in two ops) rather than stopping at it: a pass of its own for the tail would add to every
# prompt's read (docs/BENCHMARKS.md).
CHECKPOINT_BEFORE_END = 16


class QueueFull(Exception):
    """More requests wait than the queue takes."""


@dataclass
class Done:
    finish_reason: str  # "stop", "length", "cancelled", or "error"
    error: str | None = None
    status: int = 200  # the HTTP status an error maps to


@dataclass(eq=False)
class Request:
    """One generation. `on_tokens` and `on_done` are called from the engine thread."""

    prompt: list[int]
    params: SamplingParams
    on_tokens: Callable[[list[int]], None]
    on_done: Callable[[Done], None]
    submitted: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    cached: int = 0  # prompt tokens taken from a slot's held state
    prompt_seconds: float = 0.0  # from admission to the first token
    # Where in the prompt to keep a checkpoint before its end (None: CHECKPOINT_BEFORE_END before it): the
    # place a client that sends the prompt again with a different ending is likely to still agree with.
    mark: int | None = None
    cancelled: bool = False
    admitted: float | None = None
    produced: int = 0
    pictures: Any = None  # the prompt's pictures (models.base.PictureRows over the whole prompt), or None
    # the prompt as slots match it: its pictures' rows as numbers from their pixels' hash (pictures.PicturePrompt)
    keys: list[int] | None = None
    # what ends it at a stop string (decode/core.py StopStrings; the answer's text is cut by openai_answer's)
    stop_text: Any = None
    # what changes each row of logits before its token is picked (decode/sampling.py LogitsProcessor)
    processors: tuple[Any, ...] = ()
    # tokens known to come next, drafted first (a grammar's forced ones: decode/core.py Conversation.forced)
    forced: Any = None
    # told every token picked with the row it was picked from (decode/logprobs.py Logprobs.record)
    record: Any = None

    def match(self) -> list[int]:
        """The prompt as a slot's history holds it: a held picture counts only where it is the same."""
        return self.keys if self.keys is not None else self.prompt

    def checkpoint_at(self) -> int:
        """The prompt position of the checkpoint kept before its end."""
        return self.mark if self.mark is not None else len(self.prompt) - CHECKPOINT_BEFORE_END


@dataclass(eq=False)
class Slot:
    index: int
    state: Any = None  # the model's SequenceState, kept between requests
    head_state: Any = None  # its MTP head's state (with --mtp), at the same position as `state`
    # the tokens `state` holds (when idle), each picture's rows as Request.match gives them
    history: list[int] = field(default_factory=list)
    checkpoints: dict[int, Any] = field(default_factory=dict)  # position -> state checkpoint
    request: Request | None = None
    conv: Conversation | None = None  # its request's conversation in the decode core
    used: float = 0.0

    @property
    def fed(self) -> int:
        """Prompt tokens its request has read."""
        return self.conv.fed if self.conv is not None else 0
