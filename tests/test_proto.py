"""The wire: generated code is reproducible, tensors and slab sets survive the codec exactly."""

from __future__ import annotations

import random
import re
import tomllib
from pathlib import Path

import pytest
import torch

from swarm.proto import expert_pb2 as pb
from swarm.proto.channel import CHANNEL_OPTIONS, MAX_MESSAGE_BYTES
from swarm.proto.codec import (
    CodecError,
    compute_request,
    decode_array,
    decode_tensor,
    encode_tensor,
    group_slabs,
    held_from_proto,
    held_to_proto,
    ungroup_slabs,
)
from swarm.proto.regen import PROTO_DIR, generate, generated_names

ROOT = Path(__file__).resolve().parents[1]


def test_regenerating_changes_nothing(tmp_path):
    written = generate(tmp_path)
    assert sorted(p.name for p in written) == sorted(generated_names())
    for p in written:
        committed = (PROTO_DIR / p.name).read_bytes()
        assert p.read_bytes() == committed, (
            f"{p.name} differs from a fresh protoc run; run python -m swarm.proto.regen"
        )


def _floor(requirement: str) -> tuple[int, ...]:
    spec = next(
        r
        for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        if re.match(rf"{requirement}\b(?!-)", r)
    )
    return tuple(int(x) for x in re.search(r">=([0-9.]+)", spec).group(1).split("."))


def test_the_install_floors_are_what_the_generated_code_checks():
    """The generated modules refuse an older grpcio or protobuf at import: pyproject must not promise less."""
    grpc_text = (PROTO_DIR / "expert_pb2_grpc.py").read_text()
    grpc_needs = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", grpc_text).group(1)
    pb_text = (PROTO_DIR / "expert_pb2.py").read_text()
    pb_needs = re.search(r"Protobuf Python Version: ([0-9.]+)", pb_text).group(1)
    assert _floor("grpcio") == tuple(int(x) for x in grpc_needs.split("."))
    assert _floor("protobuf") == tuple(int(x) for x in pb_needs.split("."))
    pinned = re.search(r"^grpcio-tools==([0-9.]+)$", (ROOT / "constraints.txt").read_text(), re.M)
    assert pinned and pinned.group(1) == grpc_needs, "constraints.txt pins the grpcio-tools that made proto/"


def test_generated_grpc_module_imports_the_package_path():
    text = (PROTO_DIR / "expert_pb2_grpc.py").read_text()
    assert "from swarm.proto import expert_pb2" in text


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tensor_roundtrip_is_bit_exact(dtype):
    t = (torch.randn(7, 33) * 100).to(dtype)
    t[0, 0] = float("inf")
    t[0, 1] = -0.0
    msg = pb.Tensor.FromString(encode_tensor(t).SerializeToString())
    back = decode_tensor(msg)
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(
        back.view(torch.uint8) if dtype == torch.float32 else back.view(torch.int16),
        t.view(torch.uint8) if dtype == torch.float32 else t.view(torch.int16),
    )


def test_encoding_is_little_endian_row_major():
    t = torch.tensor([[1.0, 2.0], [3.0, -4.0]], dtype=torch.float32)
    import struct

    assert encode_tensor(t).data == struct.pack("<4f", 1.0, 2.0, 3.0, -4.0)
    assert list(encode_tensor(t).shape) == [2, 2]
    assert encode_tensor(t.t()).data == struct.pack("<4f", 1.0, 3.0, 2.0, -4.0)  # non-contiguous input


def test_decode_rejects_wrong_byte_count_and_dtype():
    msg = encode_tensor(torch.zeros(2, 3))
    msg.data = msg.data[:-1]
    with pytest.raises(CodecError, match="carries 23 bytes"):
        decode_tensor(msg)
    with pytest.raises(CodecError, match="not supported"):
        decode_tensor(pb.Tensor(dtype=pb.DTYPE_UNSPECIFIED, shape=[1], data=b"\0\0\0\0"))
    with pytest.raises(CodecError, match="cannot cross the wire"):
        encode_tensor(torch.zeros(2, dtype=torch.float64))


def test_empty_tensor():
    back = decode_tensor(encode_tensor(torch.zeros(0, 5, dtype=torch.float16)))
    assert back.shape == (0, 5) and back.dtype == torch.float16


def test_compute_request_fields():
    req = compute_request(3, [5, 9], [1, 2], torch.ones(3, 4), fingerprint="abc", out_dtype=torch.bfloat16)
    assert (req.layer, list(req.expert_ids), list(req.counts), req.fingerprint) == (3, [5, 9], [1, 2], "abc")
    assert req.out_dtype == pb.BF16 and list(req.rows.shape) == [3, 4]


def test_held_slabs_group_compactly_and_roundtrip():
    keys = {(layer, e) for layer in range(40) for e in range(64)}
    groups = group_slabs(keys)
    assert groups == [([(0, 39)], [(0, 63)])]
    rng = random.Random(0)
    messy = {(rng.randrange(48), rng.randrange(256)) for _ in range(2000)}
    assert ungroup_slabs(group_slabs(messy)) == messy
    wire = [pb.SlabGroup.FromString(g.SerializeToString()) for g in held_to_proto(messy)]
    assert held_from_proto(wire) == messy
    assert held_from_proto(held_to_proto(set())) == set()


def test_channel_options_carry_the_size_limit_both_ways():
    opts = dict(CHANNEL_OPTIONS)
    assert opts["grpc.max_send_message_length"] == MAX_MESSAGE_BYTES
    assert opts["grpc.max_receive_message_length"] == MAX_MESSAGE_BYTES


@pytest.mark.parametrize(
    "shape",
    [[1] * 100, [0, 2**40, 2**40], [0, 2**31 - 1, 2**31 - 1, 2**31 - 1, 2**31 - 1, 2**31 - 1]],
)
def test_a_shape_no_array_can_have_is_a_codec_error(shape):
    """Refused as a bad message (INVALID_ARGUMENT on a node), never numpy's own error (INTERNAL)."""
    with pytest.raises(CodecError, match="shape"):
        decode_array(pb.Tensor(dtype=pb.F32, shape=shape, data=b""))
