"""swarm.compute.dequant against gguf-py's own numpy dequantizer, bit for bit.

Bit-identity is checked on the float32 bit patterns (int32 views), so -0.0 vs 0.0 counts as a difference.
Inputs: random blocks (every byte random, the float16 scale fields kept finite: random subnormal scales
included), all 65536 patterns of the 16-bit float types, the tensors of the reference fixture GGUFs (real
llama.cpp Q4_K/Q5_K/Q6_K/Q8_0/BF16 blocks) and `swarm synth` models of every expert type.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from conftest import FIXTURES
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize

import swarm.compute.dequant as dq
from swarm.compute.dequant import TORCH_TYPES, dequantize
from swarm.compute.expert_weights import dequantize_expert
from swarm.sharding import gguf_io
from swarm.sharding.gguf_io import torch_shape
from swarm.sharding.slabs import SlabTensor, slabs_from_gguf
from swarm.sharding.synth import synthesize
from swarm.sharding.synth_spec import EXPERT_TYPES, preset

Q = GGMLQuantizationType

# Byte offsets of the float16 scale fields in one block of each type (from gguf-py's block layouts).
F16_FIELDS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    Q.Q8_0: (0,),
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.TQ1_0: (52,),
    Q.IQ4_NL: (0,),
}
BLOCK_TYPES = sorted(
    TORCH_TYPES - {Q.F32, Q.F16}, key=lambda q: q.value
)  # the types with a torch block decoder
FALLBACK_TYPES = [Q.TQ1_0, Q.IQ4_NL]
FIXTURE_GGUFS = [
    FIXTURES / "qwen35moe-quant" / "model-q4_k_m.gguf",
    FIXTURES / "qwen35moe-quant" / "model-q8_0.gguf",
    FIXTURES / "qwen35moe-tiny" / "model-bf16.gguf",
]


def bits(x: torch.Tensor | np.ndarray) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x.contiguous()
    assert t.dtype == torch.float32
    return t.view(torch.int32)


def assert_bit_identical(got: torch.Tensor | np.ndarray, want: np.ndarray) -> None:
    assert tuple(got.shape) == want.shape
    g, w = bits(got), bits(want)
    if not torch.equal(g, w):
        bad = (g != w).nonzero()[:5].tolist()
        raise AssertionError(f"{int((g != w).sum())} values differ, first at {bad}")


def finite_f16(words: np.ndarray) -> np.ndarray:
    """Random 16-bit patterns with Inf/NaN (exponent all ones) moved to finite values; subnormals stay."""
    words = words.copy()
    special = (words & 0x7C00) == 0x7C00
    words[special] &= 0xBFFF  # clears the top exponent bit: a large finite value
    return words


def random_blocks(qtype: GGMLQuantizationType, n_blocks: int, seed: int) -> np.ndarray:
    """n_blocks of random bytes of `qtype`, [n_blocks * type_size] uint8, scales finite."""
    _, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    if qtype == Q.BF16:
        words = blocks.view(np.uint16)
        words[(words & 0x7F80) == 0x7F80] &= 0xBF7F  # finite bfloat16
    for off in F16_FIELDS.get(qtype, ()):
        field = np.ascontiguousarray(blocks[:, off : off + 2]).view(np.uint16)
        blocks[:, off : off + 2] = finite_f16(field).view(np.uint8)
    return blocks.reshape(-1)


def reference(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """gguf-py's dequantization of bytes `raw` as a tensor of torch shape `shape`."""
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return gguf_dequantize(np.asarray(raw).reshape(rows, -1), qtype).reshape(shape)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("shape_blocks", [(3, 5, 7), (1, 1, 4001), (4001,)], ids=str)
def test_random_blocks_bit_identical(qtype, shape_blocks):
    block, _ = GGML_QUANT_SIZES[qtype]
    shape = (*shape_blocks[:-1], shape_blocks[-1] * block)
    n_blocks = int(np.prod(shape)) // block
    raw = random_blocks(qtype, n_blocks, seed=n_blocks + qtype.value)
    assert_bit_identical(dequantize(raw, qtype, shape), reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_chunked_decode_bit_identical(qtype, monkeypatch):
    # Many steps with a short last one: block boundaries of the chunking change nothing.
    monkeypatch.setattr(dq, "CHUNK_ELEMENTS", 3000)
    block, _ = GGML_QUANT_SIZES[qtype]
    shape = (37, 3 * 256)
    raw = random_blocks(qtype, shape[0] * shape[1] // block, seed=7)
    assert_bit_identical(dequantize(raw, qtype, shape), reference(raw, qtype, shape))


def test_all_bfloat16_patterns_bit_identical():
    raw = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.uint8)
    assert_bit_identical(dequantize(raw, Q.BF16, (1 << 16,)), reference(raw, Q.BF16, (1 << 16,)))


def test_all_float16_patterns_match():
    words = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = dequantize(words.view(np.uint8), Q.F16, (256, 256))
    want = words.view(np.float16).astype(np.float32).reshape(256, 256)
    # Bit-identical except signalling NaNs, which torch's conversion quiets (a NaN either way).
    snan = torch.from_numpy(((words & 0x7E00) == 0x7C00) & ((words & 0x03FF) != 0)).view(256, 256)
    differ = bits(got) != bits(want)
    assert not (differ & ~snan).any()
    assert torch.isnan(got[snan]).all()


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16], ids=lambda q: q.name)
def test_float_types_from_bytes_and_typed_arrays(qtype):
    dtype = np.float32 if qtype == Q.F32 else np.float16
    values = np.random.default_rng(1).standard_normal((5, 3, 64)).astype(dtype)
    want = values.astype(np.float32)
    assert_bit_identical(dequantize(values.view(np.uint8).reshape(-1), qtype, (5, 3, 64)), want)
    assert_bit_identical(dequantize(values, qtype, (5, 3, 64)), want)  # typed, as GGUFReader gives them
    assert_bit_identical(dequantize(values.reshape(15, 64), qtype, (15, 64)), want.reshape(15, 64))


@pytest.mark.parametrize("qtype", FALLBACK_TYPES, ids=lambda q: q.name)
def test_fallback_types_match_gguf(qtype):
    assert qtype not in TORCH_TYPES
    block, _ = GGML_QUANT_SIZES[qtype]
    shape = (6, 4 * block)
    raw = random_blocks(qtype, 24, seed=3)
    assert_bit_identical(dequantize(raw, qtype, shape), reference(raw, qtype, shape))


@pytest.mark.parametrize("path", FIXTURE_GGUFS, ids=lambda p: p.name)
def test_fixture_tensors_bit_identical(path):
    reader = GGUFReader(path)
    types = set()
    for t in reader.tensors:
        shape = torch_shape(t)
        want = gguf_dequantize(t.data, t.tensor_type).reshape(shape)
        assert_bit_identical(dequantize(t.data, t.tensor_type, shape), want)
        types.add(t.tensor_type)
    assert types - {Q.F32}, "the fixture holds quantized tensors"


@pytest.mark.parametrize("experts_type", EXPERT_TYPES)
def test_synth_experts_bit_identical(tmp_path, experts_type):
    """Every expert type `swarm synth` writes, slab by slab as a node holds them, through the store."""
    path = synthesize(
        tmp_path / "s.gguf",
        preset("qwen3moe-tiny", n_layers=1, n_expert=3, experts_type=experts_type, n_vocab=300),
    )
    reader = GGUFReader(path)
    stacked = {}
    for t in reader.tensors:
        if "_exps" in t.name:
            stacked[t.name.split(".")[2]] = gguf_dequantize(t.data, t.tensor_type).reshape(torch_shape(t))
        else:  # the dense tensors, F32 and the dense type
            want = gguf_dequantize(t.data, t.tensor_type).reshape(torch_shape(t))
            assert_bit_identical(dequantize(t.data, t.tensor_type, torch_shape(t)), want)
    for (_, e), parts in slabs_from_gguf(path).items():
        for kind, s in parts.items():
            assert_bit_identical(dequantize(s.data, s.qtype, s.shape), stacked[kind][e])
        w = dequantize_expert(parts)
        want_gate_up = np.concatenate([stacked["ffn_gate_exps"][e], stacked["ffn_up_exps"][e]])
        assert_bit_identical(w.gate_up, want_gate_up)
        assert_bit_identical(w.down, stacked["ffn_down_exps"][e])


def test_readonly_memmap_zero_copy_no_warning_no_alias(tmp_path):
    path = FIXTURES / "qwen35moe-quant" / "model-q4_k_m.gguf"
    reader = GGUFReader(path)
    f32 = next(t for t in reader.tensors if t.tensor_type == Q.F32 and t.data.size > 1)
    q4k = next(t for t in reader.tensors if t.tensor_type == Q.Q4_K)
    assert not f32.data.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        values = dequantize(f32.data, Q.F32, torch_shape(f32))
        dequantize(q4k.data, Q.Q4_K, torch_shape(q4k))
    before = np.array(f32.data)
    values.fill_(7.0)  # a copy, not a view of the read-only map
    assert np.array_equal(np.asarray(f32.data), before)


def test_out_fills_a_given_tensor():
    raw = random_blocks(Q.Q4_K, 4, seed=5)
    big = torch.full((4, 512), -1.0)
    got = dequantize(raw, Q.Q4_K, (2, 512), out=big[1:3])
    assert got.data_ptr() == big[1:3].data_ptr()
    assert_bit_identical(big[1:3], reference(raw, Q.Q4_K, (2, 512)))
    assert (big[0] == -1).all() and (big[3] == -1).all()
    for qtype, data in ((Q.F32, np.ones(1024, np.float32)), (Q.TQ1_0, random_blocks(Q.TQ1_0, 4, seed=1))):
        out = torch.empty(1024)
        dequantize(data, qtype, (1024,), out=out)
        assert_bit_identical(out, reference(data, qtype, (1024,)))
    with pytest.raises(ValueError, match="float32"):
        dequantize(raw, Q.Q4_K, (2, 512), out=torch.empty(2, 512, dtype=torch.float64))
    with pytest.raises(ValueError, match="elements"):
        dequantize(raw, Q.Q4_K, (2, 512), out=torch.empty(2, 256))


@pytest.mark.parametrize(
    ("qtype", "nbytes", "shape"),
    [
        (Q.Q4_K, 144 * 4, (3, 256)),  # one block short
        (Q.Q4_K, 144 * 4, (2, 512 + 32)),  # rows not whole blocks
        (Q.Q8_0, 34 * 3, (2, 48)),
        (Q.BF16, 10, (2, 3)),
        (Q.F32, 20, (2, 3)),
        (Q.F16, 7, (2, 2)),
    ],
    ids=str,
)
def test_bad_sizes_are_value_errors_like_gguf_io(qtype, nbytes, shape):
    raw = np.zeros(nbytes, dtype=np.uint8)
    with pytest.raises(ValueError):
        gguf_io.dequantize(raw, qtype, shape)
    with pytest.raises(ValueError):
        dequantize(raw, qtype, shape)


def test_store_gate_up_down_and_biases_bit_identical():
    """dequantize_expert writes gate and up (and their biases) straight into the halves of gate_up."""
    f, d = 4, 64
    rng = np.random.default_rng(11)

    def slab(kind: str, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> SlabTensor:
        block, _ = GGML_QUANT_SIZES[qtype]
        n = int(np.prod(shape))
        raw = random_blocks(qtype, n // block, seed=int(rng.integers(1 << 30)))
        return SlabTensor(kind, qtype, shape, raw)

    parts = {
        "ffn_gate_exps": slab("ffn_gate_exps", Q.Q4_K, (f, d * 4)),
        "ffn_up_exps": slab("ffn_up_exps", Q.Q6_K, (f, d * 4)),
        "ffn_down_exps": slab("ffn_down_exps", Q.Q8_0, (d * 4, f * 8)),
        "ffn_gate_exps.bias": slab("ffn_gate_exps.bias", Q.F32, (f,)),
        "ffn_up_exps.bias": slab("ffn_up_exps.bias", Q.F32, (f,)),
        "ffn_down_exps.bias": slab("ffn_down_exps.bias", Q.F32, (d * 4,)),
    }
    want = {k: reference(s.data, s.qtype, s.shape) for k, s in parts.items()}
    w = dequantize_expert(parts)
    assert_bit_identical(w.gate_up, np.concatenate([want["ffn_gate_exps"], want["ffn_up_exps"]]))
    assert_bit_identical(
        w.gate_up_bias, np.concatenate([want["ffn_gate_exps.bias"], want["ffn_up_exps.bias"]])
    )
    assert_bit_identical(w.down, want["ffn_down_exps"])
    assert_bit_identical(w.down_bias, want["ffn_down_exps.bias"])
