"""Drafts from the model's own MTP head (models.mtp), as llama.cpp's draft-mtp speculative decoding makes them.

Per sequence the head keeps a KV cache of its own holding, at every committed position p, the row
(token x_p, the trunk's hidden row h_{p-1}); `pending_h` is h of the last committed position (zeros before
the first). After each trunk pass the committed tokens are caught up into that cache, and the drafts for the
next window are chained from the seed row (the token just sampled, pending_h): draft 1 is the highest logit
of that row, draft j+1 that of the row (draft j, the head's own h_mtp of step j) one position further. A
draft whose probability, renormalised over the 10 highest logits, is below p_min ends the chain. The chain's
rows leave the cache again, so it only ever holds committed rows.

One pass of the head per chain step for every sequence at once: the catch-up rows and the seed rows in the
first (one expert fan-out, and only the seed rows reach the experts), one row per sequence still drafting
in each further pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from swarm.coordinator.models.base import Batch
from swarm.coordinator.models.mtp import MTPHead, MTPState

TOP_K = 10  # llama.cpp's draft sampler: top-k 10, the top token drafted


class MTPDrafter:
    """Up to k drafts per sequence from the MTP head (see the module docstring); `confidence` holds, after
    each step, every sequence's top-10 probability of each draft (what p_min is compared with)."""

    def __init__(self, head: MTPHead, k: int = 3, p_min: float = 0.0) -> None:
        self.head = head
        self.k = k
        self.p_min = p_min
        self.confidence: list[tuple[float, ...]] = []

    def new_state(self) -> MTPState:
        return self.head.new_state()

    def step(
        self,
        states: list[MTPState],
        committed: list[list[int]],
        starts: list[int],
        hs: list[torch.Tensor],
        lasts: list[int | None],
        k: int | None = None,
    ) -> list[tuple[int, ...]]:
        """For each sequence i: committed[i] = the tokens the trunk just consumed for good, at positions
        starts[i]..; hs[i] = the trunk's h rows of those tokens [len(committed[i]), D]. Catch the MTP's KV up
        with rows (committed token at p, h of p-1: the state's pending_h for the first, zeros at the very
        start), set pending_h = hs[i][-1]; then, if lasts[i] is not None, draft up to k tokens from the seed
        row (lasts[i] at position starts[i] + len(committed[i]), pending_h) chaining on the MTP's own h, and
        remove the draft rows from the MTP KV again. Returns the drafts per sequence (() where lasts is None)."""
        n = len(states)
        if not len(committed) == len(starts) == len(hs) == len(lasts) == n:
            raise ValueError("states, committed, starts, hs and lasts must have one entry per sequence")
        k = self.k if k is None else k
        seeds = list(lasts) if k > 0 else [None] * n
        for i, (s, c, start, h) in enumerate(zip(states, committed, starts, hs, strict=True)):
            if s.length != start:
                raise ValueError(
                    f"sequence {i}: its MTP cache holds {s.length} positions but its committed tokens start at "
                    f"{start}; restore the MTP state along with the model's"
                )
            if h.shape[0] != len(c):
                raise ValueError(f"sequence {i}: {len(c)} committed tokens but {h.shape[0]} hidden rows")
        kept = [s.checkpoint() for s in states]
        try:
            with torch.inference_mode():  # (caches made here stay writable in the next step)
                drafts, probs = self._drafts(states, committed, starts, hs, seeds, k)
        except BaseException:
            for s, cp in zip(states, kept, strict=True):  # a failed pass (a node lost) leaves no rows behind
                s.restore(cp)
            raise
        self.confidence = [tuple(ps) for ps in probs]
        return [tuple(d) for d in drafts]

    def _drafts(
        self,
        states: Sequence[MTPState],
        committed: Sequence[Sequence[int]],
        starts: Sequence[int],
        hs: Sequence[torch.Tensor],
        seeds: Sequence[int | None],
        k: int,
    ) -> tuple[list[list[int]], list[list[float]]]:
        """The catch-up and seed pass, then one pass per chain step; the caches end at the committed rows."""
        drafts: list[list[int]] = [[] for _ in states]
        probs: list[list[float]] = [[] for _ in states]
        live, h_mtp, logits = self._catch_up(states, committed, hs, seeds)
        while live:
            ids, p = top_token(logits)
            going, rows = [], []
            for j, i in enumerate(live):
                if p[j] < self.p_min:
                    continue
                drafts[i].append(ids[j])
                probs[i].append(p[j])
                if len(drafts[i]) < k:
                    going.append(i)
                    rows.append(j)
            live = going
            if live:
                chain = [states[i] for i in live]
                h_mtp, logits = self._pass(
                    chain, [[drafts[i][-1]] for i in live], h_mtp[rows], range(len(live))
                )
        for s, c, start in zip(states, committed, starts, strict=True):
            s.kv.restore(start + len(c))  # the seed and draft rows leave the cache
        return drafts, probs

    def _catch_up(
        self,
        states: Sequence[MTPState],
        committed: Sequence[Sequence[int]],
        hs: Sequence[torch.Tensor],
        seeds: Sequence[int | None],
    ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """The first pass: every sequence's committed rows, then its seed row where it has one. -> (the
        sequences seeded, h_mtp [M, D] and logits [M, V] of their seed rows)."""
        picked: list[MTPState] = []
        tokens: list[list[int]] = []
        h_rows: list[torch.Tensor] = []
        seeded: list[int] = []
        out: list[int] = []
        n_rows = 0
        for i, (s, c, h, seed) in enumerate(zip(states, committed, hs, seeds, strict=True)):
            rows = [*c, seed] if seed is not None else list(c)
            if not rows:
                continue
            paired = torch.cat([s.pending_h[None].to(h.device), h.float()])  # row j pairs with h of j - 1
            s.pending_h = paired[-1].clone()
            picked.append(s)
            tokens.append(rows)
            h_rows.append(paired[: len(rows)])
            n_rows += len(rows)
            if seed is not None:
                seeded.append(i)
                out.append(n_rows - 1)
        if not picked:
            return [], torch.empty(0), torch.empty(0)
        h_mtp, logits = self._pass(picked, tokens, torch.cat(h_rows), out)
        return seeded, h_mtp, logits

    def _pass(
        self, states: Sequence[MTPState], tokens: Sequence[Sequence[int]], h: torch.Tensor, out: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass of the head over the rows tokens[i] of states[i] (at the positions that follow what its
        cache holds), h [N, D] the hidden row each pairs with; the output of rows `out` only."""
        lengths = tuple(len(t) for t in tokens)
        starts = tuple(s.length for s in states)
        at = [p for s, n in zip(starts, lengths, strict=True) for p in range(s, s + n)]
        device = h.device
        batch = Batch(lengths, starts, torch.tensor(at, dtype=torch.long, device=device))
        ids = torch.tensor([t for ts in tokens for t in ts], dtype=torch.long)
        rows = torch.tensor(list(out), dtype=torch.long)
        return self.head(ids, h, batch, [s.kv for s in states], rows)


def top_token(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """logits [M, V] -> per row the highest logit's token and its probability renormalised over the TOP_K
    highest (llama.cpp's top-k sampler then softmax over what it keeps)."""
    vals, ids = torch.topk(logits.float(), min(TOP_K, logits.shape[-1]), dim=-1)  # [M, 10], descending
    p = torch.softmax(vals, dim=-1)[:, 0]  # [M]
    return ids[:, 0].tolist(), p.tolist()
