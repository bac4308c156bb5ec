"""Token generation over any model of coordinator/models: sampling, prefill, decode, timing.

Dimension letters: T tokens, V vocabulary.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class CausalLM(Protocol):
    """What every architecture in coordinator/models implements."""

    def new_state(self) -> Any: ...

    def __call__(
        self, tokens: torch.Tensor, states: Sequence[Any], lengths: Sequence[int]
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    seed: int | None = None
    stop_ids: frozenset[int] = frozenset()


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


class Sampler:
    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu") -> None:
        self.params = params
        self.generator = torch.Generator(device="cpu")
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """logits [V] -> the next token id."""
        p = self.params
        if p.temperature <= 0:
            return int(torch.argmax(logits).item())
        scores = logits.detach().float().cpu() / p.temperature
        if p.top_k > 0 and p.top_k < scores.numel():
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            cut = torch.cumsum(sorted_probs, 0) - sorted_probs >= p.top_p
            sorted_probs[cut] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator).item())


def forward_one(
    model: CausalLM, tokens: Sequence[int], state: Any, device: torch.device | str, last_only: bool = False
) -> torch.Tensor:
    """Feed one sequence's tokens; logits [T, V] (or [1, V] with last_only)."""
    ids = torch.tensor(list(tokens), dtype=torch.long, device=device)
    with torch.inference_mode():
        return model(ids, [state], [len(tokens)], last_only=last_only)


def generate(
    model: CausalLM,
    prompt: Sequence[int],
    params: SamplingParams,
    device: torch.device | str = "cpu",
    stats: GenerationStats | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Iterator[int]:
    """Yield generated token ids one by one; `stats` (if given) is filled in as it goes."""
    if not prompt:
        raise ValueError("empty prompt: give at least one token")
    device = torch.device(device)
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt)
    sampler = Sampler(params, device)
    state = model.new_state()

    t0 = clock()
    logits = forward_one(model, prompt, state, device, last_only=True)[-1]
    token = sampler(logits)
    stats.prefill_seconds = clock() - t0

    t0 = clock()
    while True:
        stats.generated_tokens += 1
        yield token
        if token in params.stop_ids:
            stats.finish_reason = "stop"
            break
        if stats.generated_tokens >= params.max_tokens:
            stats.finish_reason = "length"
            break
        logits = forward_one(model, [token], state, device)[-1]
        token = sampler(logits)
        stats.decode_seconds = clock() - t0
    stats.decode_seconds = clock() - t0
