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


class Checker(Protocol):
    """What checks the nodes' answers (swarm.coordinator.audit.Auditor): after each forward pass, whether
    everything since the last settled point is checked, still open, or was shaped by a node now banned."""

    def settle(self, force: bool = False) -> Any: ...


# A pass whose answers are not all checked yet is held back; after this many, the checker is made to settle.
SETTLE_EVERY = 4


class CheckedRun:
    """Forward passes of one sequence whose results count only once the nodes' answers behind them are checked.

    Each pass is remembered (its tokens and the token sampled after it) back to the last settled point, where
    the sequence state and the sampler are checkpointed. When the checker catches a node, the state and the
    sampler go back to that point and the passes are done again (the node is banned: other holders or the
    coordinator answer for it), so nothing a wrong answer shaped survives. Without a checker every pass
    settles at once and nothing is held back.
    """

    def __init__(
        self,
        model: CausalLM,
        state: Any,
        device: torch.device,
        sampler: Sampler | None,
        checker: Checker | None,
    ) -> None:
        self.model, self.state, self.device, self.sampler, self.checker = (
            model,
            state,
            device,
            sampler,
            checker,
        )
        self.passes: list[tuple[list[int], bool]] = []  # (tokens fed, last_only) since the settled point
        self.outputs: list[Any] = []  # what each of those passes gave (a token, or logits without a sampler)
        self.redone = 0  # passes done again after a node was caught
        self._anchor = self._checkpoint()

    def _checkpoint(self) -> Any:
        if self.checker is None:
            return None
        rng = self.sampler.generator.get_state() if self.sampler is not None else None
        return self.state.checkpoint(), rng

    def _one(self, tokens: list[int], last_only: bool) -> Any:
        logits = forward_one(self.model, tokens, self.state, self.device, last_only=last_only)
        return self.sampler(logits[-1]) if self.sampler is not None else logits

    def step(self, tokens: Sequence[int], last_only: bool = False) -> list[Any]:
        """Feed one pass; the outputs now settled, oldest first (several after a hold, none while open)."""
        self.passes.append((list(tokens), last_only))
        self.outputs.append(self._one(list(tokens), last_only))
        return self._settle(force=len(self.passes) >= SETTLE_EVERY)

    def finish(self) -> list[Any]:
        """Settle whatever is still held (the end of a generation)."""
        return self._settle(force=True) if self.passes else []

    def _settle(self, force: bool) -> list[Any]:
        if self.checker is None:
            out, self.passes, self.outputs = self.outputs, [], []
            return out
        while True:
            verdict = self.checker.settle(force=force).value
            if verdict == "caught":
                self._redo()
                continue
            if verdict == "open" and not force:
                return []
            if verdict == "open":
                continue  # forced: the checker audits what is open until it settles or catches someone
            out, self.passes, self.outputs = self.outputs, [], []
            self._anchor = self._checkpoint()
            return out

    def _redo(self) -> None:
        state_cp, rng = self._anchor
        self.state.restore(state_cp)
        if self.sampler is not None and rng is not None:
            self.sampler.generator.set_state(rng)
        self.redone += len(self.passes)
        # the same passes as before: a pass's tokens are what the earlier passes sampled, so they are
        # recomputed in order (an honest swarm gives the same bits; a changed token changes what follows)
        passes, self.passes, self.outputs = self.passes, [], []
        feed: list[int] | None = None
        for i, (tokens, last_only) in enumerate(passes):
            tokens = tokens if i == 0 or feed is None else feed
            self.passes.append((tokens, last_only))
            out = self._one(tokens, last_only)
            self.outputs.append(out)
            feed = [out] if isinstance(out, int) else None


def checked_logits(
    model: CausalLM, tokens: Sequence[int], state: Any, device: torch.device | str, checker: Checker | None
) -> torch.Tensor:
    """forward_one's logits [T, V], once the nodes' answers behind them are checked."""
    run = CheckedRun(model, state, torch.device(device), None, checker)
    out = run.step(list(tokens)) or run.finish()
    return out[0]


def generate(
    model: CausalLM,
    prompt: Sequence[int],
    params: SamplingParams,
    device: torch.device | str = "cpu",
    stats: GenerationStats | None = None,
    clock: Callable[[], float] = time.perf_counter,
    checker: Checker | None = None,
) -> Iterator[int]:
    """Yield generated token ids one by one; `stats` (if given) is filled in as it goes. With a `checker`,
    tokens come once the nodes' answers behind them are checked (see CheckedRun): a few at a time."""
    if not prompt:
        raise ValueError("empty prompt: give at least one token")
    device = torch.device(device)
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt)
    sampler = Sampler(params, device)
    run = CheckedRun(model, model.new_state(), device, sampler, checker)

    t0 = clock()
    ready: list[int] = run.step(prompt, last_only=True)
    if checker is not None and not ready:
        ready = run.finish()  # the first token is the one a user waits for: settle it at once
    stats.prefill_seconds = clock() - t0
    produced = 1  # tokens sampled so far (some may still be held back)
    last = ready[-1] if ready else None

    t0 = clock()
    while True:
        for token in ready:
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
        held = run.outputs[-1] if run.outputs else last
        if produced >= params.max_tokens or (held in params.stop_ids):
            ready = run.finish()  # nothing more to compute: release what is held
        else:
            ready = run.step([held])  # type: ignore[list-item]
            produced += 1
        if ready:
            last = ready[-1]
        stats.extra["redone_passes"] = run.redone
        stats.decode_seconds = clock() - t0
