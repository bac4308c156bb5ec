"""One expert's slab in the forms the kernels multiply it in.

Dimension letters: N rows, D model width, F expert width.
The native numerics multiplies the quantized slab bytes as they lie in their memory map (swarm.compute), or,
for the types this CPU has ggml's repacked kernels for, a repacked copy of them (`native_ffn`); a whole
GGUF's experts lie back to back, so one layer's held experts are one stack per matrix (`find_stack`). The
exact numerics, and a slab type that ggml has no kernel for, multiply float32 working copies
(`dequantize_expert`). Which of these a store keeps, and for how long, is swarm.compute.store's business.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from swarm.compute import ffn, probes, weights
from swarm.compute.ffn import FFN
from swarm.compute.graph import Array
from swarm.compute.values import float32_values
from swarm.compute.weights import Weight
from swarm.sharding.slabs import ExpertSlab, SlabKey, SlabTensor

log = logging.getLogger(__name__)


@dataclass
class ExpertWeights:
    """Dequantized weights of one expert: gate and up fused as gate_up [2F, D] (gate rows first), down [D, F].

    float32 numpy arrays, which ggml's F32 kernel multiplies (`ffn`); on a GPU (a node or coordinator with
    `--device cuda`), torch tensors there instead (swarm.compute.device_experts). Fusing gate and up makes one
    matmul of the first two.
    """

    gate_up: Array
    down: Array
    gate_up_bias: Array | None = None
    down_bias: Array | None = None

    @property
    def gate(self) -> Array:
        return self.gate_up[: self.gate_up.shape[0] // 2]

    @property
    def up(self) -> Array:
        return self.gate_up[self.gate_up.shape[0] // 2 :]

    @property
    def nbytes(self) -> int:
        ts = (self.gate_up, self.down, self.gate_up_bias, self.down_bias)
        return sum(int(t.nbytes) for t in ts if t is not None)

    def ffn(self) -> FFN:
        """These float32 weights for ggml's F32 kernel (CPU only)."""
        return FFN(
            down=Weight.of_float(self.down),
            gate_up=Weight.of_float(self.gate_up),
            gate_bias=self.gate_up_bias,
            down_bias=self.down_bias,
        )


def _load(s: SlabTensor) -> np.ndarray:
    return float32_values(s.data, s.qtype, s.shape)


def _load_pair(first: SlabTensor, second: SlabTensor) -> np.ndarray:
    """Two slabs stacked on dim 0, each dequantized straight into its half (no concatenating copy)."""
    rows = first.shape[0]
    pair = np.empty((rows + second.shape[0], *first.shape[1:]), dtype=np.float32)
    float32_values(first.data, first.qtype, first.shape, out=pair[:rows])
    float32_values(second.data, second.qtype, second.shape, out=pair[rows:])
    return pair


def dequantize_expert(parts: Mapping[str, SlabTensor], device: str = "cpu") -> ExpertWeights:
    """One expert's slab (quantized, memory-mapped) -> float32 working weights (on `device`: a GPU's are
    torch tensors). `parts`: an ExpertSlab, or any mapping of its parts by tensor kind (the view an
    ExpertSlab also gives)."""
    slab = parts if isinstance(parts, ExpertSlab) else ExpertSlab.of(parts.values())
    assert slab.down is not None, "slab_dims refuses a slab without its down matrix"
    if slab.gate_up is not None:
        gate_up = _load(slab.gate_up)
        gu_bias = _load(slab.gate_up_bias) if slab.gate_up_bias is not None else None
    else:
        assert slab.gate is not None and slab.up is not None, "slab_dims refuses a slab without gate and up"
        gate_up = _load_pair(slab.gate, slab.up)
        gu_bias = None
        if slab.gate_bias is not None and slab.up_bias is not None:
            gu_bias = _load_pair(slab.gate_bias, slab.up_bias)
    down_bias = _load(slab.down_bias) if slab.down_bias is not None else None
    w = ExpertWeights(gate_up, _load(slab.down), gu_bias, down_bias)
    if device != "cpu":
        from swarm.compute.device_experts import to_device

        return to_device(w, device)
    return w


def native_ffn(slab: ExpertSlab) -> FFN | None:
    """One expert's slab as ggml multiplies it in place; None when a part's type has no ggml kernel."""
    for s in slab.matrices().values():
        if not probes.has_kernel(s.qtype):
            probes.warn_no_kernel(int(s.qtype), f"expert slab {s.kind}")
            return None

    def w(s: SlabTensor | None) -> Weight | None:
        return weights.repacked(Weight.of_bytes(s.data, s.qtype, s.shape)) if s is not None else None

    def bias(s: SlabTensor | None) -> np.ndarray | None:
        return _load(s) if s is not None else None

    down = w(slab.down)
    assert down is not None
    if slab.gate_up is not None:
        return FFN(down=down, gate_up=w(slab.gate_up), gate_bias=bias(slab.gate_up_bias),
                   down_bias=bias(slab.down_bias))  # fmt: skip
    return FFN(
        down=down, gate=w(slab.gate), up=w(slab.up), gate_bias=bias(slab.gate_bias), up_bias=bias(slab.up_bias),
        down_bias=bias(slab.down_bias),
    )  # fmt: skip


def copied_bytes(slab: ExpertSlab) -> int:
    """The bytes of one expert's parts that native calls multiply as a repacked copy (resident memory)."""
    return sum(s.data.nbytes for s in slab.values() if not _in_place(s))


def call_bytes(slab: ExpertSlab, native: bool) -> int:
    """The bytes of the copy a call multiplies this expert as: its repacked parts (native, 0 when ggml
    multiplies every part in place) or its float32 working copy (exact, or a type without a ggml kernel)."""
    if native and all(probes.has_kernel(s.qtype) for s in slab.matrices().values()):
        return copied_bytes(slab)
    return sum(4 * int(np.prod(s.shape)) for s in slab.values())


def _in_place(s: SlabTensor) -> bool:
    rows = int(np.prod(s.shape[:-1])) if len(s.shape) > 1 else 1
    return s.kind.endswith(".bias") or not weights.repackable(int(s.qtype), rows)


def multiplied_in_place(slabs: Iterable[ExpertSlab]) -> list[np.ndarray]:
    """The bytes of the slab parts that native calls multiply where they lie (not as a repacked copy)."""
    return [s.data for slab in slabs for s in slab.values() if _in_place(s)]


def find_stack(layer: int, experts: dict[int, ExpertSlab]) -> ffn.ExpertStack | None:
    """The ExpertStack of one layer's held experts, or None when their slabs are not back to back in one
    mapping (slab files), carry biases, or have a type without a ggml kernel."""
    first = next(iter(experts.values()))
    names = sorted(first.matrices())
    if any(slab.has_bias or sorted(slab.matrices()) != names for slab in experts.values()):
        return None
    n_stack, lo = max(experts) + 1, min(experts)
    e0 = next(iter(experts))
    stacks: dict[str, Weight] = {}
    for name in names:
        ref: SlabTensor = getattr(first, name)
        if not probes.has_kernel(ref.qtype):
            return None
        w = Weight.of_bytes(ref.data, ref.qtype, ref.shape)
        base, owner = w.ptr - e0 * w.nbytes, ref.data.base
        # every expert's slab of this kind at its place in one stack: a layer holds hundreds, so compare
        # addresses rather than build a Weight per slab (a cold first call pays for each)
        for e, slab in experts.items():
            s: SlabTensor = getattr(slab, name)
            arr = s.data
            if (
                s.qtype != ref.qtype
                or s.shape != ref.shape
                or arr.base is not owner
                or arr.nbytes != w.nbytes
                or not arr.flags.c_contiguous
                or arr.__array_interface__["data"][0] != base + e * w.nbytes
            ):
                return None
        stacks[name] = Weight(w.qtype, w.rows, w.cols, base + lo * w.nbytes, (n_stack - lo) * w.nbytes, owner,
                              n_stack - lo)  # fmt: skip
    # the held experts lo.. in ggml's repacked layout where it has one, indexed from expert 0 as in the file
    stacks = {k: weights.repacked(h).stacked(n_stack, lo) for k, h in stacks.items()}
    log.debug("layer %d: %d experts multiplied as stacks", layer, len(experts))
    return ffn.ExpertStack(
        down=stacks["down"], gate=stacks.get("gate"), up=stacks.get("up"), gate_up=stacks.get("gate_up")
    )


def slab_dims(key: SlabKey, slab: ExpertSlab) -> tuple[int, int]:
    """(D, F) of one expert's slab, checking that its parts are complete and agree."""
    layer, expert = key
    if slab.down is None or not (slab.gate_up is not None or (slab.gate is not None and slab.up is not None)):
        raise ValueError(
            f"slab {layer}:{expert} is incomplete (has {sorted(slab)}); it needs "
            "ffn_gate_exps, ffn_up_exps (or ffn_gate_up_exps) and ffn_down_exps"
        )
    d, f = slab.down.shape
    if slab.gate_up is not None:
        shapes, want = [slab.gate_up.shape], [(2 * f, d)]
    else:
        assert slab.gate is not None and slab.up is not None
        shapes, want = [slab.gate.shape, slab.up.shape], [(f, d), (f, d)]
    if [tuple(s) for s in shapes] != want:
        raise ValueError(
            f"slab {layer}:{expert}: gate/up shapes {shapes} do not match down {slab.down.shape}"
        )
    return d, f
