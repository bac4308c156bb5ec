"""What one more row costs the coordinator's dense path on this CPU: a Q8_0 matrix (the dense weights' type in
the bench model) times 1, 2, 3 and 4 rows through compute.dense.linear, as a checking window of k drafts
multiplies k + 1 rows where a one-token pass multiplies one."""

from __future__ import annotations

import time

import numpy as np
import torch
from gguf import GGMLQuantizationType

from swarm.compute.dense import linear
from swarm.compute.ggml import set_threads
from swarm.compute.probes import rows_independent
from swarm.compute.weights import Weight, repackable

SHAPE = (4096, 2048)  # [O, I]: the width of the 35B shape's attention projections (D 2048 in)
Q8_0_BLOCK, Q8_0_BYTES = 32, 34  # values per block, bytes per block (an f16 scale and 32 int8)


def q8_0_matrix(rows: int, cols: int, seed: int = 0) -> Weight:
    """A Q8_0 matrix of random int8 values under one small scale (its products' values do not matter)."""
    blocks = rows * cols // Q8_0_BLOCK
    raw = np.empty((blocks, Q8_0_BYTES), dtype=np.uint8)
    raw[:, :2] = np.full(blocks, 0.01, dtype=np.float16).view(np.uint8).reshape(blocks, 2)
    raw[:, 2:] = np.random.default_rng(seed).integers(0, 256, (blocks, Q8_0_BLOCK), dtype=np.uint8)
    return Weight.of_bytes(raw.reshape(-1), int(GGMLQuantizationType.Q8_0), (rows, cols))


def matmul_ms(
    counts: tuple[int, ...] = (1, 2, 3, 4), threads: int = 1, repeats: int = 31
) -> dict[int, float]:
    """The fastest of `repeats` products of the SHAPE matrix with each count of rows, ms, on `threads` threads
    (the fastest: what the product itself costs, where a median would take in the other processes' load on
    this shared machine)."""
    set_threads(threads)
    w = q8_0_matrix(*SHAPE)
    xs = {n: torch.randn(n, SHAPE[1]) for n in counts}
    for x in xs.values():
        linear([w], x)  # builds and keeps each graph
    times: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(repeats):  # the counts in turn: a busy spell of this shared machine meets them all
        for n, x in xs.items():
            t0 = time.perf_counter()
            linear([w], x)
            times[n].append(time.perf_counter() - t0)
    out = {n: min(t) * 1e3 for n, t in times.items()}
    return out


def batched() -> bool:
    """Whether compute.graph multiplies a Q8_0 matrix's rows in one batched product on this build (else one
    row at a time, to keep each row's bits those it gets alone)."""
    q8 = int(GGMLQuantizationType.Q8_0)
    return rows_independent(q8) and not repackable(q8, SHAPE[0])
