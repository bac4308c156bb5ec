"""The random bytes of a synthetic model's tensors, a chunk at a time, deterministic per (seed, tensor name).

Float types and gguf's own quantizer types are made from drawn values; the K- and I-quants (gguf-py cannot
quantize them) are written as valid random blocks whose scales give the values the wanted spread.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from swarm.sharding.synth_plan import Init, PlannedTensor

Q = GGMLQuantizationType

# Rows of at most this many elements are generated at once: memory stays flat whatever the model size.
CHUNK_ELEMENTS = 1 << 22


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    """One generator per tensor: a tensor's bytes depend only on the seed and its name, not on the order."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _draw(rng: np.random.Generator, init: Init, n: int) -> np.ndarray:
    if init.kind == "normal":
        return rng.standard_normal(n, dtype=np.float32) * np.float32(init.sigma)
    if init.kind == "norm":
        # Norm weights around 1 (the hybrid archs' files store 1 + w already, MODELS.md).
        return 1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)
    if init.kind == "ssm_a":
        # ssm_a = -exp(A_log) with A_log = log(U(0.5, 8)): decays between exp(-8 dt) and exp(-0.5 dt).
        return -rng.uniform(0.5, 8.0, n).astype(np.float32)
    if init.kind == "dt_bias":
        return (rng.standard_normal(n, dtype=np.float32) * 0.5 - 2.5).astype(np.float32)
    raise AssertionError(f"unknown init {init.kind}")


def _encode(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype == Q.F32:
        return values.astype(np.float32, copy=False)
    if qtype == Q.F16:
        return values.astype(np.float16)
    return gguf_quants.quantize(values, qtype)


def _f16_bits(x: float) -> int:
    return int(np.array(x, dtype=np.float16).view(np.uint16))


def _kquant_blocks(
    rng: np.random.Generator, qtype: GGMLQuantizationType, n_blocks: int, sigma: float
) -> np.ndarray:
    """Q4_K / Q5_K blocks whose 8 sub-blocks are zero-mean: value = d*sc*(q - (2^b - 1)/2).

    Each sub-block's 6-bit scale sc is even and its min m = sc/2, with dmin = (2^b - 1) * d, so
    d*sc*q - dmin*m = d*sc*(q - (2^b-1)/2): symmetric around zero, like a trained weight matrix's rows.
    """
    bits = 4 if qtype == Q.Q4_K else 5
    _, size = GGML_QUANT_SIZES[qtype]
    out = np.empty((n_blocks, size), dtype=np.uint8)
    out[:, 16:] = rng.integers(0, 256, (n_blocks, size - 16), dtype=np.uint8)  # qh/qs: uniform q
    half = rng.integers(16, 32, (n_blocks, 8), dtype=np.uint8)  # m in [16, 31], sc = 2m in [32, 62]
    sc, m = half * 2, half
    scales = np.empty((n_blocks, 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    out[:, 4:16] = scales
    levels = (1 << bits) - 1
    q_std = ((levels + 1) ** 2 - 1) ** 0.5 / 12**0.5  # std of a uniform integer on [0, levels]
    sc_rms = float(np.sqrt(np.mean(np.arange(32, 63, 2, dtype=np.float64) ** 2)))
    d = sigma / (sc_rms * q_std)
    hdr = np.array([_f16_bits(d), _f16_bits(d * levels)], dtype=np.uint16).view(np.uint8)
    out[:, 0:4] = hdr
    return out


# Where each random-bytes type keeps its f16 super-block scale d (IQ1_M spreads it, see _set_d).
_D_OFFSET = {Q.Q6_K: 208, Q.IQ4_XS: 0, Q.IQ2_XS: 0}


def _set_d(blocks: np.ndarray, qtype: GGMLQuantizationType, d: float) -> None:
    bits = _f16_bits(d)
    if qtype == Q.IQ1_M:
        # IQ1_M stores d's 16 bits as the top nibbles of its four u16 block-scale words.
        words = blocks[:, 48:56].view(np.uint16)
        for i in range(4):
            words[:, i] = (words[:, i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
        return
    off = _D_OFFSET[qtype]
    blocks[:, off : off + 2] = np.array([bits], dtype=np.uint16).view(np.uint8)


@functools.cache
def _unit_std(qtype: GGMLQuantizationType) -> float:
    """Std of values from uniformly random blocks of `qtype` with d = 1, measured with gguf's dequantizer."""
    _, size = GGML_QUANT_SIZES[qtype]
    blocks = np.random.default_rng(12345).integers(0, 256, (4096, size), dtype=np.uint8)
    _set_d(blocks, qtype, 1.0)
    return float(gguf_quants.dequantize(blocks, qtype).std())


def _random_blocks(
    rng: np.random.Generator, qtype: GGMLQuantizationType, n_blocks: int, sigma: float
) -> np.ndarray:
    """Uniformly random (hence valid) blocks of an I-quant or Q6_K, with d set so values have std ~sigma."""
    _, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    _set_d(blocks, qtype, sigma / _unit_std(qtype))
    return blocks


def tensor_chunks(t: PlannedTensor, seed: int) -> Iterator[np.ndarray]:
    """The tensor's bytes, a few million elements at a time, in file order."""
    rng = tensor_rng(seed, t.name)
    row = t.shape[0]
    n_rows = t.n_elements // row
    rows_per_chunk = max(1, CHUNK_ELEMENTS // row)
    block = GGML_QUANT_SIZES[t.qtype][0]
    for start in range(0, n_rows, rows_per_chunk):
        rows = min(rows_per_chunk, n_rows - start)
        if t.qtype in (Q.Q4_K, Q.Q5_K):
            out = _kquant_blocks(rng, t.qtype, rows * row // block, t.init.sigma)
        elif t.qtype in (Q.Q6_K, Q.IQ4_XS, Q.IQ2_XS, Q.IQ1_M):
            out = _random_blocks(rng, t.qtype, rows * row // block, t.init.sigma)
        else:
            out = _encode(_draw(rng, t.init, rows * row).reshape(rows, row), t.qtype)
        yield np.ascontiguousarray(out).reshape(-1).view(np.uint8)
