"""A layer's packed rows cut into Compute calls: the parts of expert blocks each call carries."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swarm.compute.store import ROWS_PER_MATMUL
from swarm.node.client import ComputeCall

# The most row bytes one Compute call carries: a long prefill goes to a node as several calls. Well under the
# wire's MAX_MESSAGE_BYTES (whatever D and the wire precision), and the node starts computing the first
# call while the next ones are still on their way.
CALL_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class Part:
    """Rows [start, start + rows) of one expert's block in the packed rows."""

    index: int  # the expert's position in ExpertMajor.expert_ids
    start: int
    rows: int


@dataclass
class SentCall:
    """One Compute call in flight to `address`, and what its answer is checked against."""

    address: str
    parts: list[Part]  # in the order of the call's rows
    call: ComputeCall
    width: int  # D: the width of the rows sent, and of the answer expected
    sent: torch.Tensor  # the rows sent, for an audit of the answer


def split_parts(parts: Sequence[Part], max_rows: int, unit: int = ROWS_PER_MATMUL) -> list[list[Part]]:
    """Parts as calls of at most max_rows rows, in order. An expert's block is never cut when it fits in
    one call; a bigger one is cut at multiples of `unit` from its start (so that a node multiplies the same
    row blocks as the in-process store) and may then exceed max_rows by up to one unit."""
    step = max(unit, max_rows // unit * unit)
    calls: list[list[Part]] = []
    room = 0
    for p in parts:
        if p.rows > room and p.rows <= max_rows:
            calls.append([])
            room = max_rows
        if p.rows <= room:
            calls[-1].append(p)
            room -= p.rows
            continue
        for at in range(0, p.rows, step):
            n = min(step, p.rows - at)
            calls.append([Part(p.index, p.start + at, n)])
            room = max(0, max_rows - n)
    return calls


def span(begins: Sequence[int], parts: Sequence[Part]) -> int | None:
    """Where the parts' rows end when they lie back to back from begins[0] (a node holding a range of
    experts gets its experts' blocks so, in the packed order), else None."""
    end = begins[0]
    for b, p in zip(begins, parts, strict=True):
        if b != end:
            return None
        end = b + p.rows
    return end
