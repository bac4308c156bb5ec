"""--verify pair: every call also answered by a second holder (of the first one's numerics class where there
is one), and the two answers compared part by part. Where they differ, the coordinator recomputes the rows
and bans whichever node is not honest (the settle then redoes the pass without it); where two nodes of one
class differ and both are within the bound this coordinator can check, neither can be shown wrong here."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from swarm.compute.numclass import same_class
from swarm.coordinator.checks.audit import Auditor
from swarm.coordinator.checks.recompute import same_bits

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TwinAnswer:
    """One expert's rows of a call, as its first holder and a second one answered them."""

    expert: int
    rows: torch.Tensor  # [n, D] the rows sent
    first: str  # the address that answered the call
    first_answer: torch.Tensor  # [n, D], in the second answer's dtype
    second: str
    second_answer: torch.Tensor


def compare_twins(auditor: Auditor, layer: int, answers: Iterable[TwinAnswer]) -> None:
    """Each differing pair of answers decided by the auditor, which bans a node whose answer is not honest."""
    for a in answers:
        if same_bits(a.first_answer, a.second_answer):
            continue
        experts = [a.expert] * int(a.rows.shape[0])
        held = [
            auditor.decide(address, layer, experts, a.rows, said)
            for address, said in ((a.first, a.first_answer), (a.second, a.second_answer))
        ]
        if all(held) and same_class(auditor.classes.get(a.first, ""), auditor.classes.get(a.second, "")):
            log.warning(
                "nodes %s and %s, of one numerics class, disagree on layer %d expert %d within the bound this "
                "coordinator (another class) can check: one of them is wrong, and neither can be shown so "
                "here; a third holder of their class would tell", a.first, a.second, layer, a.expert,
            )  # fmt: skip
