"""Sampling: each next token from the logits at its position, greedy or by a draw keyed by (seed, position).

Dimension letters: V vocabulary.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest (at the temperature); 0 = off
    seed: int | None = None
    stop_ids: frozenset[int] = frozenset()


# What may change a row of logits before a token is picked from it (grammars, penalties; a recorder of the
# rows): (logits [V], the position of the token picked from them, the sequence's tokens before that position,
# prompt included) -> logits [V]. Called once per token picked, in position order within a pass; a checking
# window's rows and a redo after a caught node call it again for positions it has seen, with the tokens
# before them as they are then: it keeps no state a position it has seen relies on, or rolls it back.
LogitsProcessor = Callable[[torch.Tensor, int, Sequence[int]], torch.Tensor]

_MASK64 = (1 << 64) - 1


def position_uniform(seed: int, position: int) -> float:
    """A number in [0, 1) that depends on (seed, position) alone (splitmix64 of their mix): the token sampled at
    a position is the same however the pass that reached it was made (one token per pass, several drafts
    checked in one window, a redo after a caught node, the same sequence alone or beside others)."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


class Sampler:
    """Picks each next token: greedy at temperature 0, else from the temperature / top-k / min-p / top-p distribution
    by the inverse of its cumulative sum at position_uniform(seed, position) (a seed drawn at random when the
    request gives none), after its logits processors (in order). It keeps no state between calls."""

    def __init__(
        self,
        params: SamplingParams,
        processors: Sequence[LogitsProcessor] = (),
        history: Callable[[int], Sequence[int]] | None = None,
        record: Callable[[int, int, torch.Tensor], None] | None = None,
    ) -> None:
        """`history`: a position -> the sequence's tokens before it (what processors are given); `record`:
        given (position, the token picked, the row after the processors) for each token (decode/logprobs.py)."""
        self.params = params
        self.processors = tuple(processors)
        self.history = history
        self.record = record
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)

    def __call__(self, logits: torch.Tensor, position: int) -> int:
        """logits [V] of the token at `position` (the tokens before it) -> its id."""
        if self.processors:
            before = self.history(position) if self.history is not None else ()
            for process in self.processors:
                logits = process(logits, position, before)
        token = self._pick(logits, position)
        if self.record is not None:
            self.record(position, token, logits)
        return token

    def _pick(self, logits: torch.Tensor, position: int) -> int:
        p = self.params
        if p.temperature <= 0:
            return int(torch.argmax(logits).item())
        scores = logits.detach().float().cpu() / p.temperature
        if p.top_k > 0 and p.top_k < scores.numel():
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            cut = torch.cumsum(sorted_probs, 0) - sorted_probs >= p.top_p
            sorted_probs[cut] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        cdf = torch.cumsum(probs.double(), 0)
        at = torch.searchsorted(cdf, position_uniform(self.seed, position) * float(cdf[-1]), right=True)
        return min(int(at), int(torch.nonzero(probs).max()))  # never past the last token with mass
