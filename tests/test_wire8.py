"""`--wire q8`: rows sent as the 8-bit blocks their kernels quantize them to give the float32 rows' answers
bit for bit, at about a quarter of the bytes.

The blocks' float preimage (swarm.proto.q8) must quantize back to the very blocks through every ggml path a
node takes: the repacked Q4_K kernels (which take only float32 rows), mul_mat_id over a GGUF's stacked
experts, per-expert graphs, tinyBLAS on Q8_0. Then three real nodes on loopback give the same logits as the
f32 wire and as in process, with the rows' bytes measured; float weights and the exact numerics fall back to
float32 rows. Answers come back packed in byte planes (swarm.proto.planes), every bit kept. A node of an older
swarm version (which would refuse these calls) is passed over with a warning.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from conftest import FIXTURES

from swarm.compute.rowquant import quantize_rows, row_type, wire_rows
from swarm.compute.slabs import load_slabs
from swarm.compute.store import ExpertStore
from swarm.coordinator.cli.spawn import start_nodes
from swarm.coordinator.config import EngineConfig, Wire
from swarm.coordinator.decode.one import forward_one
from swarm.coordinator.engine import open_engine
from swarm.coordinator.experts.remote.calls import Part, WireRows
from swarm.coordinator.experts.remote.discovery import connect
from swarm.coordinator.experts.remote.wire import expert_row_types
from swarm.node.auth import KEY_ENV, SwarmKey, generate_key_text
from swarm.node.client import NodeCallError, NodeClient
from swarm.node.discovery import browse
from swarm.proto import expert_pb2 as pb
from swarm.proto.codec import CodecError, decode_rows, encode_tensor
from swarm.proto.numerics import Numerics
from swarm.proto.planes import PLANES
from swarm.proto.q8 import Q8_0, Q8_K, WIRE_BLOCK, Q8Rows, float_rows, to_wire
from swarm.sharding.errors import UserError
from swarm.sharding.shard import shard_model
from swarm.sharding.slabs import read_manifest, slabs_from_shard

QUANT = FIXTURES / "qwen35moe-quant"
LOOPBACK = ["127.0.0.1"]
KEY_TEXT = generate_key_text()
KEY = SwarmKey.from_text(KEY_TEXT)


def _rows(n: int, d: int, seed: int) -> np.ndarray:
    """Activation-like rows: mostly small values, a few large ones, some rows far larger or smaller."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32)
    x *= (rng.standard_normal((1, d)) ** 3).astype(np.float32)
    x *= np.float32(10.0) ** rng.integers(-4, 4, (n, 1)).astype(np.float32)
    x[0] = 0.0  # a zero block: scale 0
    return x


@pytest.mark.parametrize("qtype", [Q8_0, Q8_K])
def test_the_blocks_preimage_quantizes_back_to_the_blocks(qtype):
    x = _rows(300, 2048, 1)
    rows = wire_rows(x, qtype)
    assert rows is not None
    assert rows.data.shape == (300, 2048 // (32 if qtype == Q8_0 else 256) * WIRE_BLOCK[qtype].itemsize)
    back = float_rows(rows)
    assert back.dtype == np.float32 and back.shape == x.shape
    assert np.array_equal(to_wire(quantize_rows(back, qtype), qtype), rows.data)
    assert np.abs(back - x).max() <= np.abs(x).max() / 100  # and it is close to the rows themselves


def test_q8_k_needs_the_largest_value_found_again():
    """-127 * d is not always a value ggml computes d back from: the plain dequantized rows (q * d) miss some
    blocks, which is why the preimage searches for the largest value."""
    x = _rows(300, 2048, 2)
    blocks = to_wire(quantize_rows(x, Q8_K), Q8_K)
    b = blocks.reshape(-1).view(WIRE_BLOCK[Q8_K])
    plain = (b["qs"].astype(np.float32) * b["d"][:, None]).reshape(x.shape)
    again = to_wire(quantize_rows(plain, Q8_K), Q8_K)
    assert (again != blocks).any(axis=1).sum() > 0


def test_row_types_follow_ggml_pairings():
    assert row_type([12, 12]) == Q8_K  # Q4_K
    assert row_type([12, 14]) == Q8_K  # Q4_K with Q6_K
    assert row_type([8]) == Q8_0 and row_type([2]) == Q8_0  # Q8_0, Q4_0
    assert row_type([0]) is None and row_type([1]) is None  # F32, F16: float rows
    assert row_type([3]) is None  # Q4_1 pairs with Q8_1: not sent
    assert row_type([2, 12]) is None  # gate and up of different pairings


def test_codec_carries_q8_rows_and_checks_their_bytes():
    x = _rows(5, 512, 3)
    for qtype, code in ((Q8_0, pb.Q8_0), (Q8_K, pb.Q8_K)):
        rows = wire_rows(x, qtype)
        msg = encode_tensor(rows)
        assert msg.dtype == code and list(msg.shape) == [5, 512]
        assert np.array_equal(decode_rows(msg), float_rows(rows))
        short = pb.Tensor(dtype=code, shape=[5, 512], data=msg.data[:-1])
        with pytest.raises(CodecError, match="bytes a row"):
            decode_rows(short)
        with pytest.raises(CodecError, match="multiple of"):
            decode_rows(pb.Tensor(dtype=code, shape=[5, 500], data=msg.data))
    f32 = encode_tensor(x)
    assert np.array_equal(decode_rows(f32), x)
    # bytes per row of a 2048-wide model, f32 against each block type
    per_row = {q: wire_rows(_rows(4, 2048, 4), q).data.shape[1] for q in (Q8_0, Q8_K)}
    assert per_row == {Q8_0: 2176, Q8_K: 2080}
    assert 4 * 2048 / per_row[Q8_0] > 3.7 and 4 * 2048 / per_row[Q8_K] > 3.9


def test_garbage_blocks_decode_to_float_rows_without_a_fuss():
    """Blocks no quantizer made (NaN or infinite scales, any int8) still decode: a bad call is the caller's
    rows, never the node's failure."""
    rng = np.random.default_rng(7)
    for code, size in ((pb.Q8_0, 2 * 34), (pb.Q8_K, 260)):
        raw = rng.integers(0, 256, 3 * size, dtype=np.uint8)
        raw[1] = raw[size + 1] = 0x7F  # an f16 scale's high byte inf/NaN (Q8_0); an f32 one's low byte
        raw[3] = 0xFF  # ... and the first f32 scale NaN (Q8_K)
        data = raw.tobytes()
        with np.errstate(all="raise"):
            x = decode_rows(pb.Tensor(dtype=code, shape=[3, 64 if code == pb.Q8_0 else 256], data=data))
        assert x.dtype == np.float32 and x.shape[0] == 3


def test_a_calls_rows_and_blocks_are_cut_alike():
    """A call of parts that do not lie back to back (a failover's, a hedge's) carries their blocks in the
    order of its values; its size is counted in the blocks' bytes."""
    x = _rows(12, 512, 6)
    q = wire_rows(x, Q8_K)
    rows = WireRows(torch.from_numpy(x), torch.from_numpy(q.data), Q8_K)
    assert rows.row_bytes == 2 * 260 and WireRows(torch.from_numpy(x)).row_bytes == 4 * 512
    parts = [Part(0, 0, 2), Part(2, 1, 3)]
    values, carried = rows.take([1, 7], parts)
    assert torch.equal(values, torch.from_numpy(x[[1, 2, 7, 8, 9]]))
    assert isinstance(carried, Q8Rows) and carried.shape == (5, 512)
    assert np.array_equal(float_rows(carried), float_rows(q)[[1, 2, 7, 8, 9]])
    values, carried = rows.take([3], [Part(1, 0, 4)])
    assert carried.data.data_ptr() == rows.blocks[3].data_ptr(), "back to back: a view, not a copy"


@pytest.mark.parametrize("name", ["model-q4_k_m.gguf", "model-q8_0.gguf"])
@pytest.mark.parametrize("stacked", [True, False])
def test_expert_answers_keep_their_bits_through_every_kernel_path(name, stacked):
    """Q4_K gate/up (repacked here on AVX2: float32 rows only), Q8_0 (tinyBLAS), stacked (mul_mat_id) or
    per expert: the preimage rows give the float32 rows' outputs bit for bit."""
    slabs = load_slabs(QUANT / name, verify=False).slabs
    store = ExpertStore(slabs, stacked=stacked)
    store.prepare()
    types = expert_row_types(QUANT / name)
    d = store.hidden_size
    for layer in store.layers():
        qtype = types[layer]
        assert qtype == (Q8_K if "q4_k" in name else Q8_0)
        x = _rows(37, d, layer)
        x[0] = np.random.default_rng(9).standard_normal(d).astype(np.float32)
        rows = wire_rows(x, qtype)
        ids, counts = [0, 1, 2, 3], [10, 1, 20, 6]
        a = store.compute(layer, ids, counts, x)
        b = store.compute(layer, ids, counts, float_rows(rows))
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"layer {layer}"


@pytest.fixture(scope="module")
def swarms(tmp_path_factory):
    """The Q4_K/Q6_K model and a float32 one, each on 3 nodes holding disjoint expert ranges."""
    work = tmp_path_factory.mktemp("wire8")
    dirs, specs = {}, []
    for name, file in (
        ("quant", QUANT / "model-q4_k_m.gguf"),
        ("f32", FIXTURES / "qwen3moe-tiny" / "model-f32.gguf"),
    ):
        d = work / f"{name}.swarm"
        shard_model(file, d)
        dirs[name] = d
        n = read_manifest(d).n_expert
        cuts = [0, n // 3, 2 * n // 3, n]
        specs += [(d, ["--experts", f"{cuts[i]}-{cuts[i + 1] - 1}"]) for i in range(3)]
    nodes = start_nodes(specs, work / "nodes", env={KEY_ENV: KEY_TEXT})
    yield {"quant": (dirs["quant"], nodes[:3]), "f32": (dirs["f32"], nodes[3:])}
    for node in nodes:
        node.stop()


def _prompts(model: str) -> list[list[int]]:
    ref = np.load(FIXTURES / model / "reference.npz")
    return [ref[f"tokens_{i}"].tolist() for i in range(4)]


def _logits(engine, prompts: list[list[int]]) -> list[torch.Tensor]:
    out = [forward_one(engine.model, p, engine.model.new_state(), "cpu") for p in prompts]
    state = engine.model.new_state()  # and a few decode steps through the KV cache
    forward_one(engine.model, prompts[0], state, "cpu")
    out += [forward_one(engine.model, [t], state, "cpu") for t in (5, 9, 11)]
    return out


def _row_bytes(engine) -> tuple[int, int]:
    e = engine.experts
    return sum(e.row_bytes_per_node.values()), sum(e.rows_per_node.values())


def _answer_bytes(engine) -> int:
    return sum(engine.experts.answer_bytes_per_node.values())


@pytest.mark.slow
def test_q8_wire_gives_the_f32_wires_logits_bit_for_bit(swarms):
    shard_dir, nodes = swarms["quant"]
    prompts = _prompts("qwen35moe-quant")
    kw = {"mdns_interfaces": LOOPBACK, "wait": 10.0, "device": "cpu", "key": KEY}
    q8 = open_engine(shard_dir, EngineConfig(wire=Wire.Q8, **kw))
    f32 = open_engine(shard_dir, EngineConfig(wire=Wire.F32, **kw))
    local = open_engine(shard_dir, EngineConfig(local=True, wire=Wire.Q8, device="cpu"))
    try:
        assert {n.address for n in nodes} <= set(q8.experts.clients)
        a, b, c = _logits(q8, prompts), _logits(f32, prompts), _logits(local, prompts)
        for i, (x, y, z) in enumerate(zip(a, b, c, strict=True)):
            assert torch.equal(x, y), f"{i}: q8 wire vs f32 wire, max |diff| {float((x - y).abs().max()):.3g}"
            assert torch.equal(x, z), f"{i}: q8 wire vs in process"
        (q8_bytes, q8_rows), (f32_bytes, f32_rows) = _row_bytes(q8), _row_bytes(f32)
        assert q8_rows == f32_rows > 0
        d = read_manifest(shard_dir).n_embd
        assert f32_bytes == 4 * d * f32_rows
        assert q8_bytes == d // 256 * 260 * q8_rows, "every row went as Q8_K blocks"
        assert f32_bytes / q8_bytes > 3.9
        assert q8.experts._q8.fallbacks == 0
        # the float32 answers came back packed in byte planes: the same bits, fewer bytes
        assert _answer_bytes(f32) == 4 * d * f32_rows
        assert 0.75 < _answer_bytes(q8) / _answer_bytes(f32) < 0.9, _answer_bytes(q8) / _answer_bytes(f32)
    finally:
        for e in (q8, f32, local):
            e.close()


@pytest.mark.slow
def test_float_weights_and_exact_numerics_fall_back_to_f32_rows(swarms):
    kw = {"mdns_interfaces": LOOPBACK, "wait": 10.0, "device": "cpu", "key": KEY}
    cases = [
        ("f32", "native", _prompts("qwen3moe-tiny")),
        ("quant", "exact", _prompts("qwen35moe-quant")[:1]),
    ]
    for name, numerics, prompts in cases:
        shard_dir, _ = swarms[name]
        q8 = open_engine(shard_dir, EngineConfig(wire=Wire.Q8, numerics=numerics, **kw))
        f32 = open_engine(shard_dir, EngineConfig(wire=Wire.F32, numerics=numerics, **kw))
        try:
            for x, y in zip(_logits(q8, prompts), _logits(f32, prompts), strict=True):
                assert torch.equal(x, y)
            assert _row_bytes(q8) == _row_bytes(f32), f"{name} {numerics}: float32 rows"
            assert _answer_bytes(q8) < 0.9 * _answer_bytes(f32), f"{name} {numerics}: answers packed"
        finally:
            q8.close()
            f32.close()


@pytest.mark.slow
def test_a_node_refuses_q8_rows_in_exact_numerics(swarms):
    shard_dir, nodes = swarms["quant"]
    manifest = read_manifest(shard_dir)
    d, layer = manifest.n_embd, manifest.moe_layers[0]
    rows = wire_rows(_rows(3, d, 5), Q8_K)
    client = NodeClient(nodes[0].address, key=KEY)  # it holds expert 0
    try:
        out = client.compute(layer, [0], [3], Q8Rows(Q8_K, torch.from_numpy(rows.data), d), 30.0)
        assert out.shape == (3, d) and out.dtype == torch.float32
        with pytest.raises(NodeCallError) as e:
            client.compute(layer, [0], [3], rows, 30.0, numerics=Numerics.EXACT)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "native" in str(e.value)
    finally:
        client.close()


@pytest.mark.slow
def test_a_node_packs_answers_as_asked_whatever_the_rows(swarms):
    """Answers asked for as planes are the node's float32 answers bit for bit, for float32, float16 and 8-bit
    rows alike, in both numerics (float16 rows: float32 answers, not float16 ones)."""
    shard_dir, nodes = swarms["quant"]
    manifest = read_manifest(shard_dir)
    d, layer = manifest.n_embd, manifest.moe_layers[0]
    x = _rows(5, d, 9)
    client = NodeClient(nodes[0].address, key=KEY)  # it holds experts 0 and 1
    try:
        for rows, numerics in [
            (torch.from_numpy(x), Numerics.NATIVE),
            (torch.from_numpy(x), Numerics.EXACT),
            (torch.from_numpy(x).half(), Numerics.NATIVE),
            (Q8Rows(Q8_K, torch.from_numpy(wire_rows(x, Q8_K).data), d), Numerics.NATIVE),
        ]:
            plain = client.compute(layer, [0, 1], [2, 3], rows, 30.0, np.dtype(np.float32), numerics)
            packed = client.compute(layer, [0, 1], [2, 3], rows, 30.0, PLANES, numerics)
            assert packed.dtype == plain.dtype == torch.float32 and packed.shape == (5, d)
            assert torch.equal(packed.view(torch.int32), plain.view(torch.int32)), numerics
    finally:
        client.close()


@pytest.mark.slow
def test_q8_rows_fail_over_to_a_replica_as_they_are(swarms, tmp_path):
    """A node killed mid-prompt: its parts go to a replica as several small calls of 8-bit rows (parts not
    back to back among them), and the logits stay the in-process ones."""
    shard_dir, nodes = swarms["quant"]
    prompt = _prompts("qwen35moe-quant")[1]
    manifest = read_manifest(shard_dir)
    (replica,) = start_nodes([(shard_dir, ["--no-mdns"])], tmp_path, env={KEY_ENV: KEY_TEXT})
    backend = connect(sorted(slabs_from_shard(shard_dir)[0]), manifest.fingerprint, str(shard_dir), EngineConfig(peers=[n.address for n in nodes] + [replica.address], mdns=False, timeout=10.0, key=KEY,
                                   wire=Wire.Q8, call_bytes=3 * manifest.n_embd))  # 3 rows of 8-bit blocks a call  # fmt: skip
    victim = nodes[2]
    try:
        engine = open_engine(shard_dir, EngineConfig(local=True, device="cpu"))
        model = engine.model
        expect = forward_one(model, prompt, model.new_state(), "cpu")
        model.set_experts(backend)
        victim.process.kill()
        victim.process.wait()
        assert torch.equal(forward_one(model, prompt, model.new_state(), "cpu"), expect)
        assert backend.failovers >= 1
        rows = sum(backend.rows_per_node.values())
        assert sum(backend.row_bytes_per_node.values()) == rows * manifest.n_embd // 256 * 260
    finally:
        backend.close()
        replica.stop()


@pytest.mark.slow
def test_a_node_of_another_swarm_version_is_passed_over(swarms, tmp_path, caplog):
    """A device left on an older release refuses every call of this one: the coordinator leaves it out, by
    --peer and by mDNS, and says why when it was the only node."""
    shard_dir, _ = swarms["quant"]
    program = [str(Path(__file__).resolve().parent / "old_node.py"), "3"]
    env = {KEY_ENV: KEY_TEXT}
    (old,) = start_nodes([(shard_dir, [])], tmp_path, env=env, prefix="old", program=program)
    nodes = start_nodes([(shard_dir, [])], tmp_path, env=env)  # (the fixture's: one of them is killed above)
    nodes.append(old)  # (stopped with them)
    try:
        client = NodeClient(old.address, key=KEY)
        assert client.info().protocol_version == 3
        client.close()
        peers = open_engine(shard_dir, EngineConfig(peers=tuple(n.address for n in nodes), mdns=False, device="cpu", key=KEY))
        peers.close()
        assert set(peers.experts.clients) == {nodes[0].address}
        assert f"passing over node {old.address}: it speaks swarm protocol 3" in caplog.text
        with browse(interfaces=LOOPBACK, key=KEY) as browser:  # its record says so
            seen = browser.wait_for(lambda ns: any(n.address == old.address for n in ns), 10.0)
            assert seen and {n.address: n.protocol_version for n in seen}[old.address] == 3
        found = open_engine(shard_dir, EngineConfig(mdns_interfaces=LOOPBACK, wait=10.0, device="cpu", key=KEY))
        found.close()
        assert old.address not in found.experts.clients and nodes[0].address in found.experts.clients
        with pytest.raises(UserError, match=rf"passed over {old.address}: another swarm version"):
            open_engine(shard_dir, EngineConfig(peers=(old.address,), mdns=False, device="cpu", key=KEY))
    finally:
        for node in nodes:
            node.stop()
