"""`swarm node` as real processes on 127.0.0.1: every expert quant type against gguf's own dequantizer.

Five node processes start once for the module (in parallel):
- `mixed`: a GGUF built here whose layer i holds the experts of a `swarm synth` model of quant type
  SINGLE_TYPES[i] (all 11 types in one node), under a 1 MiB --memory budget (one expert resident).
- the reference fixtures: qwen35moe-tiny F32 (with a swarm key) and BF16, qwen35moe-quant Q4_K_M (real
  llama.cpp Q4_K/Q6_K blocks, held slab by slab), and Q8_0 served from a `swarm shard` directory with
  one slab corrupted on purpose.
The reference for every output is the expert computed in float64 from gguf.quants.dequantize of the
original model's stacked tensor.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import resource
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from conftest import FIXTURES
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize

from swarm.coordinator.cli import main
from swarm.coordinator.cli.spawn import start_nodes, stop_nodes
from swarm.node.auth import SwarmKey, generate_key_text
from swarm.node.client import NodeCallError, NodeClient
from swarm.proto import expert_pb2 as pb
from swarm.proto import expert_pb2_grpc as pb_grpc
from swarm.proto.channel import MAX_MESSAGE_BYTES, PROTOCOL_VERSION
from swarm.proto.codec import compute_request
from swarm.sharding.manifest import read_manifest
from swarm.sharding.shard import shard_model
from swarm.sharding.synth import synthesize
from swarm.sharding.synth_mix import MIXES
from swarm.sharding.synth_spec import EXPERT_TYPES, preset

# one ggml type a layer (a mixture such as Q4_K_M is several)
SINGLE_TYPES = tuple(q for q in EXPERT_TYPES if q not in MIXES)

pytestmark = pytest.mark.slow  # one module-wide start of five node processes (~10 s on 2 cores)

KEY_TEXT = generate_key_text()
KEY = SwarmKey.from_text(KEY_TEXT)
F32_GGUF = FIXTURES / "qwen35moe-tiny" / "model-f32.gguf"
BF16_GGUF = FIXTURES / "qwen35moe-tiny" / "model-bf16.gguf"
Q4KM_GGUF = FIXTURES / "qwen35moe-quant" / "model-q4_k_m.gguf"
Q80_GGUF = FIXTURES / "qwen35moe-quant" / "model-q8_0.gguf"
MIXED_BUDGET = 1 << 20
CORRUPT_SLAB = (1, 2)
Q = GGMLQuantizationType


def build_mixed_gguf(tmp: Path) -> Path:
    """One GGUF whose layer i has the stacked experts (bytes as synth wrote them) of quant type SINGLE_TYPES[i]."""
    out = tmp / "mixed.gguf"
    w = GGUFWriter(out, "qwen3moe")
    for layer, qtype in enumerate(SINGLE_TYPES):
        src = tmp / f"synth-{qtype}.gguf"
        synthesize(
            src, preset("qwen3moe-tiny", n_layers=1, n_expert=4, experts_type=qtype, n_vocab=300, seed=layer)
        )
        for t in GGUFReader(src).tensors:
            if "_exps" not in t.name:
                continue
            name = t.name.replace("blk.0.", f"blk.{layer}.")
            typed = t.tensor_type in (Q.F32, Q.F16)  # the reader gives these as typed arrays, others as bytes
            w.add_tensor(name, np.array(t.data), raw_dtype=None if typed else t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("models")
    shard = tmp / "q8_0.swarm"
    shard_model(Q80_GGUF, shard)
    entry = read_manifest(shard).slab(*CORRUPT_SLAB)
    with open(shard / entry.path, "r+b") as f:  # flip one byte of the tensor data
        f.seek(entry.data_offset + 10)
        b = f.read(1)
        f.seek(entry.data_offset + 10)
        f.write(bytes([b[0] ^ 0xFF]))
    return {"mixed": build_mixed_gguf(tmp), "q8_0_shard": shard}


@pytest.fixture(scope="module")
def nodes(models, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("key") / "swarm.key"
    key_file.write_text(KEY_TEXT)
    specs = {
        "mixed": (models["mixed"], ["--no-mdns", "--memory", str(MIXED_BUDGET)]),
        "f32": (F32_GGUF, ["--no-mdns", "--key-file", str(key_file)]),
        "bf16": (BF16_GGUF, ["--no-mdns", "--experts", "0-7", "--layers", "0-3"]),
        "q4km": (
            Q4KM_GGUF,
            ["--no-mdns", "--slab", "0:0-3", "--slab", "3:5", "--workers", "4", "--metrics-port", "0"],
        ),
        "q8_0": (models["q8_0_shard"], ["--no-mdns", "--experts", "0-3", "--layers", "0-1"]),
    }
    started = start_nodes(list(specs.values()), tmp_path_factory.mktemp("nodes"), timeout=180)
    procs = dict(zip(specs, started, strict=True))
    yield procs
    codes = stop_nodes(list(procs.values()))
    assert codes == [0] * len(codes), [p.log_tail() for p in procs.values()]


@pytest.fixture(scope="module")
def clients(nodes):
    out = {
        name: NodeClient(n.address, fingerprint=n.fingerprint, key=KEY if name == "f32" else None)
        for name, n in nodes.items()
    }
    yield out
    for c in out.values():
        c.close()


@cache
def _stacked(path: Path, layer: int) -> dict[str, np.ndarray]:
    reader = GGUFReader(path)
    out = {}
    for kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        t = next(t for t in reader.tensors if t.name == f"blk.{layer}.{kind}.weight")
        out[kind] = np.asarray(gguf_dequantize(t.data, t.tensor_type), dtype=np.float64)  # [E, rows, cols]
    return out


def reference(path: Path, layer: int, expert: int, x: np.ndarray) -> np.ndarray:
    """down(silu(gate x) * up x) in float64 from gguf's dequantization of the whole stacked tensors."""
    w = _stacked(path, layer)
    x = np.asarray(x, dtype=np.float64)
    a = x @ w["ffn_gate_exps"][expert].T
    b = x @ w["ffn_up_exps"][expert].T
    return ((a / (1.0 + np.exp(-a))) * b) @ w["ffn_down_exps"][expert].T


def rel_err(out: torch.Tensor, ref: np.ndarray) -> float:
    return float(np.abs(out.double().numpy() - ref).max() / np.abs(ref).max())


def check_call(
    client, path, layer, experts, counts, d, seed=0, dtype=torch.float32, tol=1e-5, numerics="exact"
):
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal((sum(counts), d)).astype(np.float32)).to(dtype)
    out = client.compute(layer, experts, counts, x, timeout=30, numerics=numerics)
    assert out.dtype == dtype and out.shape == x.shape
    start = 0
    for e, n in zip(experts, counts, strict=True):
        ref = reference(path, layer, e, x[start : start + n].double().numpy())
        err = rel_err(out[start : start + n], ref)
        assert err <= tol, f"layer {layer} expert {e}: relative error {err:.3g} > {tol}"
        start += n
    return x, out


# (node, reference GGUF, layer, experts, D): every quant type of the issue, each against its original GGUF.
CASES = [
    *[
        pytest.param("mixed", None, layer, [0, 1, 2, 3], 256, id=f"synth-{q}")
        for layer, q in enumerate(SINGLE_TYPES)
    ],
    pytest.param("f32", F32_GGUF, 2, [0, 5, 31], 64, id="fixture-F32"),
    pytest.param("bf16", BF16_GGUF, 1, [7, 3, 4], 64, id="fixture-BF16"),
    pytest.param("q4km", Q4KM_GGUF, 0, [0, 1, 2, 3], 256, id="fixture-Q4_K_M"),
    pytest.param("q8_0", Q80_GGUF, 1, [0, 1, 3], 256, id="fixture-Q8_0-from-shard"),
]


@pytest.mark.parametrize(("node", "path", "layer", "experts", "d"), CASES)
def test_outputs_match_gguf_dequantization_in_float64(clients, models, node, path, layer, experts, d):
    """Exact numerics: float32 rounding of the float64 result. Native: the activations are rounded to the
    8-bit (or bf16/f16) blocks the kernels pair with, a percent or so off; float32 weights stay exact."""
    path = path or models["mixed"]
    counts = [3, 1, 2, 5][: len(experts)]
    check_call(clients[node], path, layer, experts, counts, d, seed=layer)
    f32 = node == "f32" or (node == "mixed" and SINGLE_TYPES[layer] == "F32")
    check_call(clients[node], path, layer, experts, counts, d, seed=layer, numerics="native",
               tol=1e-5 if f32 else 6e-2)  # fmt: skip


def test_mixed_gguf_has_every_quant_type(models):
    types = {t.name: t.tensor_type.name for t in GGUFReader(models["mixed"]).tensors}
    for layer, q in enumerate(SINGLE_TYPES):
        assert types[f"blk.{layer}.ffn_gate_exps.weight"] == q


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float16, 1e-3), (torch.bfloat16, 8e-3)])
def test_half_precision_wire(clients, models, dtype, tol):
    # Rows and outputs rounded to the wire dtype: error of one output rounding against the exact result.
    check_call(
        clients["mixed"],
        models["mixed"],
        SINGLE_TYPES.index("Q4_K"),
        [1, 2],
        [4, 3],
        256,
        dtype=dtype,
        tol=tol,
    )


def test_batching_several_experts_equals_one_by_one(clients):
    c = clients["q4km"]
    counts = [2, 3, 1, 4]
    x = torch.randn(sum(counts), 256)
    together = c.compute(0, [0, 1, 2, 3], counts, x)
    start = 0
    for e, n in zip([0, 1, 2, 3], counts, strict=True):
        alone = c.compute(0, [e], [n], x[start : start + n])
        assert torch.equal(alone, together[start : start + n]), f"expert {e}"
        start += n


def test_memory_budget_smaller_than_held_set_evicts_and_stays_correct(clients, models):
    c = clients["mixed"]
    layer = SINGLE_TYPES.index("IQ2_XS")
    before = c.stats()
    _, first = check_call(c, models["mixed"], layer, [0, 1, 2, 3], [1, 2, 1, 2], 256, seed=7)
    _, second = check_call(c, models["mixed"], layer, [0, 1, 2, 3], [1, 2, 1, 2], 256, seed=7)
    assert torch.equal(first, second)
    after = c.stats()
    # The budget holds one expert: a call over four is made in groups of one, the expert still held first,
    # so of the 8 expert computations above only the second call's first found its copy (7 dequantized).
    assert after.cache_misses - before.cache_misses >= 7
    assert after.cache_evictions - before.cache_evictions >= 6
    assert after.cache_bytes <= MIXED_BUDGET
    assert c.info().memory_budget_bytes == MIXED_BUDGET


def test_concurrent_calls_are_all_correct(clients, models):
    c = clients["mixed"]
    rng = np.random.default_rng(3)
    calls = []
    for i in range(12):
        layer = i % len(SINGLE_TYPES)
        x = torch.from_numpy(rng.standard_normal((5, 256)).astype(np.float32))
        call = c.compute_async(layer, [i % 4, (i + 1) % 4], [2, 3], x, timeout=60, numerics="exact")
        calls.append((layer, x, call))
    for i, (layer, x, call) in enumerate(calls):
        out = call.result()
        for e, rows in ((i % 4, slice(0, 2)), ((i + 1) % 4, slice(2, 5))):
            assert rel_err(out[rows], reference(models["mixed"], layer, e, x[rows].double().numpy())) <= 1e-5


def test_concurrent_native_calls_of_one_shape_each_get_their_own_bits(clients):
    """Calls of the same layer, experts and row count share one kept ggml graph: each must still get exactly
    the rows it gets alone (a node serves several coordinators and several calls at once)."""
    c = clients["q4km"]
    rng = np.random.default_rng(4)
    xs = [torch.from_numpy(rng.standard_normal((2, 256)).astype(np.float32)) for _ in range(64)]
    alone = [c.compute(0, [0, 1], [1, 1], x) for x in xs]
    for _ in range(3):
        calls = [c.compute_async(0, [0, 1], [1, 1], x, timeout=60) for x in xs]
        for i, call in enumerate(calls):
            assert torch.equal(call.result(), alone[i]), f"call {i} got another call's rows"


def test_shard_dir_drops_the_corrupted_slab_before_its_first_use_and_serves_the_rest(nodes, clients):
    """Slab files are hashed before their first use (a call's, or the start-up pass's, whichever comes
    first): no call multiplies the damaged bytes, the slab is dropped by name and no longer announced."""
    layer, expert = CORRUPT_SLAB
    with pytest.raises(NodeCallError) as e:
        clients["q8_0"].compute(layer, [expert], [1], torch.randn(1, 256))
    assert e.value.code == grpc.StatusCode.NOT_FOUND and str(expert) in e.value.details
    held = {(la, e) for la in (0, 1) for e in range(4)} - {CORRUPT_SLAB}
    deadline = time.monotonic() + 30
    while clients["q8_0"].info().held != held and time.monotonic() < deadline:
        time.sleep(0.2)
    assert clients["q8_0"].info().held == held
    log = nodes["q8_0"].log_tail(50)
    assert re.search(rf"slab {layer}:{expert} failed its check .*SHA-256 mismatch", log), log
    out = clients["q8_0"].compute(0, [0, 1], [1, 1], torch.randn(2, 256))  # the rest serve
    assert out.shape == (2, 256)


def test_info_describes_the_node(nodes, clients, models):
    info = clients["q4km"].info()
    assert info.held == {(0, e) for e in range(4)} | {(3, 5)}
    reader = GGUFReader(Q4KM_GGUF)
    header = Q4KM_GGUF.read_bytes()[: reader.data_offset]
    assert info.fingerprint == nodes["q4km"].fingerprint == hashlib.sha256(header).hexdigest()
    assert (info.hidden_size, info.protocol_version, info.device, info.workers) == (
        256,
        PROTOCOL_VERSION,
        "cpu",
        4,
    )
    assert clients["q8_0"].info().fingerprint == read_manifest(models["q8_0_shard"]).fingerprint
    assert clients["q4km"].health()


def test_stats_count_calls_rows_and_experts(clients):
    c = clients["q4km"]
    before = c.stats()
    for _ in range(2):
        c.compute(3, [5], [4], torch.randn(4, 256))
    after = c.stats()
    assert after.calls - before.calls == 2 and after.rows - before.rows == 8
    assert after.experts[(3, 5)][0] - before.experts.get((3, 5), (0, 0))[0] == 2
    assert after.experts[(3, 5)][1] - before.experts.get((3, 5), (0, 0))[1] == 8
    assert after.busy_seconds > before.busy_seconds and after.uptime_seconds > 0


def _code(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(NodeCallError) as e:
        fn()
    return e.value.code, e.value.details


def test_bad_calls_get_status_codes_and_the_node_keeps_serving(nodes, clients):
    c = clients["q4km"]
    x1 = torch.randn(1, 256)
    errors_before = c.stats().errors
    code, msg = _code(lambda: c.compute(9, [0], [1], x1))
    assert code == grpc.StatusCode.NOT_FOUND and "layer 9" in msg
    code, msg = _code(lambda: c.compute(0, [2, 6, 7], [1, 0, 0], x1))
    assert code == grpc.StatusCode.NOT_FOUND and "6-7" in msg and "layer 0" in msg
    code, msg = _code(lambda: c.compute(0, [0], [2], x1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "sum to 2" in msg
    code, _ = _code(lambda: c.compute(0, [0, 1], [1], x1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, msg = _code(lambda: c.compute(0, [0], [1], torch.randn(1, 255)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "255" in msg
    other = NodeClient(nodes["q4km"].address, fingerprint="0" * 64)
    code, msg = _code(lambda: other.compute(0, [0], [1], x1))
    other.close()
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "0" * 64 in msg

    with grpc.insecure_channel(
        nodes["q4km"].address, options=[("grpc.max_send_message_length", 2 * MAX_MESSAGE_BYTES)]
    ) as ch:
        stub = pb_grpc.ExpertNodeStub(ch)
        bad = compute_request(0, [0], [1], x1)
        bad.rows.data = bad.rows.data[:-4]
        with pytest.raises(grpc.RpcError) as e:
            stub.Compute(bad, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bytes" in e.value.details()
        bad = compute_request(0, [0], [1], x1)
        bad.rows.dtype = pb.DTYPE_UNSPECIFIED
        with pytest.raises(grpc.RpcError) as e:
            stub.Compute(bad, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        n = MAX_MESSAGE_BYTES // (256 * 2) + 1  # f16 rows just over the limit
        huge = compute_request(0, [0], [n], torch.zeros(n, 256, dtype=torch.float16))
        with pytest.raises(grpc.RpcError) as e:
            stub.Compute(huge, timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    assert c.stats().errors - errors_before == 8  # every refusal above except the oversized message
    assert nodes["q4km"].process.poll() is None
    check_call(c, Q4KM_GGUF, 0, [1], [2], 256)


def test_prometheus_metrics_follow_the_calls(nodes, clients):
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    c = clients["q4km"]
    port = nodes["q4km"].ready["metrics_port"]
    assert isinstance(port, int) and port > 0
    for _ in range(3):
        c.compute(3, [5], [2], torch.randn(2, 256))

    def scrape() -> dict[str, float]:
        with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
            text = r.read().decode()
        return {
            s.name + ("" if "layer" not in s.labels else f"[{s.labels['layer']}]"): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }

    m = scrape()
    stats = c.stats()
    assert m["swarm_node_calls_total"] == stats.calls and m["swarm_node_rows_total"] == stats.rows
    assert m["swarm_node_errors_total"] == stats.errors and m["swarm_node_slabs"] == 5
    assert m["swarm_node_layer_rows_total[3]"] >= 6
    c.compute(0, [1], [4], torch.randn(4, 256))
    assert scrape()["swarm_node_rows_total"] == stats.rows + 4


def test_swarm_key_is_required_except_for_health(nodes, clients):
    addr = nodes["f32"].address
    for key in (None, SwarmKey.from_text("wrong")):
        c = NodeClient(addr, key=key)
        code, msg = _code(lambda c=c: c.compute(0, [0], [1], torch.randn(1, 64)))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "key" in msg
        code, _ = _code(c.info)
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert c.health()
        c.close()
    assert clients["f32"].info().hidden_size == 64


def test_a_client_whose_pings_bunch_up_keeps_its_connection(nodes):
    """A coordinator that stalled sends its missed keepalive pings back to back: the node must not close the
    connection for them (a GOAWAY "too_many_pings" drops every call on it). A client pinging every 200 ms
    stands in for the bunch; before the node accepted any number of them, it was cut off within seconds."""
    import time

    channel = grpc.insecure_channel(
        nodes["q4km"].address,
        options=[("grpc.keepalive_time_ms", 200), ("grpc.keepalive_timeout_ms", 2000),
                 ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)],
    )  # fmt: skip
    states: list[grpc.ChannelConnectivity] = []
    channel.subscribe(states.append, try_to_connect=True)
    try:
        grpc.channel_ready_future(channel).result(timeout=10)
        time.sleep(6)
        assert states[-1] == grpc.ChannelConnectivity.READY, states
        assert pb_grpc.ExpertNodeStub(channel).Info(pb.InfoRequest(), timeout=5).hidden_size == 256
        assert states.count(grpc.ChannelConnectivity.READY) == 1, states  # never dropped and made again
    finally:
        channel.close()


def test_cli_user_errors_are_one_line(tmp_path, capsys):
    assert main(["node", str(tmp_path / "missing.gguf")]) == 2
    assert main(["node", str(Q4KM_GGUF), "--slab", "3"]) == 2
    assert main(["node", str(Q4KM_GGUF), "--memory", "lots"]) == 2
    assert main(["node", str(Q4KM_GGUF), "--experts", "40-50", "--no-mdns"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [line.split(":")[0] for line in err if not line.startswith("swarm node: refused")] == [
        "swarm node"
    ] * 4
    assert "no such file" in err[0] and "LAYER:EXPERT" in err[1] and "4GiB" in err[2]


# ---- the store in-process (no node process needed) --------------------------------------------------------


def test_store_lru_keeps_recent_experts_under_the_budget():
    from swarm.compute.store import ExpertStore
    from swarm.sharding.slabs import slabs_from_gguf

    slabs = slabs_from_gguf(Q80_GGUF, layers=[0], experts=range(4))
    one = 3 * 256 * 256 * 4  # bytes of one expert's float32 working copy
    store = ExpertStore(slabs, memory_budget=2 * one)
    x = torch.randn(1, 256)
    for e in (0, 1, 0, 2, 0, 1):  # 0 stays recent, so 1 is evicted by 2 and must come back
        store.compute(0, [e], [1], x, "exact")
    s = store.cache_stats()
    assert (s.hits, s.misses, s.evictions) == (2, 4, 2)
    assert s.resident_bytes == 2 * one and s.resident_experts == 2
    unlimited = ExpertStore(slabs)
    for e in (0, 1, 2, 3, 0):
        unlimited.compute(0, [e], [1], x, "exact")
    assert unlimited.cache_stats().evictions == 0 and unlimited.cache_stats().hits == 1


def test_repacked_copies_stay_under_the_budget_with_the_same_bits(caplog):
    """Native calls multiply Q4_K experts as repacked copies; the budget bounds them as it bounds float32
    copies (least recently used first out), an evicted expert is copied again, and its answers keep their bits."""
    from swarm.compute.expert_weights import copied_bytes as _copied_bytes
    from swarm.compute.store import ExpertStore
    from swarm.sharding.slabs import slabs_from_gguf

    slabs = slabs_from_gguf(Q4KM_GGUF, layers=[0], experts=range(4))
    one = _copied_bytes(slabs[(0, 0)])
    assert one > 0  # its Q4_K matrices have a repacked layout on this CPU
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(5))
    unlimited = ExpertStore(slabs, stacked=False)
    want = {e: unlimited.compute(0, [e], [2], x) for e in range(4)}
    store = ExpertStore(slabs, memory_budget=2 * one, stacked=False)
    for e in (0, 1, 0, 2, 0, 1):  # 0 stays recent, so 1 is evicted by 2 and must be copied again
        assert torch.equal(store.compute(0, [e], [2], x), want[e]), e
    s = store.cache_stats()
    assert (s.repacks, s.repacked_experts, s.repacked_bytes) == (4, 2, 2 * one)
    assert (s.resident_bytes, s.misses) == (0, 0)  # no float32 copies in the native numerics
    assert unlimited.cache_stats().repacked_experts == 4
    # at start-up as many as fit are copied, and the log says so
    with caplog.at_level(logging.WARNING, logger="swarm.compute.store"):
        small = ExpertStore(slabs, memory_budget=3 * one, stacked=False)
        small.prepare()
    assert small.cache_stats().repacked_experts == 3
    assert "3 of 4 experts fit the memory budget" in caplog.text
    assert torch.equal(small.compute(0, [3], [2], x), want[3])


def test_native_calls_keep_no_working_copies():
    from swarm.compute.store import ExpertStore
    from swarm.sharding.slabs import slabs_from_gguf

    store = ExpertStore(slabs_from_gguf(Q4KM_GGUF, layers=[0, 2]))
    x = torch.randn(6, 256)
    store.compute(0, [0, 3], [2, 4], x)
    store.compute(2, [1], [6], x)
    s = store.cache_stats()
    assert (s.resident_bytes, s.resident_experts, s.misses) == (0, 0, 0)
    assert store.stack(0) is not None  # a whole GGUF's experts lie back to back: one mul_mat_id each


def test_in_process_slots_equal_a_nodes_packed_call(tmp_path):
    """In process, a step's tokens go to mul_mat_id as they are (K slots each, no packing); a node gets the
    same pairs packed expert-major, from stacked tensors or from a shard directory's slab files: the same bits."""
    from swarm.compute.slabs import load_slabs
    from swarm.compute.store import ExpertStore
    from swarm.sharding.slabs import slabs_from_gguf

    stacked = ExpertStore(slabs_from_gguf(Q4KM_GGUF))
    assert main(["shard", str(Q4KM_GGUF), "-o", str(tmp_path / "m.swarm")]) == 0
    files = ExpertStore(load_slabs(tmp_path / "m.swarm").slabs)
    assert files.stack(1) is None  # slab files: per-expert graphs
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3))
    ids = torch.tensor([[3, 0], [0, 7], [5, 3], [1, 2], [7, 6]])
    slots = stacked.compute_slots(1, x, ids)
    assert slots is not None and slots.shape == (5, 2, 256)
    pairs = sorted((int(e), t, k) for t, row in enumerate(ids) for k, e in enumerate(row))
    rows = torch.stack([x[t] for _, t, _ in pairs])
    experts = sorted({e for e, _, _ in pairs})
    counts = [sum(1 for e2, _, _ in pairs if e2 == e) for e in experts]
    for store in (stacked, files):
        packed = store.compute(1, experts, counts, rows)
        for i, (_, t, k) in enumerate(pairs):
            assert torch.equal(packed[i], slots[t, k]), (t, k)
    assert files.compute_slots(1, x, ids) is None


def test_store_dequantizes_a_cold_expert_once_under_concurrency():
    from concurrent.futures import ThreadPoolExecutor

    from swarm.compute.store import ExpertStore
    from swarm.sharding.slabs import slabs_from_gguf

    store = ExpertStore(slabs_from_gguf(Q4KM_GGUF, layers=[0], experts=[1]))
    x = torch.randn(8, 256)
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: store.compute(0, [1], [1], x[i : i + 1], "exact"), range(8)))
    assert store.cache_stats().misses == 1 and store.cache_stats().hits == 7
    assert rel_err(torch.cat(outs), reference(Q4KM_GGUF, 0, 1, x.double().numpy())) <= 1e-5


def test_unreachable_node_is_unavailable():
    with NodeClient("127.0.0.1:1") as c:
        code, _ = _code(lambda: c.compute(0, [0], [1], torch.randn(1, 256), timeout=5))
        assert code == grpc.StatusCode.UNAVAILABLE


def test_store_serves_other_experts_while_one_is_loading(monkeypatch):
    import threading

    import swarm.compute.store as store_mod
    from swarm.compute.store import ExpertStore
    from swarm.sharding.slabs import slabs_from_gguf

    slabs = slabs_from_gguf(Q4KM_GGUF, layers=[0], experts=[0, 1])
    release = threading.Event()
    real = store_mod.dequantize_expert

    def slow_for_expert_0(parts, device="cpu"):
        if parts is slabs[(0, 0)]:
            assert release.wait(10), "expert 0's load was never released"
        return real(parts, device)

    monkeypatch.setattr(store_mod, "dequantize_expert", slow_for_expert_0)
    store = ExpertStore(slabs)
    x = torch.randn(1, 256)
    blocked = threading.Thread(target=store.compute, args=(0, [0], [1], x, "exact"))
    blocked.start()
    try:
        # Expert 1 computes (twice, from the cache the second time) while expert 0 is still being loaded.
        store.compute(0, [1], [1], x, "exact")
        store.compute(0, [1], [1], x, "exact")
        assert blocked.is_alive()
    finally:
        release.set()
        blocked.join(10)
    assert store.cache_stats().resident_experts == 2


def test_nodes_do_not_outlive_a_launcher_that_was_killed(tmp_path):
    """start_nodes' nodes stop when the process that started them dies without cleaning up (SIGKILL, OOM)."""
    import json
    import signal
    import time

    code = (
        "import json, sys, time\n"
        "from pathlib import Path\n"
        "from swarm.coordinator.cli.spawn import start_nodes\n"
        f"nodes = start_nodes([({str(F32_GGUF)!r}, ['--no-mdns', '--experts', '0-3'])], Path({str(tmp_path)!r}))\n"
        "print(json.dumps([n.pid for n in nodes]), flush=True)\n"
        "time.sleep(600)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        (pid,) = json.loads(launcher.stdout.readline())
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            os.kill(pid, signal.SIGKILL)
            pytest.fail("the node outlived its killed launcher")
    finally:
        launcher.kill()


def _under_file_limit(soft: int, hard: int, code: str) -> subprocess.CompletedProcess[str]:
    """Python `code` in a child process started with this open-files limit."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, preexec_fn=limit
    )


def test_a_node_holding_more_slabs_than_the_soft_file_limit_raises_it_or_says_what_to_do(tmp_path):
    """Each slab file a node holds stays open (memory-mapped): 128 slabs under a soft limit of 100 load all
    the same (the soft limit is raised towards the hard one), as a coordinator's audit slabs do, and under a
    hard limit of 100 the node stops with an error that names the limit, not a "damaged file"."""
    shard = tmp_path / "m.swarm"
    shard_model(FIXTURES / "qwen3moe-tiny" / "model-f32.gguf", shard)  # 4 layers x 32 experts
    node_loads = (
        "from swarm.compute.slabs import load_slabs\n"
        f"got = load_slabs({str(shard)!r}, verify=False)\n"
        "print(len(got.slabs), len(got.problems))\n"
    )
    # a coordinator reads its own slab files as its audits draw them, and keeps each open the same way
    audits_read = (
        "from swarm.coordinator.checks.recompute import own_store\n"
        f"store = own_store({str(shard)!r})\n"
        "print(sum(1 for key in list(store.slabs) if key in store.slabs), 0)\n"
    )
    for code in (node_loads, audits_read):
        done = _under_file_limit(100, resource.getrlimit(resource.RLIMIT_NOFILE)[1], code)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["128", "0"], done.stderr
    cli = f"from swarm.coordinator.cli import main; raise SystemExit(main(['node', {str(shard)!r}, '--no-mdns']))"
    refused = _under_file_limit(100, 100, cli)
    assert refused.returncode == 2, refused.stderr
    assert "ulimit -n" in refused.stderr and "damaged" not in refused.stderr
    assert "Traceback" not in refused.stderr
