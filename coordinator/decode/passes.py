"""Forward passes over several sequences: checking windows of drafts, outputs held back until the nodes'
answers behind them are checked, and passes done again when a node is caught.

Dimension letters: T tokens, V vocabulary.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from swarm.coordinator.checks.audit import Verdict
from swarm.coordinator.decode.sampling import Sampler
from swarm.coordinator.experts.turns import Turns


class CausalLM(Protocol):
    """What every architecture in coordinator/models implements (models/base.py DecoderModel.forward): logits
    [N, V] of the rows asked for, and with `hidden` also the rows after output_norm [N, D]; `pictures`: per
    sequence, the picture rows among its tokens (models.base.PictureRows) or None."""

    def new_state(self) -> Any: ...

    def __call__(
        self,
        tokens: torch.Tensor,
        states: Sequence[Any],
        lengths: Sequence[int],
        last_only: bool = False,
        marks: Sequence[int | Sequence[int]] = (),
        tails: Sequence[int] = (),
        hidden: bool = False,
        pictures: Sequence[Any] = (),
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


class Checker(Protocol):
    """What checks the nodes' answers (swarm.coordinator.checks.audit.Auditor): after each forward pass, whether
    everything since the last settled point is checked, still open, or was shaped by a node now banned."""

    def settle(self, force: bool = False) -> Verdict: ...

    def cover(self, on: bool) -> None: ...


# A pass whose answers are not all checked yet is held back; after this many, the checker is made to settle
# (the model waits for the audits still open). Audits aside run at idle priority, in the time the model and
# the nodes leave free: a window of 8 passes lets more of them end there than a window of 4, at the cost of
# tokens streamed 8 at a time.
SETTLE_EVERY = 8


class Anchor(NamedTuple):
    """A sequence at the last settled point, where a redo starts again."""

    state: Any  # the model state's checkpoint
    last: Any  # its latest output then
    head_state: Any  # its MTP head state's checkpoint (None without one)
    proposed: tuple[int, ...]  # the head's drafts then


@dataclass(eq=False)
class Seq:
    """One sequence of a Passes run: its model state and sampler (None: its passes give logits [T, V]),
    its outputs (sampled tokens, or logits) that are settled (`ready`, for the caller to take) or still
    held back (`held`), and `last`, its latest output: the token a decode entry feeds next."""

    state: Any
    sampler: Sampler | None = None
    ready: list[Any] = field(default_factory=list)
    held: list[Any] = field(default_factory=list)
    last: Any = None
    anchor: Anchor | None = None  # the sequence at the settled point: a redo starts there
    head_state: Any = None  # its MTP head's state (coordinator/drafts/mtp.py) when drafts come from the head
    proposed: tuple[int, ...] = ()  # the head's drafts for its next decode step
    drafted: int = 0  # drafts its checking windows carried
    accepted: int = 0  # ... of which the model's own tokens agreed with
    windows: int = 0  # passes that carried drafts for it
    steps: int = 0  # decode passes (windows or one token) it took part in

    def take(self) -> list[Any]:
        out, self.ready = self.ready, []
        return out


@dataclass(frozen=True, eq=False)
class Entry:
    """One sequence's part of a forward pass: `tokens` to feed (None: its last output, a decode step), and
    whether the pass yields an output for it (the token sampled after it, or its logits); a prompt chunk
    that is not the prompt's last yields none."""

    seq: Seq
    tokens: tuple[int, ...] | None = None
    output: bool = True
    mark: int = 0  # > 0: keep a checkpoint after this many of `tokens` (in seq.state.marked)
    # a decode step's guesses at the tokens after its last output (a checking window: see Passes)
    drafts: tuple[int, ...] = ()
    # the rows and M-RoPE positions of `tokens` where some are a picture's (models.base.PictureRows), else None
    pictures: Any = None

    def feed(self) -> list[int]:
        if self.tokens is not None:
            return list(self.tokens)
        return [int(self.seq.last), *self.drafts]


class Passes:
    """Forward passes over several sequences whose outputs count only once the nodes' answers behind them
    are checked.

    A decode entry may carry drafts: guesses at the tokens that follow its last output. Its pass then feeds
    the last output and the drafts (a checking window: one expert fan-out per layer for them all) and
    samples a token after every row, in order; a draft is kept while it equals the token sampled at its
    place, and the first that does not ends the window. The tokens sampled up to there are the outputs
    (the one after the last kept draft included), and the sequence's state goes back to the checkpoint
    the pass kept after the last kept row (DecoderModel's marks). Every row's bits are those of feeding
    the tokens one pass at a time, and a token's random draw depends on its position alone
    (position_uniform), so the outputs are those of decoding without drafts, whatever the drafts were.

    Each pass (one model call for all its entries: one expert fan-out per layer) is remembered back to the
    last settled point, where every sequence's state, sampler and last output are checkpointed. When the
    checker catches a node, the sequences go back to that point and the passes are done again in order (the
    node is banned: other holders or the coordinator answer for it), so nothing a wrong answer shaped
    survives; a decode entry feeds the token its sequence samples in the redo. Without a checker every
    pass settles at once and nothing is held back. A sequence's bits never depend on the other entries of
    its passes (see coordinator/models), so a redo, the same sequence run alone, or a pass's entries split
    into groups each run as its own model call, at once, give the same outputs.
    """

    def __init__(
        self,
        model: CausalLM,
        device: torch.device | str,
        checker: Checker | None = None,
        groups: Grouping | None = None,
        mtp_drafter: Any = None,
    ) -> None:
        self.model, self.device, self.checker = model, torch.device(device), checker
        # how many groups a pass's entries go in, each its own model call on its own thread, in flight at
        # once (while one waits for its layer's answers another's dense work runs); None: one
        self.groups = groups
        self._pool: ThreadPoolExecutor | None = None
        # the MTP drafter (coordinator/drafts/mtp.py): after each pass, the sequences that have a head state
        # catch it up with the rows they kept and get their next drafts in seq.proposed
        self.mtp_drafter = mtp_drafter
        self._count = threading.Lock()  # the counters below, from every group's thread
        self.passes: list[list[Entry]] = []  # since the settled point
        self.open: dict[int, Seq] = {}  # sequences joined or stepped since the settled point, by id
        self.redone = 0  # passes done again after a node was caught
        self.drafted = self.accepted = self.windows = 0  # over every checking window of this run

    def join(self, seq: Seq) -> None:
        """Take a sequence in (its state as it is now is where a redo would bring it back to)."""
        if self.checker is not None:
            seq.anchor = self._checkpoint(seq)
            self.open[id(seq)] = seq

    def holds(self, seq: Seq) -> bool:
        """Whether the sequence's state may still be brought back and redone (do not reuse it yet)."""
        return id(seq) in self.open

    def step(self, entries: Sequence[Entry]) -> None:
        """Run one pass; settled outputs land in each sequence's `ready` (several after a hold)."""
        entries = list(entries)
        self.passes.append(entries)
        for e in entries:
            if self.checker is not None:
                self.open.setdefault(id(e.seq), e.seq)
        self._pass(entries)
        # a prompt's output (its logits, or the first token a user waits for) goes out once every answer
        # of its pass is checked; decode outputs wait for up to SETTLE_EVERY passes of sampled checks
        prompt_out = any(e.tokens is not None and e.output for e in entries)
        self._settle(force=prompt_out or len(self.passes) >= SETTLE_EVERY)

    def finish(self) -> None:
        """Settle whatever is still held (the end of a generation)."""
        if self.passes:
            self._settle(force=True)

    def close(self) -> None:
        """Stop the groups' threads (a Passes that splits passes into groups keeps a pool of them)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    @staticmethod
    def _checkpoint(seq: Seq) -> Anchor:
        head = seq.head_state.checkpoint() if seq.head_state is not None else None
        return Anchor(seq.state.checkpoint(), seq.last, head, seq.proposed)

    def _pass(self, entries: list[Entry]) -> None:
        if self.checker is not None:  # every answer of a pass that reads a prompt is checked (audit.Scope)
            self.checker.cover(any(e.tokens is not None for e in entries))
        parts = split_groups(entries, self.groups.choose(entries) if self.groups is not None else 1)
        if len(parts) == 1:
            self._call(entries)
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=MAX_GROUPS - 1, thread_name_prefix="swarm-group")
            turns = Turns()  # the groups take turns at the dense work, each giving it up while it waits
            later = [self._pool.submit(self._take_turns, turns, p) for p in parts[1:]]
            try:
                self._take_turns(turns, parts[0])
            finally:
                for f in later:
                    f.result()  # (the first error raised goes up; every group has ended before)
        if self.groups is not None:
            self.groups.done()

    def _take_turns(self, turns: Turns, entries: list[Entry]) -> None:
        with turns.turn():
            self._call(entries)

    def _call(self, entries: list[Entry]) -> None:
        """One model call for these entries, then their outputs."""
        feeds = [e.feed() for e in entries]
        every_row = any(e.output and e.seq.sampler is None for e in entries)
        windows = any(e.drafts for e in entries)
        ids = torch.tensor([t for f in feeds for t in f], dtype=torch.long, device=self.device)
        marks: list[tuple[int, ...]] = [
            tuple(range(1, len(f))) if e.drafts else (e.mark,) if e.mark else ()
            for e, f in zip(entries, feeds, strict=True)
        ]
        # rows of logits wanted per entry: a window's every row, a logits entry's every row, else the last
        tails = (
            [
                len(f) if e.drafts or (e.output and e.seq.sampler is None) else 1
                for e, f in zip(entries, feeds, strict=True)
            ]
            if windows
            else []
        )
        hidden = self.mtp_drafter is not None and any(e.seq.head_state is not None for e in entries)
        extra: dict[str, Any] = {"hidden": True} if hidden else {}
        if any(e.pictures is not None for e in entries):
            extra["pictures"] = [e.pictures for e in entries]
        with torch.inference_mode():
            out = self.model(
                ids,
                [e.seq.state for e in entries],
                [len(f) for f in feeds],
                last_only=not every_row,
                marks=marks if any(marks) else (),
                tails=tails,
                **extra,
            )
        logits, h = out if hidden else (out, None)
        start = 0
        kept = []  # rows each entry keeps: a window's up to its last kept draft, else all it fed
        for i, (e, f) in enumerate(zip(entries, feeds, strict=True)):
            n = tails[i] if windows else len(f) if every_row else 1
            rows = logits[start : start + n]  # [n, V]
            start += n
            if e.tokens is None:
                e.seq.steps += 1
            kept.append(self._window(e, rows) + 1 if e.drafts else len(f))
            if e.output and not e.drafts:
                sampler = e.seq.sampler
                token = sampler(rows[-1], e.seq.state.length) if sampler is not None else rows
                e.seq.held.append(token)
                e.seq.last = token
        if h is not None:
            self._draft(entries, feeds, kept, h)

    def _draft(self, entries: list[Entry], feeds: list[list[int]], kept: list[int], h: torch.Tensor) -> None:
        """The MTP head's catch-up with the rows each sequence kept (h [N, D]: every row of the pass) and its
        drafts for the sequences' next decode steps."""
        picked, committed, starts, hs, lasts = [], [], [], [], []
        at = 0
        for e, f, k in zip(entries, feeds, kept, strict=True):
            rows, at = h[at : at + k], at + len(f)
            if e.seq.head_state is None:
                continue
            picked.append(e.seq)
            committed.append(f[:k])
            starts.append(e.seq.state.length - k)
            hs.append(rows)
            lasts.append(int(e.seq.last) if e.output and e.seq.sampler is not None else None)
        for seq, d in zip(
            picked,
            self.mtp_drafter.step([s.head_state for s in picked], committed, starts, hs, lasts),
            strict=True,
        ):
            seq.proposed = tuple(d)

    def _window(self, e: Entry, rows: torch.Tensor) -> int:
        """A checking window's outputs from its rows [1 + drafts, V]; its state back to the last kept row.
        -> the drafts kept."""
        seq, k = e.seq, len(e.drafts)
        assert seq.sampler is not None, "drafts are for sequences that sample"
        state = seq.state
        first = state.length - k  # position of the token sampled after the window's first row
        marked, state.marked = state.marked[-k:], []
        for j in range(k + 1):
            token = seq.sampler(rows[j], first + j)
            seq.held.append(token)
            seq.last = token
            if j == k or token != e.drafts[j]:
                break
        seq.windows += 1
        seq.drafted += k
        seq.accepted += j
        with self._count:
            self.windows += 1
            self.drafted += k
            self.accepted += j
        if j < k:  # rows after the last kept one read tokens that are not the sequence's
            state.restore(marked[j])
        return j

    def _settle(self, force: bool) -> None:
        if self.checker is None:
            for entries in self.passes:
                for e in entries:
                    e.seq.ready.extend(e.seq.held)
                    e.seq.held.clear()
            self.passes = []
            return
        while True:
            verdict = self.checker.settle(force=force)
            if verdict is Verdict.CAUGHT:
                self._redo()
                continue
            if verdict is Verdict.OPEN and not force:
                return
            if verdict is Verdict.OPEN:
                continue  # forced: the checker audits what is open until it settles or catches someone
            for seq in self.open.values():
                seq.ready.extend(seq.held)
                seq.held.clear()
                seq.anchor = self._checkpoint(seq)
            self.passes, self.open = [], {}
            return

    def _redo(self) -> None:
        for seq in self.open.values():
            anchor = seq.anchor
            assert anchor is not None, "a sequence a checker holds has an anchor"
            seq.last, seq.proposed = anchor.last, anchor.proposed
            seq.state.restore(anchor.state)
            if anchor.head_state is not None:
                seq.head_state.restore(anchor.head_state)
            seq.held.clear()
        self.redone += len(self.passes)
        for entries in self.passes:
            self._pass(entries)


class Grouping(Protocol):
    """How many groups a pass's entries go in (serve/groups.py); told when the pass is done."""

    def choose(self, entries: Sequence[Entry]) -> int: ...

    def done(self) -> None: ...


# The most groups a pass is split into (each a thread and a model call of its own).
MAX_GROUPS = 4


def split_groups(entries: list[Entry], n: int) -> list[list[Entry]]:
    """The entries in at most n groups of about the same number of rows, in order (each group a model call)."""
    n = max(1, min(n, MAX_GROUPS, len(entries)))
    if n == 1:
        return [entries]
    rows = [len(e.feed()) for e in entries]
    per = sum(rows) / n
    parts: list[list[Entry]] = [[]]
    filled = 0
    for e, r in zip(entries, rows, strict=True):
        if parts[-1] and filled + r / 2 > per * len(parts) and len(parts) < n:
            parts.append([])
        parts[-1].append(e)
        filled += r
    return parts
