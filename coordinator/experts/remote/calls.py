"""A layer's packed rows cut into Compute calls: the parts of expert blocks each call carries."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swarm.compute.store import ROWS_PER_MATMUL
from swarm.node.client import ComputeCall
from swarm.proto.q8 import Q8Rows


@dataclass(frozen=True)
class Part:
    """Rows [start, start + rows) of one expert's block in the packed rows."""

    index: int  # the expert's position in ExpertMajor.expert_ids
    start: int
    rows: int


@dataclass(frozen=True)
class WireRows:
    """A layer's packed rows as they go out: their values, and (--wire q8) the same rows as 8-bit blocks."""

    values: torch.Tensor  # [N, D] in the wire's float type: what an audit recomputes, and the calls' rows
    blocks: torch.Tensor | None = None  # [N, row bytes] uint8 of `qtype`: what the calls carry instead
    qtype: int = 0

    @property
    def row_bytes(self) -> int:
        if self.blocks is not None:
            return int(self.blocks.shape[1])
        return int(self.values.shape[1]) * self.values.element_size()

    def take(self, begins: Sequence[int], parts: Sequence[Part]) -> tuple[torch.Tensor, Any]:
        """(the values, what the call carries: the values or Q8Rows) of these parts' rows, in order."""
        end = span(begins, parts)

        def cut(t: torch.Tensor) -> torch.Tensor:
            if end is not None:
                return t[begins[0] : end]  # a view: the rows lie back to back already
            return torch.cat([t[b : b + p.rows] for b, p in zip(begins, parts, strict=True)])

        values = cut(self.values)
        if self.blocks is None:
            return values, values
        return values, Q8Rows(self.qtype, cut(self.blocks), int(self.values.shape[1]))


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
