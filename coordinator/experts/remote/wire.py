"""`--wire q8`: each layer's rows sent as the 8-bit blocks its experts' kernels quantize them to (Q8_K for
K-quant experts, Q8_0 for Q4_0 / Q8_0 / IQ4_NL ones), made here by ggml's own quantizer, so that a node is
sent about a quarter of float32's bytes and answers the float32 rows' bits (swarm.compute.rowquant,
swarm.proto.q8). A layer whose experts take no such rows (float weights; gate and up of types that pair with
different ones; Q4_1 / Q5_1) and the exact numerics get float32 rows, as does a call some row of which would
not reach the kernel as it is."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from swarm.compute.rowquant import row_type, wire_rows
from swarm.sharding.gguf_io import expert_tensors, open_gguf
from swarm.sharding.manifest import read_manifest

log = logging.getLogger(__name__)

# The expert matrices that multiply the rows a call carries (down multiplies the node's own intermediate).
_ROW_KINDS = frozenset({"ffn_gate_exps", "ffn_up_exps", "ffn_gate_up_exps"})


def expert_row_types(path: str | Path) -> dict[int, int | None]:
    """Per MoE layer of the model at `path` (a shard directory or a GGUF), the 8-bit type its experts'
    gate and up kernels quantize their rows to, or None where they take float32 rows."""
    by_layer: dict[int, set[int]] = {}
    if Path(path).is_dir():
        for t in read_manifest(path).expert_tensors:
            if t.kind in _ROW_KINDS:
                by_layer.setdefault(t.layer, set()).add(int(GGMLQuantizationType[t.qtype]))
    else:
        for et in expert_tensors(open_gguf(path), path):
            if et.kind in _ROW_KINDS and et.name.endswith(".weight"):
                by_layer.setdefault(et.layer, set()).add(int(et.qtype))
    return {layer: row_type(types) for layer, types in by_layer.items()}


class Q8Wire:
    """The row types of one model's layers, and its rows quantized for a layer's calls."""

    def __init__(self, path: str | Path) -> None:
        self.types = expert_row_types(path)
        self.fallbacks = 0  # layer calls sent as float32 because a row would not survive the blocks
        shown = sorted({t for t in self.types.values() if t is not None})
        log.info("--wire q8: %d of %d MoE layers take 8-bit rows (types %s)",
                 sum(t is not None for t in self.types.values()), len(self.types), shown)  # fmt: skip

    def blocks(self, layer: int, x: torch.Tensor) -> tuple[int, torch.Tensor] | None:
        """(the type, x [T, D] as its blocks uint8 [T, row bytes]) for `layer`'s calls, or None: send float32."""
        qtype = self.types.get(layer)
        if qtype is None:
            return None
        rows = wire_rows(
            np.ascontiguousarray(x.detach().to(device="cpu", dtype=torch.float32).numpy()), qtype
        )
        if rows is None:
            self.fallbacks += 1
            return None
        return qtype, torch.from_numpy(rows.data)
