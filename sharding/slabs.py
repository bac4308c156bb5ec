"""Expert slabs: one expert's bytes of each stacked expert tensor of one layer.

A slab is the same bytes wherever it comes from: a view of the whole model's memory map, or a
mini-GGUF written by `swarm shard`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from swarm.sharding.gguf_io import expert_tensors, open_gguf

SlabKey = tuple[int, int]  # (layer, expert)


@dataclass(frozen=True)
class SlabTensor:
    """One expert's part of one stacked tensor: raw bytes in the source quant type."""

    kind: str  # ffn_gate_exps | ffn_up_exps | ffn_down_exps | ffn_gate_up_exps (+ ".bias" for biases)
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order
    data: np.ndarray  # uint8 bytes (a view of a memory map)


def slabs_from_gguf(
    path: str | Path, layers: Iterable[int] | None = None, experts: Iterable[int] | None = None
) -> dict[SlabKey, dict[str, SlabTensor]]:
    """The expert slabs of a whole (unsharded) GGUF, as zero-copy views of its stacked tensors."""
    reader = open_gguf(path)
    want_layers = set(layers) if layers is not None else None
    want_experts = set(experts) if experts is not None else None
    out: dict[SlabKey, dict[str, SlabTensor]] = {}
    for et in expert_tensors(reader, path):
        if want_layers is not None and et.layer not in want_layers:
            continue
        kind = et.kind if et.name.endswith(".weight") else et.kind + ".bias"
        for e in range(et.n_expert):
            if want_experts is not None and e not in want_experts:
                continue
            out.setdefault((et.layer, e), {})[kind] = SlabTensor(kind, et.qtype, et.slab_shape, et.slab(e))
    return out
