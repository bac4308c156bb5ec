"""The model API every architecture implements, and the plumbing of several sequences in one call.

`model.new_state()` -> one SequenceState per sequence; `model(tokens [N], states, lengths)` -> logits
[N, V] for the new tokens of several sequences concatenated (attention runs per sequence, every MoE layer
sees all N tokens: one expert fan-out per layer for the whole batch); `model.run(tokens, state)` for one
sequence.

Dimension letters: N tokens of all sequences in a call, T tokens of one sequence, D model width, V
vocabulary. Modules are named after GGUF tensors, so a GGUF's tensors load by name. The one convention: a
module whose class sets GGUF_TRANSPARENT (the block's `moe`, an arch's attention) is a path segment the
loader drops (blk.N.moe.ffn_gate_inp.weight is the GGUF's blk.N.ffn_gate_inp.weight). Only nn.Modules and
pure functions: no file I/O, no network.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
from torch import nn

from swarm.coordinator.experts.backend import ExpertBackend
from swarm.coordinator.models.linear import Linear, RMSNorm, project
from swarm.coordinator.models.moe import MoE


class Checkpoint(NamedTuple):
    """What `SequenceState.restore` needs to bring a sequence back to one point (the work after it is done
    again)."""

    length: int  # tokens consumed up to this point
    layers: list[Any]  # every block's own checkpoint, in block order
    position: int  # the RoPE position of the next token (SequenceState.position)


@dataclass
class SequenceState:
    """Everything a model keeps for one sequence between calls: one entry per block.

    An attention block keeps a KVCache; a linear-attention block its conv and recurrent states.
    """

    layers: list[Any]
    length: int = 0  # tokens consumed so far
    # the checkpoint at each mark of the last call that had some for this sequence (DecoderModel's `marks`),
    # in order
    marked: list[Checkpoint] = dataclasses.field(default_factory=list)
    # the RoPE position of the next token: `length` until the sequence holds a picture, whose rows advance it
    # by max(rows, columns) of its grid rather than by their number (M-RoPE, see PictureRows)
    position: int = 0

    def checkpoint(self) -> Checkpoint:
        return Checkpoint(self.length, [s.checkpoint() for s in self.layers], self.position)

    def restore(self, cp: Checkpoint) -> None:
        self.length, self.position = cp.length, cp.position
        for s, c in zip(self.layers, cp.layers, strict=True):
            s.restore(c)


@dataclass(frozen=True)
class PictureRows:
    """A sequence's new tokens of one call where some come as rows rather than from token_embd (a picture's
    rows, in place of its <|image_pad|> tokens), with the M-RoPE positions (t, h, w) of every new token
    relative to the sequence's next position (SequenceState.position). A text token has (p, p, p); a picture's
    row at (row, column) of its grid has (p0, p0 + row, p0 + column) (coordinator.vision.positions). The
    sequence's next position then moves past the largest of them."""

    at: torch.Tensor  # [k] long: which of the new tokens are given as rows (increasing)
    rows: torch.Tensor  # [k, D] float32
    positions: torch.Tensor  # [3, T] long, relative to the next position before these tokens

    @property
    def advance(self) -> int:
        """How far these tokens move the sequence's next position."""
        return int(self.positions.max()) + 1

    def slice(self, a: int, b: int) -> PictureRows | None:
        """The part of these tokens from a to b (one prompt chunk), relative to the position the tokens
        before a leave; None where it is plain text at consecutive positions."""
        pos = self.positions[:, a:b]
        pos = pos - (int(self.positions[:, :a].max()) + 1 if a else 0)
        sel = (self.at >= a) & (self.at < b)
        if not bool(sel.any()) and torch.equal(pos, torch.arange(b - a).expand(3, -1)):
            return None
        return PictureRows(self.at[sel] - a, self.rows[sel], pos)


@dataclass(frozen=True)
class Batch:
    """The layout of one call: the new tokens of several sequences, concatenated in order."""

    lengths: tuple[int, ...]  # new tokens of each sequence
    starts: tuple[int, ...]  # tokens each sequence already held = position of its first new token
    positions: torch.Tensor  # [N] absolute position of every token
    # per sequence, how many of its new tokens come before each point a checkpoint is wanted at (increasing;
    # a prompt's reader keeps one before the prompt's end, a checking window one after every row but the
    # last): its recurrent layers keep their state there. () when no sequence has any.
    marks: tuple[tuple[int, ...], ...] = ()
    # pictures (PictureRows): which rows of the call have h or w positions unlike their t ([k] long), and
    # their absolute (t, h, w) [3, k]; `positions` holds their t. None: every row's three positions are equal.
    multi: torch.Tensor | None = None
    multi_positions: torch.Tensor | None = None

    @classmethod
    def of(
        cls,
        states: Sequence[SequenceState],
        lengths: Sequence[int],
        device: torch.device,
        marks: Sequence[Sequence[int]] = (),
        pictures: Sequence[PictureRows | None] = (),
    ) -> Batch:
        starts = tuple(s.length for s in states)
        # one tensor from a Python list: a decode step's few positions cost one op, not an arange per sequence
        at: list[int] = []
        multi: list[int] = []
        multi_pos: list[torch.Tensor] = []
        for i, (s, n) in enumerate(zip(states, lengths, strict=True)):
            r = pictures[i] if pictures else None
            if r is None:
                at.extend(range(s.position, s.position + int(n)))
                continue
            pos = r.positions.to("cpu", torch.long) + s.position  # [3, n]
            at.extend(pos[0].tolist())
            odd = ((pos[1] != pos[0]) | (pos[2] != pos[0])).nonzero().flatten()
            multi.extend((odd + len(at) - int(n)).tolist())
            multi_pos.append(pos[:, odd])
        positions = torch.tensor(at, dtype=torch.long, device=device)
        return cls(
            lengths=tuple(int(n) for n in lengths),
            starts=starts,
            positions=positions,
            marks=tuple(tuple(int(m) for m in ms) for ms in marks) if any(marks) else (),
            multi=torch.tensor(multi, dtype=torch.long) if multi else None,
            multi_positions=torch.cat(multi_pos, dim=1) if multi else None,
        )

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [N, ...] -> one tensor [lengths[i], ...] per sequence (views)."""
        if len(self.lengths) == 1:
            return (x,)
        return torch.split(x, list(self.lengths), dim=0)


def check_pictures(pictures: Sequence[PictureRows | None], lengths: Sequence[int]) -> None:
    if not pictures:
        return
    if len(pictures) != len(lengths):
        raise ValueError(f"pictures given for {len(pictures)} sequences but {len(lengths)} are read")
    for r, n in zip(pictures, lengths, strict=True):
        if r is not None and (r.positions.shape != (3, n) or (r.at.numel() and int(r.at.max()) >= n)):
            raise ValueError(f"rows with positions {list(r.positions.shape)} for {n} new tokens")


def given_rows(
    x: torch.Tensor, pictures: Sequence[PictureRows | None], lengths: Sequence[int]
) -> torch.Tensor:
    """x [N, D] with the pictures' rows in place of the looked-up ones."""
    at, rows = [], []
    off = 0
    for r, n in zip(pictures, lengths, strict=True):
        if r is not None and r.at.numel():
            at.append(r.at.to(x.device) + off)
            rows.append(r.rows.to(x.device, x.dtype))
        off += n
    if not at:
        return x
    x = x.clone()
    x[torch.cat(at)] = torch.cat(rows)
    return x


class Block(Protocol):
    def __call__(self, x: torch.Tensor, batch: Batch, states: list[Any]) -> torch.Tensor:
        """x [N, D] -> [N, D]; states[i] is this block's state for sequence i (updated in place)."""
        ...

    def new_state(self) -> Any: ...


class PackedEmbedding(nn.Module):
    """token_embd kept as the file encodes it (quantized, f16, bf16) and decoded per lookup, row by row.

    A real vocabulary makes the table big (248k x 2048 is 2 GB as float32, 0.4 GB as Q6_K) while a step
    reads a handful of rows, and decoding just those rows gives the same float32 values as decoding the
    whole table. `rows` [V, bytes or values per row] may be a view of the file's memory map (only the rows
    looked up are read); `decode(rows, (n, D))` -> float32 [n, D] on the CPU.
    """

    def __init__(
        self,
        rows: np.ndarray,
        n_embd: int,
        decode: Callable[[np.ndarray, tuple[int, int]], torch.Tensor],
        device: torch.device,
    ) -> None:
        super().__init__()
        self.rows = rows
        self.num_embeddings, self.embedding_dim = int(rows.shape[0]), n_embd
        self.decode = decode
        self.device = device

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        picked = self.rows[ids.cpu().numpy()]  # [N, row]: copies of just these rows
        return self.decode(picked, (picked.shape[0], self.embedding_dim)).to(self.device)  # [N, D]


class DecoderModel(nn.Module):
    """token_embd -> blocks -> output_norm -> output. Subclasses fill `blk` with their blocks.

    Every block's forward(x [N, D], batch, states) runs attention (or the recurrence) per sequence
    and its MoE over all N tokens at once: one expert fan-out per layer for the whole batch.
    """

    token_embd: nn.Embedding | PackedEmbedding  # the loader's PackedEmbedding over the file's table

    def __init__(self, n_vocab: int, n_embd: int, eps: float) -> None:
        super().__init__()
        # A placeholder without memory (meta device): the loader puts the file's own table here.
        self.token_embd = nn.Embedding(n_vocab, n_embd, device="meta")
        self.token_embd.weight.requires_grad_(False)
        self.blk = nn.ModuleList()
        self.output_norm = RMSNorm(n_embd, eps)
        self.output = Linear(n_embd, n_vocab)

    def new_state(self) -> SequenceState:
        return SequenceState(layers=[blk.new_state() for blk in self.blk])

    def set_experts(self, experts: ExpertBackend) -> None:
        """Swap the expert backend of every MoE layer (in-process <-> swarm) without reloading."""
        for module in self.modules():
            if isinstance(module, MoE):
                module.experts = experts

    def forward(
        self,
        tokens: torch.Tensor,
        states: Sequence[SequenceState],
        lengths: Sequence[int],
        last_only: bool = False,
        marks: Sequence[int | Sequence[int]] = (),
        tails: Sequence[int] = (),
        hidden: bool = False,
        pictures: Sequence[PictureRows | None] = (),
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """tokens [N] (lengths[i] new tokens of sequence i, in order) -> logits [N, V] float32; with
        `hidden`, (logits, h [N, D]): h every row of the call after output_norm, whichever rows the logits
        are of (what an MTP head reads).

        With last_only, only each sequence's last position: [len(states), V] (saves the vocab
        projection of a long prefill); with `tails`, each sequence's last tails[i] positions, in order
        ([sum(tails), V]; a checking window's rows). States are advanced in place. `marks[i]` (a count m
        or several, increasing, each 0 < m < lengths[i]; 0 or (): none): sequence i is also checkpointed
        after its first m new tokens, into states[i].marked (as calling with those m tokens,
        checkpointing, and calling with the rest would, in one pass). `pictures[i]` (or none): sequence i's
        new tokens that come as rows (a picture's) and their M-RoPE positions.
        """
        if not states or len(states) != len(lengths):
            raise ValueError(f"{len(states)} states but {len(lengths)} lengths; give at least one sequence")
        if sum(lengths) != tokens.shape[0] or any(n <= 0 for n in lengths):
            raise ValueError(f"lengths {list(lengths)} do not split {tokens.shape[0]} tokens")
        cuts = [(m,) if isinstance(m, int) and m else () if isinstance(m, int) else tuple(m) for m in marks]
        if cuts and (
            len(cuts) != len(lengths)
            or any(
                list(ms) != sorted(set(ms)) or any(not 0 < m < n for m in ms)
                for ms, n in zip(cuts, lengths, strict=True)
            )
        ):
            raise ValueError(f"marks {list(marks)} do not fall within lengths {list(lengths)}")
        if tails and (
            len(tails) != len(lengths) or any(not 0 < k <= n for k, n in zip(tails, lengths, strict=True))
        ):
            raise ValueError(f"tails {list(tails)} do not fall within lengths {list(lengths)}")
        check_pictures(pictures, lengths)
        device = self.output_norm.weight.device
        # inference_mode throughout, so caches made in one call stay writable in the next.
        with torch.inference_mode():
            batch = Batch.of(states, lengths, device, cuts, pictures)
            x = self.token_embd(tokens.to(device))  # [N, D]
            if pictures:
                x = given_rows(x, pictures, batch.lengths)
            for i, blk in enumerate(self.blk):
                x = blk(x, batch, [s.layers[i] for s in states])
            h = self.output_norm(x).float() if hidden else None  # [N, D]
            for i, (s, n) in enumerate(zip(states, batch.lengths, strict=True)):
                r = pictures[i] if pictures else None
                for m in batch.marks[i] if batch.marks else ():
                    at = s.length + m
                    p = s.position + (int(r.positions[:, :m].max()) + 1 if r is not None else m)
                    s.marked.append(Checkpoint(at, [layer.take_marked(at) for layer in s.layers], p))
                s.length += n
                s.position += r.advance if r is not None else n
            if tails:
                if list(tails) != list(batch.lengths):
                    ends = list(itertools.accumulate(batch.lengths))
                    rows = [r for e, k in zip(ends, tails, strict=True) for r in range(e - k, e)]
                    x = x[torch.tensor(rows, device=device)]  # [sum(tails), D]
            elif last_only and x.shape[0] != len(states):  # (a decode step's rows are the last ones already)
                ends = torch.tensor(batch.lengths, device=device).cumsum(0) - 1
                x = x.index_select(0, ends)  # [B, D]
        # The head runs outside inference_mode so that callers get an ordinary tensor they may modify.
        with torch.no_grad():
            logits = project(x, self.output, norm=self.output_norm)[0].float()  # [N, V]
        return (logits, h.clone()) if h is not None else logits

    def warm_up(self) -> None:
        """One token through every expert of every layer (llama.cpp warms up the same way), so that the
        weights are paged in, and every node has answered once, before the first real request."""
        moes = [m for m in self.modules() if isinstance(m, MoE)]
        kept = [m.cfg for m in moes]
        for m in moes:
            m.cfg = dataclasses.replace(m.cfg, n_expert_used=m.cfg.n_expert)
        try:
            self(torch.zeros(1, dtype=torch.long), [self.new_state()], [1])
        finally:
            for m, cfg in zip(moes, kept, strict=True):
                m.cfg = cfg

    def run(self, tokens: Sequence[int] | torch.Tensor, state: SequenceState) -> torch.Tensor:
        """One sequence: feed its next tokens, get logits [T, V]."""
        ids = torch.as_tensor(tokens, dtype=torch.long)
        return self(ids, [state], [ids.shape[0]])
