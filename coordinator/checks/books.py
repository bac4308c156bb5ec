"""The records the answer checks keep (swarm.coordinator.checks.audit): which rows an audit takes, what a settle
says, a checked call, an audit handed to the audit thread, each node's book, and the run's report."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum

import torch


class Scope(Enum):
    """Which rows of a call an audit recomputes."""

    SAMPLE = "sample"  # one row of each of up to AUDIT_EXPERTS experts, drawn at random
    READY = "ready"  # a forced settle's: one row of each ready expert (up to AUDIT_EXPERTS), or of one
    EVERY_EXPERT = "every-expert"  # one row of every expert of the call (a prompt pass's calls)
    EVERY_ROW = "every-row"  # the whole call (--verify all)


class Verdict(Enum):
    SETTLED = "settled"
    OPEN = "open"
    CAUGHT = "caught"


@dataclass
class Call:
    layer: int
    expert_ids: list[int]
    counts: list[int]
    rows: torch.Tensor
    answer: torch.Tensor
    audited: bool = False  # checked once already (the audit thread and a settle may both check it)


@dataclass
class Job:
    """An audit handed to the audit thread."""

    future: Future[None]
    address: str
    call: Call
    scope: Scope


@dataclass
class NodeBook:
    last_call: Call | None = None
    open_calls: int = 0  # calls answered since this node's last passed audit
    calls: int = 0  # calls answered in all


@dataclass
class AuditReport:
    audits: int = 0
    probes: int = 0
    projected: int = 0  # answers checked by projections (every one, with --verify project)
    spared: int = 0  # ... of them in time the model waited for a node (audit.Auditor.spare)
    alarms: int = 0  # ... that failed, and were then recomputed exactly
    false_alarms: int = 0  # ... whose exact recompute found them honest
    banned: dict[str, str] = field(default_factory=dict)  # address -> why
    passed: Counter[str] = field(default_factory=Counter)  # address -> audits of its answers that passed
    # address -> the node's answered calls when it was banned (its answer that was caught is among them)
    calls_at_ban: dict[str, int] = field(default_factory=dict)
