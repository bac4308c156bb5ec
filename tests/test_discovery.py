"""mDNS discovery on loopback only: a node process appears to a browser and leaves on SIGTERM."""

from __future__ import annotations

import random
import time

import pytest
from conftest import FIXTURES

from swarm.coordinator.cli.spawn import start_nodes
from swarm.node.client import NodeClient
from swarm.node.discovery import (
    Advertiser,
    browse,
    default_mdns_interfaces,
    node_properties,
    pack_slabs,
    unpack_slabs,
)
from swarm.proto.channel import PROTOCOL_VERSION

LOOPBACK = ["127.0.0.1"]
GGUF = FIXTURES / "qwen35moe-quant" / "model-q4_k_m.gguf"


def test_slab_sets_pack_into_txt_sized_chunks():
    whole = {(layer, e) for layer in range(48) for e in range(512)}
    assert len(pack_slabs(whole)) == 1 and len(pack_slabs(whole)[0]) < 20
    assert unpack_slabs(pack_slabs(whole)) == whole
    rng = random.Random(1)
    scattered = {(rng.randrange(48), rng.randrange(512)) for _ in range(3000)}
    chunks = pack_slabs(scattered)
    assert len(chunks) > 1
    assert unpack_slabs(chunks) == scattered
    props = node_properties("f" * 64, scattered, 2048, 4 << 30, 8, "cpu")
    assert all(len(k) + 1 + len(v.encode()) <= 255 for k, v in props.items())
    assert unpack_slabs([]) == set()


def test_default_advertising_interface_follows_the_listen_address():
    assert default_mdns_interfaces("127.0.0.1") == ["127.0.0.1"]
    assert default_mdns_interfaces("localhost") == ["127.0.0.1"]
    assert default_mdns_interfaces("0.0.0.0") is None  # every interface
    assert default_mdns_interfaces("192.0.2.7") == ["192.0.2.7"]


def test_advertised_record_roundtrips_through_a_browser():
    rng = random.Random(2)
    held = {(rng.randrange(40), rng.randrange(256)) for _ in range(1500)}  # several TXT chunks
    props = node_properties("ab" * 32, held, 2048, 123456, 3, "cpu", stream_port=45679)
    with browse(interfaces=LOOPBACK) as browser:
        adv = Advertiser(45678, "127.0.0.1", props, LOOPBACK, name="roundtrip-test").start()
        try:
            found = browser.wait_for(lambda ns: any(n.port == 45678 for n in ns), timeout=5)
        finally:
            adv.close()
        assert found is not None
        node = next(n for n in found if n.port == 45678)
        assert node.held == held
        assert (node.address, node.fingerprint, node.hidden_size) == ("127.0.0.1:45678", "ab" * 32, 2048)
        assert node.stream_port == 45679  # its compute stream
        assert (node.memory_budget_bytes, node.workers, node.device, node.protocol_version) == (
            123456,
            3,
            "cpu",
            PROTOCOL_VERSION,
        )


@pytest.mark.slow
def test_node_process_appears_within_2s_and_leaves_on_sigterm(tmp_path):
    with browse(interfaces=LOOPBACK) as browser, browse(fingerprint="0" * 64, interfaces=LOOPBACK) as other:
        (node,) = start_nodes(
            [(GGUF, ["--experts", "0-3", "--layers", "0-1", "--mdns-interface", "127.0.0.1"])],
            tmp_path,
            timeout=180,
        )
        try:
            ready = time.monotonic()
            found = browser.wait_for(lambda ns: any(n.port == node.port for n in ns), timeout=2.0)
            assert found is not None, f"node not seen within 2 s:\n{node.log_tail()}"
            seen = next(n for n in found if n.port == node.port)
            assert seen.address == node.address and seen.fingerprint == node.fingerprint
            assert seen.held == {(layer, e) for layer in (0, 1) for e in range(4)}
            with NodeClient(node.address) as client:
                assert seen.stream_port == client.info().stream_port > 0  # the compute stream, as Info says
            assert time.monotonic() - ready <= 2.0
            fp_browser = browse(fingerprint=node.fingerprint, interfaces=LOOPBACK)
            try:
                assert fp_browser.wait_for(lambda ns: len(ns) == 1, timeout=3.0) is not None
            finally:
                fp_browser.close()
            assert other.nodes() == []  # a browser for another model ignores it
        finally:
            code = node.stop()
        assert code == 0, node.log_tail()
        gone = browser.wait_for(lambda ns: all(n.port != node.port for n in ns), timeout=3.0)
        assert gone is not None, "node still listed 3 s after it exited"
