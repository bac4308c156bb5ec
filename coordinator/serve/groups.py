"""How many groups `swarm serve` splits a pass into (passes.Passes runs each group as its own model call, on its own
thread, all in flight at once): over slow links a pass spends most of its time waiting for the nodes' answers
layer after layer, and another group's dense work can run in that wait. Over fast links the wait is short, and
two smaller calls cost more than one (each reads the dense weights), so there it stays one group.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from swarm.coordinator.decode.passes import MAX_GROUPS

# A pass goes in groups when more than this share of a one-group pass is spent waiting for answers.
SPLIT_ABOVE = 0.5
# While passes go in groups, every this many passes one runs as one group, to measure the wait again.
REMEASURE_EVERY = 16
SMOOTHING = 0.3  # weight of the newest one-group pass in the running share


class WaitShare:
    """Groups from the share of a one-group pass spent waiting on the swarm backend (its `wait_seconds`):
    1 at or below SPLIT_ABOVE, else about 1 / (1 - share) (the wait filled with that many groups' dense
    work), at most MAX_GROUPS and one per decode sequence. `fixed` > 0: always that many (--groups N)."""

    def __init__(self, backend: Any, fixed: int = 0) -> None:
        self.backend, self.fixed = backend, fixed
        self.share: float | None = None  # running share of one-group passes spent waiting
        self.passes = 0
        self._start: tuple[float, float, int] | None = None

    def choose(self, entries: Sequence[Any]) -> int:
        decoding = sum(1 for e in entries if e.tokens is None)
        n = self.fixed or self._auto()
        self.passes += 1
        if not self.fixed and n > 1 and self.passes % REMEASURE_EVERY == 0:
            n = 1
        n = max(1, min(n, decoding))
        self._start = (time.perf_counter(), self.backend.wait_seconds, n)
        return n

    def done(self) -> None:
        if self._start is None:
            return
        t0, w0, n = self._start
        self._start = None
        wall = time.perf_counter() - t0
        if n != 1 or wall <= 0:
            return
        share = min(1.0, (self.backend.wait_seconds - w0) / wall)
        self.share = share if self.share is None else (1 - SMOOTHING) * self.share + SMOOTHING * share

    def _auto(self) -> int:
        if self.share is None or self.share <= SPLIT_ABOVE:
            return 1
        return max(2, min(MAX_GROUPS, round(1 / max(1e-3, 1 - self.share))))
