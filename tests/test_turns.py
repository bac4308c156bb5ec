"""Turns at the coordinator's compute (coordinator/experts/turns.py): groups of a pass in flight at once compute one at
a time, each giving up its turn while it waits on the nodes, so that one group's dense work fills another's
wait instead of both waiting at once."""

from __future__ import annotations

import threading
import time

from swarm.coordinator.experts.turns import Turns, away


def _group(turns: Turns, name: str, log: list[tuple[str, str, float]], layers: int, compute: float,
           wait: float) -> None:  # fmt: skip
    with turns.turn():
        for _ in range(layers):
            log.append((name, "compute", time.monotonic()))
            time.sleep(compute)  # (dense work; a sleep keeps the test about ordering, not CPU speed)
            log.append((name, "wait", time.monotonic()))
            with away():
                time.sleep(wait)
        log.append((name, "end", time.monotonic()))


def test_groups_compute_one_at_a_time_and_fill_each_others_waits():
    turns, log = Turns(), []
    threads = [
        threading.Thread(target=_group, args=(turns, name, log, 4, 0.02, 0.05)) for name in ("a", "b")
    ]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    took = time.monotonic() - t0
    # never two computing at once: between one group's "compute" and its "wait", no other group's entry
    computing = None
    for name, what, _ in log:
        if what == "compute":
            assert computing is None, log
            computing = name
        elif name == computing:
            computing = None
    # each group alone takes 4 x (20 + 50) ms: one after the other 560 ms; each filling the other's waits
    # about 4 x 70 + 20
    assert took < 0.5, took


def test_away_outside_a_turn_does_nothing_and_a_turn_is_given_back_on_errors():
    with away():
        pass
    turns = Turns()
    try:
        with turns.turn():
            with away():
                raise ValueError("a node failed")
    except ValueError:
        pass
    got = []
    t = threading.Thread(target=lambda: got.append(turns._lock.acquire(timeout=2)))
    t.start()
    t.join(5)
    assert got == [True]
