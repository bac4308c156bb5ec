"""The penalties a client asks for against repeating itself, as a LogitsProcessor (decode/sampling.py).

As vLLM and OpenAI define them: `presence` is taken once from the logit of every token the answer holds,
`frequency` once for every time it holds it (both over the answer's tokens, not the prompt's); `repetition`
(the CTRL paper's, as transformers and llama.cpp apply it) divides a positive logit and multiplies a negative
one, for every token of the prompt or the answer. They read only the tokens before the position they are
given, so a checking window's rows and a redo get the penalties of their own prefix: the text is the same
with drafts and without.

Dimension letters: V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Penalties:
    """The answer starts at token `start` of the sequence (the prompt's length)."""

    start: int
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    prompt_ids: np.ndarray | None = field(default=None, repr=False)  # the prompt's distinct tokens, once read

    @property
    def active(self) -> bool:
        return self.presence != 0.0 or self.frequency != 0.0 or self.repetition != 1.0

    def __call__(self, logits: torch.Tensor, position: int, before: Sequence[int]) -> torch.Tensor:
        """logits [V] of the token at `position` -> the penalized row (a new one: the pass's rows stay)."""
        row = np.array(logits.detach().float().cpu().numpy(), dtype=np.float32)  # [V]
        size = len(row)
        if self.repetition != 1.0 and before:
            seen = np.union1d(self._prompt(before), np.asarray(before[self.start :], dtype=np.int64))
            seen = seen[seen < size]
            values = row[seen]
            row[seen] = np.where(values > 0, values / self.repetition, values * self.repetition)
        answer = before[self.start : position]
        if (self.presence or self.frequency) and answer:
            ids, counts = np.unique(np.asarray(answer, dtype=np.int64), return_counts=True)
            keep = ids < size
            row[ids[keep]] -= self.presence + self.frequency * counts[keep].astype(np.float32)
        return torch.from_numpy(row)

    def _prompt(self, before: Sequence[int]) -> np.ndarray:
        """The prompt's distinct tokens (kept: the prompt is the same at every position)."""
        if self.prompt_ids is None:
            self.prompt_ids = np.unique(np.asarray(before[: self.start], dtype=np.int64))
        return self.prompt_ids
