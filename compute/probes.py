"""What this ggml build can multiply and how: which quant types have a kernel, and for which types llamafile's
tinyBLAS GEMM sums each element exactly as ggml's `vec_dot` does (checked once per process, never assumed).
"""

from __future__ import annotations

import ctypes
import logging
import threading

import numpy as np
import torch
from gguf import GGMLQuantizationType

from swarm.compute.ggml import ggml_lib

log = logging.getLogger(__name__)

# Types whose tinyBLAS GEMM can sum each element as vec_dot does (x86: Q8_0 pairs, and Q4_0 / Q5_0 unpacked to
# the same int8 values); each is still checked on this build before it is trusted.
_TINYBLAS_CANDIDATES = frozenset(int(t) for t in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0,
                                                  GGMLQuantizationType.Q5_0))  # fmt: skip
_tinyblas: dict[int, bool] = {}
_warned: set[int] = set()  # types whose missing kernel has been logged
_tinyblas_lock = threading.Lock()


def tinyblas_exact(qtype: int) -> bool:
    """Whether a matmul of several rows gives each row the bits it gets alone, for weights of this type on
    this ggml build: always without tinyBLAS; with it, only for a candidate type whose probe agrees."""
    known = _tinyblas.get(qtype)
    if known is not None:
        return known
    with _tinyblas_lock:
        if qtype not in _tinyblas:
            g = ggml_lib()
            if not g.ggml_cpu_has_llamafile():
                _tinyblas[qtype] = True
            else:
                _tinyblas[qtype] = qtype in _TINYBLAS_CANDIDATES and _probe_batched_rows(qtype)
                log.debug("tinyBLAS for %s: %s", GGMLQuantizationType(qtype).name, _tinyblas[qtype])
    return _tinyblas[qtype]


def _probe_batched_rows(qtype: int) -> bool:
    """Random weights of this type times 7 and 2 rows in one matmul (tinyBLAS's tiles and its edge tiles)
    against each row alone (vec_dot): the same bytes?"""
    from gguf import quants

    from swarm.compute.graph import Graph
    from swarm.compute.weights import Weight

    rng = np.random.default_rng(0)
    rows, cols = 64, 512
    data = quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), GGMLQuantizationType(qtype))
    w = Weight.of_bytes(np.ascontiguousarray(data).view(np.uint8).reshape(-1), qtype, (rows, cols))
    x = torch.from_numpy(rng.standard_normal((7, cols)).astype(np.float32))

    def product(xs: torch.Tensor) -> torch.Tensor:
        n = int(xs.shape[0])
        gr = Graph(4 * n * (rows + cols) + 4096, 4, keep=True)  # own memory: a graph may be mid-build
        try:
            gr.output(gr.g.ggml_mul_mat(gr.ctx, gr.weight(w), gr.input(cols, n)))
            out = torch.empty(n, rows)
            gr.build().run([xs.contiguous()], [out])
            return out
        finally:
            gr.free()

    alone = torch.cat([product(x[i : i + 1]) for i in range(7)])
    return all(torch.equal(product(x[:n]), alone[:n]) for n in (7, 2))


_has_kernel: dict[int, bool] = {}


def has_kernel(qtype: int) -> bool:
    """Whether ggml's CPU backend multiplies this type as stored."""
    known = _has_kernel.get(int(qtype))
    if known is None:
        known = _has_kernel[int(qtype)] = _ggml_has_kernel(int(qtype))
    return known


def _ggml_has_kernel(qtype: int) -> bool:
    g = ggml_lib()
    if not 0 <= int(qtype) < g.GGML_TYPE_COUNT:
        return False
    traits = g.ggml_get_type_traits_cpu(int(qtype))
    if not traits or not ctypes.cast(traits.contents.vec_dot, ctypes.c_void_p).value:
        return False
    vdt = traits.contents.vec_dot_type
    if vdt == int(qtype):
        return True
    pair = g.ggml_get_type_traits_cpu(vdt)
    return bool(pair) and bool(ctypes.cast(pair.contents.from_float, ctypes.c_void_p).value)


def warn_no_kernel(qtype: int, what: str) -> None:
    """Say once per type that it falls back to the exact path."""
    if qtype in _warned:
        return
    _warned.add(qtype)
    name = GGMLQuantizationType(qtype).name if qtype in GGMLQuantizationType._value2member_map_ else qtype
    log.warning(
        "ggml has no CPU kernel for %s (%s): multiplied as dequantized float32 (the exact path) instead",
        name,
        what,
    )

