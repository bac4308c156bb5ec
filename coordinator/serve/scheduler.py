"""The batcher behind `swarm serve`: up to N conversations decode together, one model pass per step.

One engine thread owns the model. Each step is one forward pass (one expert fan-out per MoE layer for
everything in it) carrying the next token of every decoding sequence and, beside them, the next chunk of
one prompt being read, so running requests keep streaming while a new prompt is read. A sequence's bits do
not depend on what shares its passes nor on how its prompt is cut into chunks (coordinator/models), so each
request gets exactly the tokens it gets alone, and a redo after a caught node (decode/passes.py) gives the
same outputs. The decode itself (what a pass feeds, drafts, the answer checks, stops and limits) is the decode
core's (decode/core.py); this is its many-conversation driver: admission, slots and their held states.

A slot keeps its state when its request ends. A later request whose prompt begins with what a slot holds
(a chat app sends the whole conversation again) continues from there instead of reading the history again.
The attention layers' KV cache can be cut back to any length, the linear-attention (DeltaNet) states only
restored from a checkpoint, so a slot also keeps checkpoints at the end of its last prompt and a few tokens
before it (where a re-rendered conversation first differs from the tokens generated).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from swarm.coordinator.decode.core import DecodeCore, lookup_source
from swarm.coordinator.decode.passes import Checker, Entry, Grouping
from swarm.coordinator.models.attention import KVCache
from swarm.coordinator.models.mtp import HeadCheckpoint
from swarm.coordinator.serve.slots import Done, QueueFull, Request, Slot
from swarm.sharding.errors import UserError

log = logging.getLogger(__name__)

# Prompt tokens per pass: while others decode, the prompts read beside them delay their next token; with no
# one decoding, more per pass means fewer passes. Several prompts may share a pass (one fan-out per layer).
PASS_PROMPT_TOKENS_BESIDE_DECODE = 128
PASS_PROMPT_TOKENS_ALONE = 512
# An idle engine that a request wakes waits for others that come with it: as long as each comes within
# ADMIT_GAP of the one before, for at most ADMIT_WINDOW in all (seconds). A lone request waits ADMIT_GAP.
# The gap is wider than the spacing of requests that client threads send at once (bench/serve).
ADMIT_GAP = 0.015
ADMIT_WINDOW = 0.05
# One sequence's chunk stays within the DeltaNet's recurrent form (deltanet.RECURRENT_MAX).
CHUNK = 256


class Scheduler:
    def __init__(
        self,
        model: Any,
        device: torch.device,
        checker: Checker | None,
        parallel: int,
        ctx_size: int,
        max_queue: int,
        admit_check: Callable[[], str | None] | None = None,
        drafter: Callable[[Sequence[int]], Sequence[int]] | None = None,
        groups: Grouping | None = None,
        mtp_drafter: Any = None,
    ) -> None:
        self.model, self.device = model, device
        self.ctx_size, self.max_queue = ctx_size, max_queue
        self.admit_check = admit_check  # says why no request can run now (experts without a holder), or None
        # over every finished request: drafts checked, drafts kept, decode passes, tokens those passes made
        self.draft_totals = {"drafted": 0, "accepted": 0, "steps": 0, "tokens": 0}
        self.slots = [Slot(i) for i in range(parallel)]
        self.waiting: deque[Request] = deque()
        # (time, tokens given out) per pass, for the tokens/s metric
        self.recent: deque[tuple[float, int]] = deque(maxlen=4096)
        self._cond = threading.Condition()
        self._stopping = False
        self.mtp_drafter = (
            mtp_drafter  # an MTPDrafter (drafts from the model's MTP head, in place of `drafter`), or None
        )
        # `drafter`: a decode step's drafts (drafts/lookup.py), or None: one token a pass; `groups`: how many
        # groups each pass goes in (serve/groups.py), None: one
        self.core = DecodeCore(
            model,
            device,
            checker,
            drafts=lookup_source(drafter) if drafter is not None else None,
            mtp_drafter=mtp_drafter,
            groups=groups,
            prompt_chunk=CHUNK,
            prompt_budget=(PASS_PROMPT_TOKENS_BESIDE_DECODE, PASS_PROMPT_TOKENS_ALONE),
        )
        self._redone = 0
        self._thread = threading.Thread(target=self._main, name="swarm-serve-engine", daemon=True)
        self._warm: Callable[[], None] | None = None
        self._warmed = threading.Event()
        self._warm_error: BaseException | None = None

    # --- the API side (any thread) ---------------------------------------------------------------------

    def start(self, warm: Callable[[], None] | None = None) -> None:
        """Start the engine thread. `warm` runs there first (what the model keeps per thread, ggml's buffers
        and OpenMP's team, is then the passes' own) and this returns once it has; its error is raised here."""
        self._warm = warm
        self._thread.start()
        self._warmed.wait()
        if self._warm_error is not None:
            self._thread.join()
            raise self._warm_error

    def submit(self, req: Request) -> None:
        if len(req.prompt) >= self.ctx_size:
            raise UserError(
                f"the prompt has {len(req.prompt)} tokens; this server's context is {self.ctx_size} tokens "
                "per conversation (--ctx-size): shorten the prompt"
            )
        with self._cond:
            if self._stopping:
                raise UserError("the server is shutting down")
            free = sum(1 for s in self.slots if s.request is None)
            if len(self.waiting) >= self.max_queue + free:  # --max-queue counts those that must wait
                raise QueueFull()
            self.waiting.append(req)
            self._cond.notify()

    def cancel(self, req: Request) -> None:
        """The client went away (or its stop string came): free its slot at the next step."""
        with self._cond:
            req.cancelled = True
            self._cond.notify()

    def queue_depth(self) -> int:
        return len(self.waiting)

    def active(self) -> int:
        return sum(1 for s in self.slots if s.request is not None)

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # --- the engine thread ------------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            if self._warm is not None:
                self._warm()
        except BaseException as e:  # handed to start()'s caller
            self._warm_error = e
            return
        finally:
            self._warmed.set()
        self._loop()

    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._stopping:
                    break
                self._drop_cancelled()
                self._gather()
                self._admit()
                entries, reads = self._entries()
                if not entries and not self.core.pending:
                    self._cond.wait(0.5)
                    continue
            began = time.monotonic()
            try:
                self.core.step(entries)
            except Exception as e:  # a step that cannot finish fails the requests in it, not the server
                self._fail_all(e)
                continue
            if entries and log.isEnabledFor(logging.DEBUG):
                log.debug("pass of %d decoding and %d prompt tokens of %d prompts: %.0f ms",
                          len(entries) - len(reads), sum(len(e.tokens or ()) for e in entries), len(reads),
                          1000 * (time.monotonic() - began))  # fmt: skip
            with self._cond:
                self._after_pass(reads)
        self._end_all()
        self.core.close()

    def _gather(self) -> None:
        """An idle engine that a request wakes waits a moment for the ones that came with it (a chat app
        opening, an agent fanning out), so that their prompts are read in one pass: each pass reads every
        weight it uses once, whatever its tokens."""
        if not self.waiting or any(s.request is not None for s in self.slots):
            return
        free = len(self._free_slots())
        first = self.waiting[0].submitted
        while not self._stopping and len(self.waiting) < free:
            deadline = min(first + ADMIT_WINDOW, self.waiting[-1].submitted + ADMIT_GAP)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._cond.wait(left)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("gathered %d requests that came within %.1f ms", len(self.waiting),
                      1000 * (self.waiting[-1].submitted - first))  # fmt: skip

    def _drop_cancelled(self) -> None:
        self.waiting = deque(r for r in self.waiting if not self._gone(r))
        for s in self.slots:
            if s.request is not None and s.request.cancelled:
                self._release(s, Done("cancelled"))

    def _gone(self, r: Request) -> bool:
        if r.cancelled:
            r.on_done(Done("cancelled"))
        return r.cancelled

    def _admit(self) -> None:
        while self.waiting:
            free = self._free_slots()
            if not free:
                return
            if self.admit_check is not None:
                why = self.admit_check()
                if why is not None:
                    for r in self.waiting:
                        r.on_done(Done("error", why, 503))
                    self.waiting.clear()
                    return
            req = self.waiting.popleft()
            slot, pos = self._best_slot(free, req.match())
            self._prepare(slot, pos)
            slot.request, slot.used = req, time.monotonic()
            slot.conv = self.core.open(
                req.prompt,
                req.params,
                state=slot.state,
                head_state=slot.head_state,
                fed=pos,
                pictures=req.pictures,
                mark=req.checkpoint_at(),
                ctx_size=self.ctx_size,
                stop_text=req.stop_text,
                processors=req.processors,
                forced=req.forced,
                record=req.record,
            )
            req.cached, req.admitted = pos, time.monotonic()

    def _free_slots(self) -> list[Slot]:
        """Slots a new request can take: none running, and no pass of theirs that may still be redone."""
        return [s for s in self.slots if s.request is None and not self._busy(s)]

    def _busy(self, s: Slot) -> bool:
        """A slot whose last request's passes may still be redone (a checker holds them)."""
        return s.conv is not None and self.core.holds(s.conv)

    def _best_slot(self, free: list[Slot], prompt: list[int]) -> tuple[Slot, int]:
        """The free slot holding the longest usable beginning of `prompt` (at least one token is left to
        read, for the logits), and that length; the least recently used slot when none holds any."""
        best: tuple[int, float, Slot] | None = None
        for s in free:
            if s.state is None:
                continue
            for p in sorted({*s.checkpoints, len(s.history)}, reverse=True):
                if 0 < p < len(prompt) and s.history[:p] == prompt[:p]:
                    if best is None or (p, -s.used) > best[:2]:
                        best = (p, -s.used, s)
                    break
        if best is not None:
            return best[2], best[0]
        return min(free, key=lambda s: (s.state is not None, s.used)), 0

    def _prepare(self, slot: Slot, pos: int) -> None:
        """Bring the slot's state to the first `pos` tokens of its history (0: a fresh state)."""
        if pos == 0:
            slot.state = self.model.new_state()
            for layer in slot.state.layers:
                if isinstance(layer, KVCache):
                    layer.capacity = self.ctx_size
            slot.checkpoints, slot.history = {}, []
            slot.head_state = self.mtp_drafter.new_state() if self.mtp_drafter is not None else None
            return
        if pos != len(slot.history):
            slot.state.restore(slot.checkpoints[pos])
        if slot.head_state is not None and slot.head_state.length != pos:
            # the head's cache holds a row for every position the slot read; the trunk's hidden row before
            # `pos` is not kept, and the next row pairs with zeros instead (drafts only: never the text)
            slot.head_state.restore(HeadCheckpoint(pos, torch.zeros_like(slot.head_state.pending_h)))
        slot.checkpoints = {p: c for p, c in slot.checkpoints.items() if p <= pos}
        slot.history = slot.history[:pos]

    def _entries(self) -> tuple[list[Entry], list[Slot]]:
        """This step's pass (decode/core.py `plan`): a decode entry for every conversation that goes on and,
        beside them, chunks of the prompts being read, oldest first; (entries, the slots read)."""
        running = [s for s in self.slots if s.request is not None and s.conv is not None]
        running.sort(key=lambda s: s.request.admitted or 0.0)  # type: ignore[union-attr]
        entries, reads = self.core.plan([s.conv for s in running])  # type: ignore[misc]
        read = {id(c) for c in reads}
        return entries, [s for s in running if id(s.conv) in read]

    def _after_pass(self, reads: list[Slot]) -> None:
        now = time.monotonic()
        if self.core.passes.redone != self._redone:
            # passes were done again after a node was caught: checkpoints taken meanwhile may hold its answers
            self._redone = self.core.passes.redone
            for s in self.slots:
                if s.request is not None:
                    s.checkpoints = {}
        for s in reads:
            r, conv = s.request, s.conv
            if r is None or s.state is None or conv is None:
                continue
            for cp in s.state.marked:  # the pass went past the checkpoint's place and kept it there
                s.checkpoints[cp.length] = cp
            s.state.marked.clear()
            if conv.fed in (len(r.prompt), r.checkpoint_at()):
                s.checkpoints[conv.fed] = s.state.checkpoint()
        out_now = 0
        for s in self.slots:
            r, conv = s.request, s.conv
            if r is None or conv is None:
                continue
            give = self.core.collect(conv)
            if not give:
                continue
            if r.first_token is None:
                r.first_token = now
                r.prompt_seconds = now - (r.admitted or now)
            out_now += len(give)
            r.produced += len(give)
            r.on_tokens(give)
            if conv.finish is not None:
                self._release(s, Done(conv.finish))
        self.recent.append((now, out_now))

    def _release(self, s: Slot, done: Done) -> None:
        """End the slot's request; keep its state for a later conversation that begins the same way."""
        r, conv = s.request, s.conv
        assert r is not None
        s.request = None
        if conv is not None:
            t, seq = self.draft_totals, conv.seq
            t["drafted"] += seq.drafted
            t["accepted"] += seq.accepted
            t["steps"] += seq.steps
            t["tokens"] += max(
                len(conv.out) + len(conv.past) - 1, 0
            )  # the first comes out of the prompt's pass
        if conv is not None and self.core.holds(conv):
            # its passes may still be redone: the state cannot be trusted for reuse
            s.state, s.history, s.checkpoints = None, [], {}
        elif s.state is not None and conv is not None:
            fed = s.state.length
            s.history = (r.match() + conv.out + conv.past + list(conv.seq.held))[:fed]
            s.checkpoints = {p: c for p, c in s.checkpoints.items() if p <= fed}
        s.used = time.monotonic()
        r.on_done(done)

    def _fail_all(self, e: Exception) -> None:
        user = isinstance(e, UserError)
        if not user:
            log.exception("a model step failed")
        msg = str(e) if user else f"the model step failed: {e}"
        with self._cond:
            for s in self.slots:
                if s.request is not None:
                    r = s.request
                    s.request, s.state, s.conv, s.history, s.checkpoints = None, None, None, [], {}
                    r.on_done(Done("error", msg, 503 if user else 500))
            self.core.reset()
            self._redone = 0

    def _end_all(self) -> None:
        with self._cond:
            for r in self.waiting:
                r.on_done(Done("error", "the server is shutting down", 503))
            self.waiting.clear()
            for s in self.slots:
                if s.request is not None:
                    r, s.request = s.request, None
                    r.on_done(Done("cancelled"))
