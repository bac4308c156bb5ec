"""Draft tokens from the conversation itself (prompt lookup): where the last few tokens of a sequence occurred
before in it, the tokens that followed them then are proposed as what comes next. No model: it costs a scan
of the sequence's tokens, and on text that repeats (code being edited, a quoted passage, a list continued) a
pass that checks k drafts at once yields up to k + 1 tokens for one round trip per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

# The longest suffix looked up first: a longer match predicts better; shorter ones are tried when it fails.
MAX_NGRAM = 4
MIN_NGRAM = 2  # a single repeated token is too weak a hint in most text


def lookup_drafts(tokens: Sequence[int], k: int, max_n: int = MAX_NGRAM, min_n: int = MIN_NGRAM) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the sequence's last n tokens (n
    from max_n down to min_n; the first n that occurs wins); [] when none occurs. Drafts run past the end of
    the occurrence's continuation only as far as the sequence goes."""
    if k <= 0:
        return []
    t = np.asarray(tokens, dtype=np.int64)
    size = len(t)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        # starts i < size - n whose n tokens equal the tail (vectorised: a conversation of thousands of
        # tokens is scanned for every sequence at every decode step)
        hits = t[: size - n] == t[size - n]
        for j in range(1, n):
            hits &= t[j : size - n + j] == t[size - n + j]
        found = np.flatnonzero(hits)
        if found.size:
            i = int(found[-1])  # the latest
            return t[i + n : i + n + k].tolist()
    return []


class Drafter(Protocol):
    """What proposes a decode step's drafts: the sequence's tokens so far (its prompt and every token
    sampled, the last of them not yet fed) -> guesses at the tokens that follow, in order (may be none)."""

    def __call__(self, tokens: Sequence[int]) -> Sequence[int]: ...


@dataclass(frozen=True)
class PromptLookup:
    """`--draft ngram`: up to k drafts by lookup_drafts."""

    k: int = 3

    def __call__(self, tokens: Sequence[int]) -> Sequence[int]:
        return lookup_drafts(tokens, self.k)


@dataclass(frozen=True)
class Scripted:
    """Drafts read from a known text: the k tokens that follow the sequence in `text` while the sequence is
    a prefix of it, else none. Fed the continuation of an earlier greedy run of the same prompt, every draft
    is right: what measures the checking window itself (benchmarks, tests), not a way to guess."""

    text: tuple[int, ...]
    k: int = 3

    def __call__(self, tokens: Sequence[int]) -> Sequence[int]:
        n = len(tokens)
        if n >= len(self.text) or tuple(tokens) != self.text[:n]:
            return ()
        return self.text[n : n + self.k]
