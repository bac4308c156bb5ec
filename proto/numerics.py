"""The two numerics a product can be computed in: one type from the command line through the wire (here, the
lowest floor, so the codec carries it as itself) to the kernels.

- `native` (the default): every weight stays in its file type (Q4_K, Q8_0, BF16, ...) and ggml multiplies
  the stored blocks, quantizing each activation row to the type its kernel pairs with (Q8_K for K-quants,
  Q8_0/Q8_1 for the legacy quants, BF16 for BF16, ...). These are llama.cpp's numerics.
- `exact`: float32 weights (dequantized once, bit-identical to gguf-py) times float32 activations with
  ggml's F32 kernel: the oracle that matches transformers.

Each activation row is quantized on its own, and every output element is computed by one kernel whatever the
batch: a row's result does not depend on how many rows share the matmul, which other sequences are in the
step, or which process on the same CPU computes it (swarm.compute.probes: a type whose rows a batch changes
on this build, as tinyBLAS's or ARM's 2-row int8-matmul kernels do, is multiplied one row at a time). A different SIMD level rounds differently: see swarm.compute.numclass.
"""

from __future__ import annotations

import enum


class Numerics(enum.StrEnum):
    NATIVE = "native"
    EXACT = "exact"

    @classmethod
    def of(cls, exact: bool) -> Numerics:
        """The numerics a command's `--exact` flag asks for."""
        return cls.EXACT if exact else cls.NATIVE
