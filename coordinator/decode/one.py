"""Token generation over any model of coordinator/models: prefill, decode, timing (sampling in sampling.py,
the passes in steps.py).

Dimension letters: T tokens, V vocabulary.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from swarm.coordinator.decode.passes import CausalLM, Checker, Entry, Seq, Steps
from swarm.coordinator.decode.sampling import Sampler, SamplingParams


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
    rows: Any = None,
) -> torch.Tensor:
    """Feed one sequence's tokens (`rows`: a picture's rows among them, models.base.Rows); logits [T, V] (or
    [1, V] with last_only)."""
    ids = torch.tensor(list(tokens), dtype=torch.long, device=device)
    extra = {"inputs": [rows]} if rows is not None else {}
    with torch.inference_mode():
        return model(ids, [state], [len(tokens)], last_only=last_only, **extra)


def checked_logits(
    model: CausalLM,
    tokens: Sequence[int],
    state: Any,
    device: torch.device | str,
    checker: Checker | None,
    rows: Any = None,
) -> torch.Tensor:
    """forward_one's logits [T, V], once the nodes' answers behind them are checked."""
    seq, steps = Seq(state), Steps(model, device, checker)
    steps.join(seq)
    steps.step([Entry(seq, tuple(tokens), rows=rows)])
    if not seq.ready:
        steps.finish()
    return seq.ready[0]


def generate(
    model: CausalLM,
    prompt: Sequence[int],
    params: SamplingParams,
    device: torch.device | str = "cpu",
    stats: GenerationStats | None = None,
    clock: Callable[[], float] = time.perf_counter,
    checker: Checker | None = None,
    drafter: Callable[[Sequence[int]], Sequence[int]] | None = None,
    mtp: Any = None,
    rows: Any = None,
) -> Iterator[int]:
    """Yield generated token ids one by one; `stats` (if given) is filled in as it goes. With a `checker`,
    tokens come once the nodes' answers behind them are checked (see Steps): a few at a time. With a
    `drafter` (coordinator/drafts/lookup.py: the tokens so far -> guesses at the next ones), or `mtp` (an
    MTPDrafter: the model's own MTP head), each decode step checks its drafts in one pass (see Steps); the
    tokens are the same as without. `rows`: the prompt's pictures (models.base.Rows, coordinator.pictures)."""
    if not prompt:
        raise ValueError("empty prompt: give at least one token")
    device = torch.device(device)
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt)
    seq, steps = Seq(model.new_state(), Sampler(params, device)), Steps(model, device, checker, mtp=mtp)
    if mtp is not None:
        seq.mtp = mtp.new_state()
    steps.join(seq)

    t0 = clock()
    steps.step([Entry(seq, tuple(prompt), rows=rows)])
    if not seq.ready:
        steps.finish()  # the first token is the one a user waits for: settle it at once
    stats.prefill_seconds = clock() - t0

    t0 = clock()
    passes = 0
    history = list(prompt)  # the prompt and every token sampled (the last one not yet fed)
    while True:
        taken = seq.take()
        history += taken
        for token in taken:
            stats.generated_tokens += 1
            yield token
            if token in params.stop_ids:
                stats.finish_reason = "stop"
                stats.decode_seconds = clock() - t0
                return
            if stats.generated_tokens >= params.max_tokens:
                stats.finish_reason = "length"
                stats.decode_seconds = clock() - t0
                return
        produced = stats.generated_tokens + len(seq.held)  # sampled so far (some still held back)
        if produced >= params.max_tokens or any(t in params.stop_ids for t in seq.held):
            steps.finish()  # nothing more to compute: release what is held
        else:
            drafts = (
                seq.proposed if mtp is not None else tuple(drafter(history + seq.held)) if drafter else ()
            )
            steps.step([Entry(seq, drafts=drafts[: params.max_tokens - produced - 1])])
            passes += 1
        stats.extra["redone_passes"] = steps.redone
        if drafter is not None or mtp is not None:
            made = stats.generated_tokens + len(seq.held) + len(seq.ready) - 1  # by decode passes
            stats.extra.update(
                drafted=steps.drafted,
                accepted=steps.accepted,
                windows=steps.windows,
                tokens_per_pass=made / passes if passes else 0.0,
            )
        stats.decode_seconds = clock() - t0
