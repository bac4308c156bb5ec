"""Answers packed in byte planes (F32_PLANES, swarm.proto.planes): every float32 bit comes back, the packed
answer is smaller than float32 on an expert's outputs, and bytes that do not hold the values said are refused
with a CodecError (never a numpy or zlib error, never a huge allocation)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from swarm.proto import expert_pb2 as pb
from swarm.proto.codec import CodecError, compute_request, decode_array, encode_planes
from swarm.proto.planes import PLANES, PlanesError, pack_planes, unpack_planes


def _answers(n: int, d: int, seed: int) -> np.ndarray:
    """Expert-output-like rows: normal values, each row at its own scale."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.normal(-3.0, 1.5, (n, 1)))
    return (rng.standard_normal((n, d)) * scale).astype(np.float32)


def _specials() -> np.ndarray:
    bits = np.array(
        [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7FA00001, 0xFFFFFFFF, 0x00000001,
         0x807FFFFF, 0x7F7FFFFF, 0x3F800000, 0xBF800000],
        dtype=np.uint32,
    )  # fmt: skip
    return bits.view(np.float32).reshape(3, 4)


@pytest.mark.parametrize("shape", [(0, 2048), (1, 1), (3, 4), (37, 2048), (256, 768)])
def test_every_bit_comes_back(shape):
    n = int(np.prod(shape))
    x = _specials() if shape == (3, 4) else _answers(shape[0], shape[1], n).reshape(shape)
    msg = encode_planes(x)
    assert msg.dtype == pb.F32_PLANES and list(msg.shape) == list(shape)
    back = decode_array(pb.Tensor.FromString(msg.SerializeToString()), "answer")
    assert back.dtype == np.float32 and back.shape == shape
    assert np.array_equal(back.view(np.uint32), x.view(np.uint32))  # NaN payloads, -0.0 and denormals too


def test_an_experts_answers_shrink_by_more_than_a_tenth():
    x = _answers(600, 2048, 1)
    packed = pack_planes(x)
    assert len(packed) < 0.9 * x.nbytes, len(packed) / x.nbytes
    assert len(packed) > 0.75 * x.nbytes  # (the mantissa planes go as they are)


def test_compute_requests_ask_for_planes_by_name():
    rows = np.zeros((2, 8), np.float32)
    assert compute_request(0, [1], [2], rows, out_dtype=PLANES).out_dtype == pb.F32_PLANES
    assert compute_request(0, [1], [2], rows).out_dtype == pb.DTYPE_UNSPECIFIED
    assert compute_request(0, [1], [2], rows, out_dtype=np.dtype(np.float16)).out_dtype == pb.F16


def _bad(data: bytes, shape: list[int]) -> str:
    with pytest.raises(CodecError) as e:
        decode_array(pb.Tensor(dtype=pb.F32_PLANES, shape=shape, data=data), "reply rows")
    assert "reply rows" in str(e.value) and "F32_PLANES" in str(e.value)
    return str(e.value)


def test_bytes_that_do_not_hold_the_values_are_refused():
    x = _answers(4, 64, 2)
    good = pack_planes(x)
    low = 3 * x.size
    assert "cannot hold" in _bad(good[: low - 1], [4, 64])
    assert "not a zlib stream" in _bad(good[:low] + b"\x00garbage", [4, 64])
    assert "unfinished" in _bad(good[:-3], [4, 64])
    assert "bytes after it" in _bad(good + b"\x01", [4, 64])
    short = pack_planes(x[:2])[3 * 128 :]  # the top plane of half the values
    assert "holds 128 bytes, not the 256" in _bad(bytes(low) + short, [4, 64])
    # a small stream that would inflate to 64 MiB stops one byte past the values it should hold
    bomb = zlib.compress(bytes(1 << 26), 9)
    assert "257+ bytes" in _bad(bytes(3 * 256) + bomb, [4, 64])
    with pytest.raises(PlanesError):
        unpack_planes(b"", 1)
