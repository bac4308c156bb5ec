"""The decode core: every conversation's decode, whoever drives it.

`swarm serve`'s scheduler drives it with many conversations at once (serve/scheduler.py); `swarm run`,
`swarm logits` and `swarm demo` with one (decode/one.py). The core decides, per conversation, what its next
pass feeds (`plan`: a chunk of its prompt, or its last token and the drafts that fit its budget), runs the
pass over every conversation at once with the answer checks' settle and redo (`step`, passes.Passes), and
hands out what a conversation may show (`collect`: settled tokens, cut at EOS, a stop string or its length
limit). The phases, as the algorithm reads: prefill (a prompt read in chunks), decode_one_token (one row a
pass), speculative_decode (a checking window of drafts); the first two are `plan` with and without a prompt
left, the third a decode entry that carries drafts.

Hooks: a conversation's Sampler takes logits processors (decode/sampling.py: grammars, penalties, a
recorder of the rows), and its drafts come from a DraftSource (prompt lookup, the MTP head, or tokens a
grammar forces), which the core keeps within the conversation's budget.

Dimension letters: V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from swarm.coordinator.decode.passes import CausalLM, Checker, Entry, Grouping, Passes, Seq
from swarm.coordinator.decode.sampling import LogitsProcessor, Sampler, SamplingParams


class DraftSource(Protocol):
    """A conversation's drafts for its next decode pass: (its tokens so far, the last not yet fed; its
    sequence) -> guesses at the tokens that follow, in order (may be none)."""

    def __call__(self, tokens: Sequence[int], seq: Seq) -> Sequence[int]: ...


def lookup_source(drafter: Callable[[Sequence[int]], Sequence[int]]) -> DraftSource:
    """Drafts from the tokens alone (drafts/lookup.py: prompt lookup, a scripted text)."""
    return lambda tokens, seq: drafter(tokens)


def mtp_source(tokens: Sequence[int], seq: Seq) -> Sequence[int]:
    """Drafts the model's MTP head proposed after the sequence's last pass (drafts/mtp.py)."""
    return seq.proposed


class StopText(Protocol):
    """Watches a conversation's text for its stop strings: fed each token given out, in order; True once the
    text so far holds one of them."""

    def push(self, token: int) -> bool: ...


@dataclass
class StopStrings:
    """StopText over a detokenizer stream (text.tokenizer's `stream`: token -> text piece). Only the text's
    tail that a stop string could still end in is kept: a long answer costs each token its piece, not the
    whole text again."""

    detokenizer: Any
    stops: Sequence[str]
    tail: str = ""
    found: str | None = None  # the stop string that ended the text (the earliest, where several did at once)

    def push(self, token: int) -> bool:
        piece = self.detokenizer.push(token)
        longest = max((len(s) for s in self.stops), default=0)
        window = self.tail + piece
        self.tail = window[len(window) - max(longest - 1, 0) :] if longest > 1 else ""
        hits = [(i, s) for s in self.stops if s and (i := window.find(s)) >= 0]
        if hits:
            self.found = min(hits)[1]
        return bool(hits)


@dataclass(eq=False)
class Conversation:
    """One conversation in the core: its prompt (`fed` of it read: a state may hold the beginning already),
    its sampling, its sequence (model state, sampler, outputs held and settled), and what it has given out."""

    prompt: Sequence[int]
    params: SamplingParams
    seq: Seq
    fed: int = 0
    pictures: Any = None  # the prompt's pictures (models.base.PictureRows over the whole prompt), or None
    mark: int | None = None  # a prompt position to keep a state checkpoint at while reading past it
    ctx_size: int | None = None  # the most tokens its state may hold, prompt included (None: no bound)
    stop_text: StopText | None = None
    drafts: DraftSource | None = None
    # tokens known to come next (a grammar's forced ones, decode/grammar.py): drafted first, the drafts after
    forced: DraftSource | None = None
    out: list[int] = field(default_factory=list)  # tokens given out
    past: list[int] = field(default_factory=list)  # tokens sampled after its end (its state has read them)
    finish: str | None = None  # "stop" or "length" once it has ended

    @property
    def limit(self) -> int:
        """The most tokens it may produce: its max_tokens, within its context."""
        room = self.ctx_size - len(self.prompt) if self.ctx_size is not None else self.params.max_tokens
        return min(self.params.max_tokens, room)

    @property
    def reading(self) -> bool:
        return self.fed < len(self.prompt)

    def produced(self) -> int:
        """Tokens sampled so far: given out, settled, or held until the answers behind them are checked."""
        return len(self.out) + len(self.seq.ready) + len(self.seq.held)

    def before(self, position: int) -> list[int]:
        """Its tokens before a position (the prompt from 0, then every token sampled)."""
        return self.tokens()[:position]

    def tokens(self) -> list[int]:
        """Its prompt and every token sampled (the last one not yet fed)."""
        return [*self.prompt, *self.out, *self.past, *self.seq.ready, *self.seq.held]

    def computed(self) -> bool:
        """Whether it needs no more passes: its last token is a stop, or it has produced its limit."""
        stop_ids = self.params.stop_ids
        stopped = self.seq.last in stop_ids or any(t in stop_ids for t in self.seq.held)
        return stopped or self.produced() >= self.limit


class DecodeCore:
    """Conversations decoded together: one pass a step for all of them (one expert fan-out per layer).

    `prompt_chunk`: the most tokens of one prompt a pass reads (None: the whole prompt at once);
    `prompt_budget`: the most prompt tokens a pass reads beside decoding conversations, and with none
    decoding (None: no bound). A conversation's bits do not depend on how its prompt is cut nor on what
    shares its passes (coordinator/models), so every front end gives the same tokens for it."""

    def __init__(
        self,
        model: CausalLM,
        device: torch.device | str,
        checker: Checker | None = None,
        *,
        drafts: DraftSource | None = None,
        mtp_drafter: Any = None,
        groups: Grouping | None = None,
        prompt_chunk: int | None = None,
        prompt_budget: tuple[int | None, int | None] = (None, None),
    ) -> None:
        self.model, self.device, self.checker = model, torch.device(device), checker
        self.drafts = mtp_source if mtp_drafter is not None else drafts
        self.mtp_drafter = (
            mtp_drafter  # an MTPDrafter (drafts/mtp.py): its per-sequence head states live in each Seq
        )
        self.groups = groups
        self.prompt_chunk = prompt_chunk
        self.beside_decode, self.alone = prompt_budget
        self.passes = Passes(model, self.device, checker, groups, mtp_drafter)

    # --- conversations ------------------------------------------------------------------------------------

    def open(
        self,
        prompt: Sequence[int],
        params: SamplingParams | None,
        *,
        state: Any = None,
        head_state: Any = None,
        fed: int = 0,
        processors: Sequence[LogitsProcessor] = (),
        record: Callable[[int, int, torch.Tensor], None] | None = None,
        **conversation: Any,
    ) -> Conversation:
        """A conversation joined to the core. `state`: a model state holding the prompt's first `fed` tokens
        (None: a fresh one); `params` None: its prompt's pass gives logits [T, V], not a token; `record`: told
        every token picked with its row (Sampler); the rest are Conversation's fields (pictures, mark,
        ctx_size, stop_text, drafts, forced)."""
        if not prompt:
            raise ValueError("empty prompt: give at least one token")
        if head_state is None and self.mtp_drafter is not None and params is not None:
            head_state = self.mtp_drafter.new_state()
        seq = Seq(state if state is not None else self.model.new_state(), None, head_state=head_state)
        conv = Conversation(prompt, params or SamplingParams(), seq, fed=fed, **conversation)
        if params is not None:
            seq.sampler = Sampler(params, processors, history=conv.before, record=record)
        self.passes.join(seq)
        return conv

    def holds(self, conv: Conversation) -> bool:
        """Whether its passes may still be redone (its state is not to be reused yet)."""
        return self.passes.holds(conv.seq)

    # --- passes ------------------------------------------------------------------------------------------

    def plan(self, convs: Sequence[Conversation]) -> tuple[list[Entry], list[Conversation]]:
        """The next pass: a decode entry for every conversation that goes on and, beside them, chunks of the
        prompts being read (in the order given, within the pass's prompt budget); (entries, those read)."""
        entries = [Entry(c.seq, drafts=self._drafts(c)) for c in convs if not c.reading and not c.computed()]
        budget = self.beside_decode if entries else self.alone
        reads: list[Conversation] = []
        for c in convs:
            if not c.reading:
                continue
            if budget is not None and budget <= 0:
                break
            end = len(c.prompt)
            for bound in (self.prompt_chunk, budget):
                if bound is not None:
                    end = min(end, c.fed + bound)
            mark = c.mark - c.fed if c.mark is not None and c.fed < c.mark < end else 0
            pictures = c.pictures.slice(c.fed, end) if c.pictures is not None else None
            out = end == len(c.prompt)
            entries.append(
                Entry(c.seq, tuple(c.prompt[c.fed : end]), output=out, mark=mark, pictures=pictures)
            )
            reads.append(c)
            if budget is not None:
                budget -= end - c.fed
            c.fed = end
        return entries, reads

    def step(self, entries: Sequence[Entry]) -> None:
        """Run one pass (no entries: settle what is held, the end of a run)."""
        if entries:
            self.passes.step(entries)
        else:
            self.passes.finish()

    @property
    def pending(self) -> bool:
        """Whether passes are held back until the answers behind them are checked."""
        return bool(self.passes.passes)

    def collect(self, conv: Conversation) -> list[int]:
        """Its settled tokens up to where it ends (EOS, a stop string, its limit), now given out; sets
        `conv.finish` when it has ended."""
        taken = conv.seq.take()
        give: list[int] = []
        for t in taken:
            if conv.finish is not None:
                conv.past.append(t)
                continue
            give.append(t)
            if t in conv.params.stop_ids:
                conv.finish = "stop"
            elif conv.stop_text is not None and conv.stop_text.push(t):
                conv.finish = "stop"
            elif len(conv.out) + len(give) >= conv.limit:
                conv.finish = "length"
        conv.out.extend(give)
        return give

    def _drafts(self, c: Conversation) -> tuple[int, ...]:
        """Its next decode pass's drafts, no more than it may still produce less one: the tokens known to
        come next first, then its draft source's guesses after them (the MTP head's are for the place right
        after its last token: none after forced ones)."""
        source = c.drafts if c.drafts is not None else self.drafts
        room = c.limit - c.produced() - 1
        if room <= 0 or c.seq.sampler is None:
            return ()
        tokens = c.tokens()
        first = tuple(c.forced(tokens, c.seq))[:room] if c.forced is not None else ()
        if source is None or (first and source is mtp_source):
            return first
        return (first + tuple(source([*tokens, *first], c.seq)))[:room]

    def reset(self) -> None:
        """Drop every held pass (a step failed: its conversations have ended)."""
        self.passes.close()
        self.passes = Passes(self.model, self.device, self.checker, self.groups, self.mtp_drafter)

    def close(self) -> None:
        self.passes.close()
