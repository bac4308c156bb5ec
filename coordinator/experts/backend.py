"""Expert backends: where a MoE layer's selected (token, expert) pairs get computed.

Dimension letters: T tokens, K selected experts per token, D model width, N = T*K pairs.
A model's MoE block calls `backend.start(layer, x, ids)` right after routing, computes its shared
expert while the work is in flight, then `pending.wait()` gives every pair's output as [T, K, D].
The weighting and the sum over K stay in the model, in a fixed slot order, so the result is the
same whichever backend (or node) computed the pairs. A backend whose experts lie in this process may
instead hand them over as one stack (`backend.stack`), and the MoE block runs the whole layer in one graph.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from swarm.compute.ffn import ExpertStack
from swarm.compute.store import ExpertStore
from swarm.coordinator.config import Wire
from swarm.proto.numerics import Numerics
from swarm.sharding.errors import UserError


class PendingExperts(Protocol):
    @property
    def in_flight(self) -> bool:
        """True while the experts are computed elsewhere until wait() (the MoE block then runs its shared
        expert on one thread meanwhile); False when start() has computed them already."""
        ...

    @property
    def dropped(self) -> torch.Tensor | None:
        """After wait(): [T, K] bool, True where degraded mode left a pair out (its output zeroed; the MoE
        block renormalizes the weights over the rest); None when every pair was computed."""
        ...

    def wait(self) -> torch.Tensor:
        """Outputs [T, K, D] for every (token, slot) pair, float32."""
        ...


class ExpertBackend(Protocol):
    def stack(self, layer: int, ids: torch.Tensor) -> ExpertStack | None:
        """Experts ids [T, K] of MoE layer `layer` as one stack the MoE block's graph multiplies in this
        process (ffn.moe_layer: the experts, the shared expert and the sum at once), or None where this
        backend computes them itself in start()."""
        ...

    def start(self, layer: int, x: torch.Tensor, ids: torch.Tensor) -> PendingExperts:
        """Begin computing experts ids [T, K] on rows x [T, D] of MoE layer `layer`."""
        ...


@dataclass(frozen=True)
class ExpertMajor:
    """(token, slot) pairs grouped expert-major: counts -> offsets -> packed rows."""

    expert_ids: list[int]  # distinct experts, ascending
    counts: list[int]  # rows per expert, same order
    order: torch.Tensor  # [N] flat pair index (t*K + k) of each packed row

    def offsets(self) -> list[int]:
        """Row offset of each expert's block in the packed rows."""
        out, start = [], 0
        for n in self.counts:
            out.append(start)
            start += n
        return out

    def pack(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """Rows [N, D]: row i is the token of pair order[i]."""
        return x.index_select(0, torch.div(self.order, k, rounding_mode="floor").to(x.device))

    def unpack(self, out: torch.Tensor, t: int, k: int) -> torch.Tensor:
        """Packed outputs [N, D] back to [T, K, D]."""
        full = torch.empty(t * k, out.shape[-1], dtype=out.dtype, device=out.device)
        full[self.order.to(out.device)] = out
        return full.view(t, k, -1)


def group_expert_major(ids: torch.Tensor) -> ExpertMajor:
    """Group the pairs of ids [T, K] by expert; within an expert, pairs keep their (token, slot) order."""
    flat = ids.reshape(-1).cpu()
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    return ExpertMajor(expert_ids=experts.tolist(), counts=counts.tolist(), order=order)


class _Done:
    in_flight = False  # computed in start()
    dropped: torch.Tensor | None = None

    def __init__(self, out: torch.Tensor) -> None:
        self._out = out

    def wait(self) -> torch.Tensor:
        return self._out


class LocalExperts:
    """In-process backend: the node's own compute on slabs loaded here. The embedded default and the oracle.

    `wire` rounds rows and outputs as the swarm's wire would, so that local and swarm results can be
    compared bit for bit at the same wire precision (q8 rows reach a node's kernel as the blocks it would
    make of float32 ones, so they round as f32); `numerics` is what a Compute call carries.
    """

    def __init__(self, store: ExpertStore, wire: Wire = Wire.F32, numerics: Numerics = Numerics.NATIVE) -> None:
        self.store = store
        self.wire = wire
        self.numerics = numerics
        self._rounds = wire.dtype != torch.float32  # rows and answers rounded to the wire's float type

    def stack(self, layer: int, ids: torch.Tensor) -> ExpertStack | None:
        """The layer's experts as one stack a graph multiplies where they lie (ids checked held), when this
        backend computes them so (native numerics, float32 wire, stacked in the file); else None."""
        if self.numerics != Numerics.NATIVE or self._rounds:
            return None
        return self.store.held_stack(layer, ids)

    def start(self, layer: int, x: torch.Tensor, ids: torch.Tensor) -> PendingExperts:
        if self.numerics == Numerics.NATIVE and not self._rounds:
            # the tokens as they are, no packing (the same bits as a node's packed call of the same pairs)
            out = self.store.compute_slots(layer, x, ids)
            if out is not None:
                return _Done(out.to(x.device))
        t, k = ids.shape
        major = group_expert_major(ids)
        rows = major.pack(x, k).to(self.wire.dtype)
        out = self.store.compute(layer, major.expert_ids, major.counts, rows, self.numerics)
        out = out.to(self.wire.dtype)
        return _Done(major.unpack(out.to(device=x.device, dtype=torch.float32), t, k))


class _Dropped:
    in_flight = False  # computed in start()

    def __init__(self, out: torch.Tensor, dropped: torch.Tensor) -> None:
        self._out, self.dropped = out, dropped

    def wait(self) -> torch.Tensor:
        return self._out


class WithoutExperts:
    """In-process experts with some experts gone, as the swarm's degraded mode leaves them out: their pairs
    are zeroed and flagged in `dropped` [T, K], and the MoE block renormalizes over the rest. The oracle
    for degraded mode, and how its quality cost is measured."""

    def __init__(self, inner: ExpertBackend, gone: set[int]) -> None:
        self.inner, self.gone = inner, torch.tensor(sorted(gone), dtype=torch.long)

    def stack(self, layer: int, ids: torch.Tensor) -> ExpertStack | None:
        return None  # start() zeroes the gone experts' pairs, which one graph would compute

    def start(self, layer: int, x: torch.Tensor, ids: torch.Tensor) -> PendingExperts:
        out = self.inner.start(layer, x, ids).wait()
        mask = torch.isin(ids, self.gone.to(ids.device))  # [T, K]
        return _Dropped(out.masked_fill(mask[..., None], 0.0), mask)


class RoutingStats:
    """Counts how often the router picks each (layer, expert) while passing the work on to `inner`: what
    `swarm run --stats FILE` records and `swarm plan --stats FILE` replicates hot experts by."""

    def __init__(self, inner: ExpertBackend) -> None:
        self.inner = inner
        self.counts: dict[tuple[int, int], int] = {}
        self.tokens = 0
        self._first_layer: int | None = None

    def stack(self, layer: int, ids: torch.Tensor) -> ExpertStack | None:
        return None  # start() counts the picks, which one graph would skip

    def start(self, layer: int, x: torch.Tensor, ids: torch.Tensor) -> PendingExperts:
        if self._first_layer is None or layer < self._first_layer:
            self._first_layer = layer
        if layer == self._first_layer:
            self.tokens += int(ids.shape[0])
        experts, n = torch.unique(ids.reshape(-1).cpu(), return_counts=True)
        for e, c in zip(experts.tolist(), n.tolist(), strict=True):
            self.counts[(layer, e)] = self.counts.get((layer, e), 0) + c
        return self.inner.start(layer, x, ids)

    def save(self, path: str | Path, model: str) -> None:
        """Add these counts to the file's (made if missing), atomically."""
        p = Path(path)
        data: dict[str, Any] = {"model": model, "tokens": 0, "counts": {}}
        if p.exists():
            try:
                data = json.loads(p.read_text())
                ok = data.get("model") == model and isinstance(data.get("counts"), dict)
            except (OSError, ValueError, AttributeError):
                ok = False
            if not ok:
                raise UserError(f"{p}: not routing statistics of this model; give another --stats file")
        counts = data["counts"]
        for (layer, e), n in self.counts.items():
            counts[f"{layer}:{e}"] = int(counts.get(f"{layer}:{e}", 0)) + n
        data["tokens"] = int(data.get("tokens", 0)) + self.tokens
        tmp = p.with_name(p.name + f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(data, sort_keys=True) + "\n")
        os.replace(tmp, p)
