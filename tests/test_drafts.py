"""Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of the sequence's tail."""

from __future__ import annotations

from swarm.coordinator.drafts.lookup import lookup_drafts


def test_the_latest_occurrence_of_the_longest_tail_gives_the_drafts() -> None:
    #          0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 1, 5, 6]
    assert lookup_drafts(tokens, 3) == [7, 1, 5]  # tail [5, 6] last seen at 5: 7, 1, 5 followed
    assert lookup_drafts(tokens + [7], 2) == [1, 5]  # tail [5, 6, 7] at 5 (latest), not at 0
    assert lookup_drafts(tokens, 10) == [7, 1, 5, 6]  # no further than the sequence goes


def test_a_longer_tail_wins_over_a_later_shorter_one() -> None:
    tokens = [1, 2, 3, 4, 9, 3, 4, 8, 2, 3, 4]
    assert lookup_drafts(tokens, 1) == [9]  # [2, 3, 4] at 1, although [3, 4] occurs later at 5


def test_no_occurrence_or_no_room_gives_no_drafts() -> None:
    assert lookup_drafts([1, 2, 3, 4], 3) == []
    assert lookup_drafts([1, 2, 1, 2], 0) == []
    assert lookup_drafts([7], 3) == []
    assert lookup_drafts([], 3) == []
    assert lookup_drafts([3, 3, 3], 2, min_n=1) == [3]  # a single repeated token when allowed


def _naive(t: list[int], k: int, max_n: int = 4, min_n: int = 2) -> list[int]:
    """The definition, scanned token by token."""
    for n in range(min(max_n, len(t) - 1), min_n - 1, -1):
        for i in range(len(t) - n - 1, -1, -1):
            if t[i : i + n] == t[-n:]:
                return t[i + n : i + n + k]
    return []


def test_the_scan_agrees_with_the_definition_on_random_sequences() -> None:
    import random

    rng = random.Random(5)
    for _ in range(300):
        t = [rng.randrange(4) for _ in range(rng.randrange(0, 60))]
        k = rng.randrange(0, 5)
        assert lookup_drafts(t, k) == (_naive(t, k) if k > 0 else []), t
