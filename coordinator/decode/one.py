"""One conversation through the decode core (core.py): `swarm run`'s generation with its timing, `swarm
logits`' checked logits, `swarm demo`'s greedy trace; and forward_one, one bare model call.

Dimension letters: T tokens, V vocabulary.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from swarm.coordinator.decode.core import Conversation, DecodeCore, lookup_source
from swarm.coordinator.decode.passes import CausalLM, Checker
from swarm.coordinator.decode.sampling import LogitsProcessor, SamplingParams


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    finish_reason: str = "length"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        # The first generated token comes out of prefill; decode steps produce the rest.
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds > 0 else 0.0


def forward_one(
    model: CausalLM,
    tokens: Sequence[int],
    state: Any,
    device: torch.device | str,
    last_only: bool = False,
    pictures: Any = None,
) -> torch.Tensor:
    """Feed one sequence's tokens (`pictures`: a picture's rows among them, models.base.PictureRows); logits [T, V] (or
    [1, V] with last_only)."""
    ids = torch.tensor(list(tokens), dtype=torch.long, device=device)
    extra = {"pictures": [pictures]} if pictures is not None else {}
    with torch.inference_mode():
        return model(ids, [state], [len(tokens)], last_only=last_only, **extra)


def checked_logits(
    model: CausalLM,
    tokens: Sequence[int],
    state: Any,
    device: torch.device | str,
    checker: Checker | None,
    pictures: Any = None,
) -> torch.Tensor:
    """forward_one's logits [T, V], once the nodes' answers behind them are checked."""
    core = DecodeCore(model, device, checker)
    conv = core.open(tokens, None, state=state, pictures=pictures)
    while not conv.seq.ready:
        core.step(core.plan([conv])[0])
    return conv.seq.ready[0]


def generate(
    model: CausalLM,
    prompt: Sequence[int],
    params: SamplingParams,
    device: torch.device | str = "cpu",
    stats: GenerationStats | None = None,
    clock: Callable[[], float] = time.perf_counter,
    checker: Checker | None = None,
    drafter: Callable[[Sequence[int]], Sequence[int]] | None = None,
    mtp_drafter: Any = None,
    pictures: Any = None,
    processors: Sequence[LogitsProcessor] = (),
) -> Iterator[int]:
    """Yield generated token ids one by one; `stats` (if given) is filled in as it goes. With a `checker`,
    tokens come once the nodes' answers behind them are checked (see passes.Passes): a few at a time. With a
    `drafter` (drafts/lookup.py: the tokens so far -> guesses at the next ones), or `mtp_drafter` (an MTPDrafter:
    the model's own MTP head), each decode step checks its drafts in one pass; the tokens are the same as
    without. `pictures`: the prompt's pictures (models.base.PictureRows, text/pictures.py); `processors`: what changes
    each row of logits before its token is picked (decode/sampling.py)."""
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt)
    core = DecodeCore(
        model, device, checker, drafts=lookup_source(drafter) if drafter else None, mtp_drafter=mtp_drafter
    )
    conv = core.open(prompt, params, pictures=pictures, processors=processors)
    try:
        t0 = clock()
        while conv.reading or core.pending:  # the first token is the one a user waits for: settle it at once
            core.step(core.plan([conv])[0])
        stats.prefill_seconds = clock() - t0
        t0, passes = clock(), 0
        while True:
            for token in core.collect(conv):
                stats.generated_tokens += 1
                yield token
            stats.decode_seconds = clock() - t0
            if conv.finish is not None:
                stats.finish_reason = conv.finish
                return
            entries = core.plan([conv])[0]
            core.step(entries)
            passes += bool(entries)
            _note(stats, core, conv, passes, drafting=drafter is not None or mtp_drafter is not None)
    finally:
        core.close()


def _note(stats: GenerationStats, core: DecodeCore, conv: Conversation, passes: int, drafting: bool) -> None:
    """The run's counters so far: passes redone, and the drafts' (with drafts)."""
    stats.extra["redone_passes"] = core.passes.redone
    if drafting:
        made = conv.produced() - 1  # by decode passes (the first token comes out of the prompt's pass)
        p = core.passes
        stats.extra.update(
            drafted=p.drafted,
            accepted=p.accepted,
            windows=p.windows,
            tokens_per_pass=made / passes if passes else 0.0,
        )


def greedy_trace(
    model: CausalLM,
    prompt: Sequence[int],
    steps: int,
    device: torch.device | str,
    checker: Checker | None = None,
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the logits that chose them, through the core and its answer checks: `steps` tokens,
    and steps + 1 rows of logits [steps + 1, V] (prefill's last row, then one row per decode step)."""
    rows: dict[int, torch.Tensor] = {}

    def record(logits: torch.Tensor, position: int, before: Sequence[int]) -> torch.Tensor:
        rows[position] = logits.detach().clone()  # a redo writes its position again
        return logits

    params = SamplingParams(max_tokens=steps + 1, stop_ids=frozenset())
    tokens = list(generate(model, prompt, params, device, checker=checker, processors=(record,)))
    return tokens[:steps], torch.stack([rows[p] for p in sorted(rows)])
