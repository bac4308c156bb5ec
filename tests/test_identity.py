"""A coordinator and nodes recognise one model whether each was started on its GGUF or on its shard directory.

Real node processes on 127.0.0.1 (mDNS on loopback only): qwen3moe-tiny served from the GGUF (found by
mDNS) and from a shard directory (static peers), and a qwen2moe-tiny node that must stay a stranger. Swarm
logits must be bit-identical to the in-process engine on the same path (which test_models.py checks against
transformers and llama.cpp).
"""

from __future__ import annotations

import logging
import re
import shutil
import time

import grpc
import numpy as np
import pytest
import torch
from conftest import FIXTURES
from reference import assert_logits_close

from swarm.coordinator.cli.spawn import start_nodes, stop_nodes
from swarm.coordinator.config import EngineConfig
from swarm.coordinator.decode.one import forward_one
from swarm.coordinator.engine import open_engine
from swarm.coordinator.experts.remote.discovery import connect
from swarm.node.client import NodeCallError, NodeClient
from swarm.node.discovery import Advertiser, browse, node_properties
from swarm.sharding.errors import UserError
from swarm.sharding.gguf_io import open_gguf
from swarm.sharding.identity import Match, ModelIdentity, identity_of, model_identity
from swarm.sharding.shard import shard_model
from swarm.sharding.slabs import read_manifest

LOOPBACK = ["127.0.0.1"]
GGUF = FIXTURES / "qwen3moe-tiny" / "model-f32.gguf"
OTHER_GGUF = FIXTURES / "qwen2moe-tiny" / "model-f32.gguf"
SWARM_LOG = "swarm.coordinator.experts.remote.discovery"


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("identity") / "m.swarm"
    shard_model(GGUF, d)
    return d


@pytest.fixture(scope="module")
def nodes(shard_dir, tmp_path_factory):
    """g0/g1: the two expert halves from the GGUF, advertised by mDNS; s0/s1: the same halves from the shard
    directory, static peers only (so an mDNS search finds GGUF nodes alone); other: qwen2moe, advertised."""
    n = read_manifest(shard_dir).n_expert
    lo, hi = f"0-{n // 2 - 1}", f"{n // 2}-{n - 1}"
    specs = {
        "g0": (GGUF, ["--experts", lo, "--threads", "1"]),
        "g1": (GGUF, ["--experts", hi, "--threads", "1"]),
        "s0": (shard_dir, ["--experts", lo, "--threads", "1", "--no-mdns"]),
        "s1": (shard_dir, ["--experts", hi, "--threads", "1", "--no-mdns"]),
        "other": (OTHER_GGUF, ["--threads", "1"]),
    }
    started = start_nodes(list(specs.values()), tmp_path_factory.mktemp("identity-nodes"))
    yield dict(zip(specs, started, strict=True))
    stop_nodes(started)


def _prompts() -> tuple[np.lib.npyio.NpzFile, list[list[int]]]:
    ref = np.load(FIXTURES / "qwen3moe-tiny" / "reference.npz")
    return ref, [ref[f"tokens_{i}"].tolist() for i in range(2)]


def _assert_same_logits(swarm, local) -> None:
    for i, tokens in enumerate(_prompts()[1]):
        a = forward_one(swarm.model, tokens, swarm.model.new_state(), "cpu")
        b = forward_one(local.model, tokens, local.model.new_state(), "cpu")
        assert torch.equal(a, b), f"prompt {i}: differs, max {float((a - b).abs().max()):.3g}"


def _assert_run(swarm, local, serving, by_header, caplog) -> None:
    """Logits bit-identical to in-process; each node of `serving` was sent the fingerprint it checks itself
    and got calls; the one INFO line on header-only matches names exactly those of `by_header`."""
    _assert_same_logits(swarm, local)
    for node in serving:
        assert swarm.experts.clients[node.address].fingerprint == node.fingerprint
        assert swarm.experts.calls_per_node[node.address] > 0, f"{node.address} got no calls"
    assert not swarm.experts.failovers
    lines = [
        r.getMessage() for r in caplog.records if r.name == SWARM_LOG and "header hash only" in r.getMessage()
    ]
    assert len(lines) == 1, lines
    for node in serving:
        assert (node.address in lines[0]) == (node in by_header), (node.address, lines[0])


# --- identities of the two forms of one model (no processes) ---


def test_a_shard_dir_is_known_by_its_fingerprint_and_its_source_header(shard_dir):
    manifest = read_manifest(shard_dir)
    shard, gguf = identity_of(shard_dir), identity_of(GGUF)
    assert shard == ModelIdentity(manifest.fingerprint, manifest.source.header_sha256)
    assert gguf.fingerprint == gguf.source_sha256 == manifest.source.header_sha256 and gguf.is_gguf
    assert not shard.is_gguf
    assert shard.match(shard) is Match.FINGERPRINT
    assert shard.match(gguf) is Match.HEADER and gguf.match(shard) is Match.HEADER
    assert gguf.match(gguf) is Match.HEADER
    # a node of an older swarm reports no source hash: its fingerprint alone still matches exactly
    assert shard.match(ModelIdentity(manifest.fingerprint)) is Match.FINGERPRINT
    other = identity_of(OTHER_GGUF)
    assert shard.match(other) is None and gguf.match(other) is None and other.match(shard) is None
    identity, needed = model_identity(GGUF)
    assert identity == gguf and len(needed) == len(manifest.moe_layers) * manifest.n_expert


def test_same_header_other_weights_matches_a_gguf_but_never_another_shard_dir(shard_dir, tmp_path):
    """The documented weakness of the header match, and where it stops: two shard dirs compare in full."""
    changed = tmp_path / "changed.gguf"
    shutil.copyfile(GGUF, changed)
    tensor = next(t for t in open_gguf(GGUF).tensors if t.name == "blk.1.ffn_up_exps.weight")
    with open(changed, "r+b") as f:
        f.seek(int(tensor.data_offset) + 5)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    changed_dir = tmp_path / "changed.swarm"
    shard_model(changed, changed_dir)
    shard = identity_of(shard_dir)
    assert identity_of(changed) == identity_of(GGUF)  # a whole GGUF is only its header
    assert shard.match(identity_of(changed)) is Match.HEADER
    changed_shard = identity_of(changed_dir)
    assert changed_shard.source_sha256 == shard.source_sha256
    assert changed_shard.fingerprint != shard.fingerprint
    assert shard.match(changed_shard) is None and changed_shard.match(shard) is None


def test_the_source_hash_travels_in_the_mdns_record_and_the_browser_matches_on_it(shard_dir):
    shard, gguf = identity_of(shard_dir), identity_of(GGUF)
    stranger = identity_of(OTHER_GGUF)
    records = {
        45691: node_properties(shard.fingerprint, {(0, 0)}, 64, 0, 1, "cpu", source_sha256=shard.source_sha256),
        45692: node_properties(stranger.fingerprint, {(0, 0)}, 64, 0, 1, "cpu", source_sha256=stranger.source_sha256),
        45693: node_properties(shard.fingerprint, {(0, 1)}, 64, 0, 1, "cpu"),  # an older node: no "src"
    }  # fmt: skip
    assert records[45691]["src"] == shard.source_sha256 and "src" not in records[45693]
    with browse(interfaces=LOOPBACK) as everyone, browse(interfaces=LOOPBACK, identity=gguf) as ours:
        ads = [Advertiser(port, "127.0.0.1", props, LOOPBACK).start() for port, props in records.items()]
        try:
            seen = everyone.wait_for(lambda ns: set(records) <= {n.port for n in ns}, timeout=5)
            assert seen is not None
            # a coordinator on the GGUF takes the shard node by its source hash, not the stranger, nor the
            # old node whose bare manifest fingerprint says nothing about its source
            assert ours.wait_for(lambda ns: any(n.port == 45691 for n in ns), timeout=5)
            assert {n.port for n in ours.nodes() if n.port in records} == {45691}
        finally:
            for ad in ads:
                ad.close()
    by_port = {n.port: n for n in seen}
    assert by_port[45691].identity == shard and by_port[45693].source_sha256 == ""
    assert gguf.match(by_port[45691].identity) is Match.HEADER
    assert gguf.match(by_port[45692].identity) is None and gguf.match(by_port[45693].identity) is None


# --- real node processes ---


@pytest.mark.slow
def test_coordinator_on_the_shard_dir_finds_gguf_nodes_by_mdns(nodes, shard_dir, caplog):
    caplog.set_level(logging.INFO, logger=SWARM_LOG)
    g0, g1 = nodes["g0"], nodes["g1"]
    swarm = open_engine(shard_dir, EngineConfig(mdns_interfaces=LOOPBACK, wait=10.0, device="cpu"))
    local = open_engine(shard_dir, EngineConfig(local=True, device="cpu"))
    try:
        clients = swarm.experts.clients
        assert {g0.address, g1.address} <= set(clients), "both GGUF nodes found by mDNS"
        assert nodes["other"].address not in clients, "the qwen2moe node is ignored"
        assert g0.fingerprint == g1.fingerprint == identity_of(GGUF).fingerprint
        assert swarm.fingerprint == read_manifest(shard_dir).fingerprint
        _assert_run(swarm, local, [g0, g1], [g0, g1], caplog)
        ref, prompts = _prompts()
        a = forward_one(swarm.model, prompts[0], swarm.model.new_state(), "cpu")
        assert_logits_close(a, ref["hf_logits_0"], "coordinator on the shard dir, nodes on the GGUF")
    finally:
        swarm.close()
        local.close()


@pytest.mark.slow
def test_coordinator_on_the_gguf_takes_shard_dir_peers(nodes, caplog):
    caplog.set_level(logging.INFO, logger=SWARM_LOG)
    s0, s1 = nodes["s0"], nodes["s1"]
    swarm = open_engine(GGUF, EngineConfig(peers=(s0.address, s1.address), mdns=False, device="cpu"))
    local = open_engine(GGUF, EngineConfig(local=True, device="cpu"))
    try:
        assert set(swarm.experts.clients) == {s0.address, s1.address}
        assert s0.fingerprint != swarm.fingerprint and s0.ready["source_sha256"] == swarm.fingerprint
        _assert_run(swarm, local, [s0, s1], [s0, s1], caplog)
    finally:
        swarm.close()
        local.close()


@pytest.mark.slow
@pytest.mark.parametrize("coordinator_on", ["shard", "gguf"])
def test_a_mixed_swarm_serves_one_run(nodes, shard_dir, coordinator_on, caplog):
    """On the shard dir: s0 by --peer, g1 by mDNS (the search stops once every slab has a holder, so g0, the
    replica of s0, may be taken or not). On the GGUF: g0 and s1 as static peers."""
    caplog.set_level(logging.INFO, logger=SWARM_LOG)
    s0, s1, g0, g1 = nodes["s0"], nodes["s1"], nodes["g0"], nodes["g1"]
    if coordinator_on == "shard":
        path, serving, by_header = shard_dir, [s0, g1], [g1]  # s0 matches on the full fingerprint
        swarm = open_engine(path, EngineConfig(peers=(s0.address,), mdns_interfaces=LOOPBACK, wait=10.0, device="cpu"))
    else:
        path, serving, by_header = GGUF, [g0, s1], [g0, s1]
        swarm = open_engine(path, EngineConfig(peers=(g0.address, s1.address), mdns=False, device="cpu"))
    local = open_engine(path, EngineConfig(local=True, device="cpu"))
    try:
        _assert_run(swarm, local, serving, by_header, caplog)
    finally:
        swarm.close()
        local.close()


@pytest.mark.slow
def test_a_node_of_another_model_is_passed_over(nodes, shard_dir, caplog):
    other, g0, g1 = nodes["other"], nodes["g0"], nodes["g1"]
    caplog.set_level(logging.WARNING)
    for path in (shard_dir, GGUF):
        identity, needed = model_identity(path)
        with pytest.raises(UserError, match=rf"no swarm nodes found .*passed over {other.address}: another"):
            connect(needed, identity, str(path), EngineConfig(peers=[other.address], mdns=False))
        assert re.search(rf"passing over peer {other.address}: it serves another model", caplog.text)
    # beside an honest holder: the stranger is passed over and never receives a pair
    identity, needed = model_identity(GGUF)
    swarm = connect(needed, identity, str(GGUF), EngineConfig(peers=[other.address, g0.address, g1.address], mdns=False))
    try:
        assert set(swarm.clients) == {g0.address, g1.address}
        rows = torch.randn(3, 64)
        swarm.start(0, rows, torch.tensor([[0, 1], [2, 3], [4, 5]])).wait()
        assert swarm.calls_per_node[g0.address] > 0 and other.address not in swarm.calls_per_node
    finally:
        swarm.close()
    # mDNS: the stranger is advertised, but a browser for this model never lists it
    with (
        browse(interfaces=LOOPBACK) as everyone,
        browse(interfaces=LOOPBACK, identity=identity_of(GGUF)) as ours,
    ):
        assert everyone.wait_for(lambda ns: any(n.port == other.port for n in ns), timeout=5) is not None
        assert ours.wait_for(lambda ns: {nodes["g0"].port, nodes["g1"].port} <= {n.port for n in ns}, 5)
        assert other.port not in {n.port for n in ours.nodes()}
        # the browser resolves records one after another: the stranger's may come after ours
        passed = rf"passing over node .* at {other.address}: it serves another model"
        deadline = time.monotonic() + 10
        while not re.search(passed, caplog.text) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert re.search(passed, caplog.text), caplog.text
    # nodes stay strict: a call carrying the shard dir's fingerprint is refused by a node on the GGUF
    with NodeClient(nodes["g0"].address, fingerprint=read_manifest(shard_dir).fingerprint) as client:
        with pytest.raises(NodeCallError) as e:
            client.compute(0, [0], [1], torch.zeros(1, 64))
    assert e.value.code is grpc.StatusCode.FAILED_PRECONDITION
