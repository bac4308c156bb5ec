"""Turns at the coordinator's compute for the groups of a pass in flight at once (passes.Passes, `swarm serve
--groups`): a group computes from the moment it holds the turn until it waits on the nodes, and gives the turn
up for that wait (remote.pending.TimedPending).

Without turns, two groups' graphs take the process's one compute lock by turns graph by graph, so both reach
a layer's fan-out together and then both wait together: their dense work never fills the other's wait. With
them, one group runs its layer's dense work whole while the other waits on its nodes, and they fall into step
half a layer apart.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_held = threading.local()  # the Turns this thread holds the turn of, if any


class Turns:
    """One turn, held by one group's thread at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the turn for this block (a group's model call), less the waits `away` gives it up for."""
        with self._lock:
            _held.turns = self
            try:
                yield
            finally:
                _held.turns = None


@contextmanager
def away() -> Iterator[None]:
    """Give up this thread's turn, if it holds one, for this block (a wait on the nodes), and take it back."""
    turns: Turns | None = getattr(_held, "turns", None)
    if turns is None:
        yield
        return
    _held.turns = None
    turns._lock.release()
    try:
        yield
    finally:
        turns._lock.acquire()
        _held.turns = turns
