"""The log-probabilities of the tokens an answer is made of, for clients that ask (OpenAI's `logprobs`).

They are of the model's distribution after the request's logits processors (the penalties, a grammar's mask)
and before temperature, top-k, top-p and min-p: llama-server's and vLLM's defaults give the raw model's
distribution, but a token a grammar forbids has no probability here, and a penalty is part of what the
request asked the model to be. The Sampler hands each token it picks to `Logprobs.record` with the row it was
picked from; entries are keyed by position, so a redo writes the same ones again.

Dimension letters: V vocabulary.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import numpy as np
import torch

# What OpenAI answers for a token with no probability (a logprob must be a JSON number).
FLOOR = -9999.0


class TokenLogprob(NamedTuple):
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely tokens at its place, most likely first


class Logprobs:
    """Per position of an answer: the token picked there, its logprob and the `top` most likely (0-20)."""

    def __init__(self, top: int) -> None:
        self.top = top
        self.at: dict[int, TokenLogprob] = {}
        self._lock = threading.Lock()  # written on the engine thread, read on the API's

    def record(self, position: int, token: int, logits: torch.Tensor) -> None:
        row = logits.detach().float().cpu().numpy()  # [V]
        peak = float(np.max(row))
        if not np.isfinite(peak):
            entry = TokenLogprob(token, FLOOR, ())
        else:
            lse = peak + float(np.log(np.sum(np.exp(row - peak, dtype=np.float64))))
            top: tuple[tuple[int, float], ...] = ()
            if self.top > 0:
                k = min(self.top, len(row))
                best = np.argpartition(-row, k - 1)[:k]
                best = best[np.lexsort((best, -row[best]))]  # most likely first, lower id first on ties
                top = tuple((int(i), _finite(float(row[i]) - lse)) for i in best)
            entry = TokenLogprob(token, _finite(float(row[token]) - lse), top)
        with self._lock:
            self.at[position] = entry

    def of(self, position: int) -> TokenLogprob | None:
        with self._lock:
            return self.at.get(position)


def _finite(x: float) -> float:
    return max(x, FLOOR) if np.isfinite(x) else FLOOR
