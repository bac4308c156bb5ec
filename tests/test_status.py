"""`swarm status` against real node processes on loopback: what each holds, and whether a model is covered."""

from __future__ import annotations

import json

from conftest import FIXTURES

from swarm.coordinator.cli import main
from swarm.coordinator.cli.spawn import start_nodes
from swarm.sharding.shard import shard_model


def test_status_lists_the_nodes_and_names_what_no_node_holds(tmp_path, capsys):
    shard_dir = tmp_path / "m.swarm"
    shard_model(FIXTURES / "qwen3moe-tiny" / "model-f32.gguf", shard_dir)  # 4 layers x 32 experts
    key_file = tmp_path / "swarm.key"  # this test's swarm: nobody else's nodes on loopback
    assert main(["keygen", "--out", str(key_file)]) == 0
    capsys.readouterr()
    argv = [
        "status",
        str(shard_dir),
        "--mdns-interface",
        "127.0.0.1",
        "--key-file",
        str(key_file),
        "--wait",
        "4",  # mDNS answers on a busy machine: 1.5 s once missed a node that had answered the call before
    ]
    kf = ["--key-file", str(key_file)]
    nodes = start_nodes(
        [(shard_dir, ["--experts", "0-15", *kf]), (shard_dir, ["--experts", "8-23", *kf])], tmp_path / "a"
    )
    try:
        assert main(argv) == 1
        out = capsys.readouterr().out
        for n in nodes:
            assert n.address in out
        assert "0-3:0-15" in out and "0-3:8-23" in out
        assert "not covered" in out and "experts 24-31" in out

        nodes += start_nodes([(shard_dir, ["--experts", "24-31", *kf])], tmp_path / "b")
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "has a holder: 128 slabs, 96 with 1 holder, 32 with 2 holders" in out, out
        assert "layers 0-3: 0 / 24 / 8" in out, out  # the coverage map: slabs with 0 / 1 / 2+ holders

        assert main([*argv, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        by_address = {n["address"]: n for n in report["nodes"]}
        assert set(by_address) == {n.address for n in nodes}
        for n, held, count in zip(nodes, ["0-3:0-15", "0-3:8-23", "0-3:24-31"], [64, 64, 32], strict=True):
            rec = by_address[n.address]
            assert rec["answering"] and rec["held"] == held and rec["slabs"] == count
            assert rec["fingerprint"] == n.fingerprint and rec["answers"] == "ok"
            assert rec["calls"] >= 0 and 0.0 <= rec["load"] <= 1.0
        assert report["coverage"] == [{"layer": i, "none": 0, "one": 24, "two_or_more": 8} for i in range(4)]
    finally:
        for n in nodes:
            n.stop()


def test_no_nodes_is_a_one_line_error(capsys):
    assert main(["status", "--no-mdns"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("swarm status: error: no swarm nodes") and "\n" not in err
