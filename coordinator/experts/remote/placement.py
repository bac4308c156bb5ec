"""Which live node holds each (layer, expert): the routing table, the replicas' turns, and the backoff of
nodes that failed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from swarm.sharding.ranges import format_ranges
from swarm.sharding.slabs import SlabKey

# A node that failed a call is passed over for a while, then tried again (it may have been restarted, or
# busy rather than gone): 0.5 s after its first failure, doubling with each failure in a row, at most 30 s.
# An answer resets it; a node back from a failure is probed again before its next pair (with an auditor).
DOWN_SECONDS = 0.5
MAX_DOWN_SECONDS = 30.0


class Placement:
    """Which live node holds each (layer, expert); the one place that picks a holder."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._holders: dict[SlabKey, list[str]] = {}
        self._down: dict[str, float] = {}  # address -> until when it is passed over
        self._banned: set[str] = set()  # caught computing wrong: never picked again
        self._failures: dict[str, int] = {}  # address -> failures in a row
        self._turns: dict[int, int] = {}  # layer -> its calls so far: the replicas of its experts take turns
        self._lock = threading.Lock()
        self._clock = clock

    def add(self, address: str, held: Iterable[SlabKey], revive: bool = True) -> None:
        """`address` holds `held` (too); `revive`: it is up now (a node that has just been found)."""
        with self._lock:
            if revive:
                self._down.pop(address, None)
            for key in held:
                holders = self._holders.setdefault(key, [])
                if address not in holders:
                    holders.append(address)
                    holders.sort()

    def drop(self, address: str, keys: Iterable[SlabKey]) -> None:
        """A node no longer holds these slabs (it dropped them: their files failed its own check)."""
        with self._lock:
            for key in keys:
                holders = self._holders.get(key)
                if holders and address in holders:
                    holders.remove(address)

    def remove(self, address: str) -> None:
        """A node that left: it holds nothing any more."""
        with self._lock:
            for holders in self._holders.values():
                if address in holders:
                    holders.remove(address)
            self._down.pop(address, None)

    def next_turn(self, layer: int) -> None:
        """A new call of this layer: its experts' replicas take the next turn."""
        self._turns[layer] = self._turns.get(layer, 0) + 1

    def holders(self) -> dict[SlabKey, list[str]]:
        with self._lock:
            return {k: list(v) for k, v in self._holders.items()}

    def ban(self, address: str) -> None:
        with self._lock:
            self._banned.add(address)

    def is_banned(self, address: str) -> bool:
        return address in self._banned

    def mark_down(self, address: str, seconds: float | None = None) -> None:
        """Pass the node over for a while: exponential backoff over its failures in a row."""
        with self._lock:
            n = self._failures[address] = self._failures.get(address, 0) + 1
            if seconds is None:
                seconds = min(MAX_DOWN_SECONDS, DOWN_SECONDS * 2 ** (n - 1))
            self._down[address] = self._clock() + seconds

    def mark_up(self, address: str) -> None:
        """The node answered: its failures are forgotten."""
        if address in self._failures:
            with self._lock:
                self._failures.pop(address, None)
                self._down.pop(address, None)

    def failures(self, address: str) -> int:
        return self._failures.get(address, 0)

    def _is_down(self, address: str) -> bool:
        until = self._down.get(address)
        return until is not None and self._clock() < until

    def addresses(self) -> list[str]:
        with self._lock:
            every = {a for hs in self._holders.values() for a in hs}
            return sorted(a for a in every if not self._is_down(a) and a not in self._banned)

    def pick(
        self, layer: int, expert: int, avoid: Iterable[str] = (), include_down: bool = False
    ) -> str | None:
        """A live holder of (layer, expert) not in `avoid`, or None. Replicas share the load by a fixed
        rule that rotates with each call of the layer (`next_turn`): over a run every holder of an expert gets an
        equal share of its pairs, the share `swarm plan` counts on, and within one call the choice is fixed."""
        live = self.live(layer, expert, avoid, include_down)
        if not live:
            return None
        return live[(layer * 31 + expert + self._turns.get(layer, 0)) % len(live)]

    def live(
        self, layer: int, expert: int, avoid: Iterable[str] = (), include_down: bool = False
    ) -> list[str]:
        """The holders of (layer, expert) not banned, not in `avoid` and (unless include_down) not down."""
        avoid = set(avoid)
        with self._lock:
            return [
                a
                for a in self._holders.get((layer, expert), ())
                if a not in avoid and a not in self._banned and (include_down or not self._is_down(a))
            ]

    def missing(self, needed: Iterable[SlabKey]) -> dict[int, list[int]]:
        """layer -> experts with no live holder."""
        out: dict[int, list[int]] = {}
        for layer, expert in sorted(needed):
            if self.pick(layer, expert) is None:
                out.setdefault(layer, []).append(expert)
        return out


def describe_missing(missing: dict[int, list[int]], source: str) -> str:
    lines = [f"layer {layer}: experts {format_ranges(es)}" for layer, es in sorted(missing.items())]
    shown = "; ".join(lines[:6]) + (f"; and {len(lines) - 6} more layers" if len(lines) > 6 else "")
    layer, es = next(iter(sorted(missing.items())))
    return (
        f"no node holds {shown}. Start nodes that cover them, e.g. "
        f"`swarm node {source} --layers {layer} --experts {format_ranges(es)}`, or run with --local"
    )
