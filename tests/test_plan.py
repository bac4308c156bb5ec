"""`swarm plan`: every slab on --replicas distinct devices within every capacity, hot experts on more, an
impossible plan refused with the shortfall; `swarm run --stats` records what the plan reads."""

from __future__ import annotations

import json
import random

import pytest
from conftest import FIXTURES

from swarm.coordinator.cli import main
from swarm.coordinator.config import EngineConfig
from swarm.sharding.plan import Device, plan, uniform_loads
from swarm.sharding.shard import shard_model
from swarm.sharding.slabs import read_manifest


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("plan") / "m.swarm"
    shard_model(FIXTURES / "qwen3moe-tiny" / "model-f32.gguf", d)  # 4 layers x 32 experts
    return d


def _check(result, slabs, devices, replicas):
    cap = {d.name: d.capacity for d in devices}
    for a in result.nodes:
        assert a.bytes == sum(slabs[k] for k in a.slabs) <= cap[a.device.name]
    for key in slabs:
        names = result.holders[key]
        assert len(names) == len(set(names)) >= replicas, (key, names)
        assert all(key in next(a for a in result.nodes if a.device.name == n).slabs for n in names)


def test_heterogeneous_capacities_replicas_two(shard_dir, capsys):
    m = read_manifest(shard_dir)
    slabs = {(s.layer, s.expert): s.size for s in m.slabs}
    total = sum(slabs.values())
    rng = random.Random(5)
    devices = [Device(f"d{i}", int(total * rng.uniform(0.15, 0.9))) for i in range(6)]
    result = plan(slabs, devices, 2, uniform_loads(slabs, m.n_expert_used, m.n_expert))
    _check(result, slabs, devices, 2)

    caps = ",".join(str(d.capacity) for d in devices)
    assert main(["plan", str(shard_dir), "--capacities", caps, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["replicas"]["min"] >= 2 and len(out["nodes"]) == 6
    held: dict[tuple[int, int], int] = {}
    for node in out["nodes"]:
        assert node["bytes"] <= node["capacity_bytes"]
        assert node["command"].startswith(f"swarm node {shard_dir} --slab '")
        for layer, e in node["slabs"]:
            held[(layer, e)] = held.get((layer, e), 0) + 1
    assert set(held) == set(slabs) and min(held.values()) >= 2


@pytest.mark.slow
def test_a_node_started_from_the_plan_holds_exactly_its_slabs(shard_dir, tmp_path, capsys):
    from swarm.coordinator.cli.spawn import start_nodes
    from swarm.node.client import NodeClient

    total = sum(s.size for s in read_manifest(shard_dir).slabs)
    caps = ",".join(str(total // 2 + 50_000) for _ in range(4))
    assert main(["plan", str(shard_dir), "--capacities", caps, "--names", "a,b,c,d", "--json"]) == 0
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(capsys.readouterr().out)
    nodes = json.loads(plan_file.read_text())["nodes"]
    (node,) = start_nodes(
        [(shard_dir, ["--plan", str(plan_file), "--name", "c", "--no-mdns"])], tmp_path / "n"
    )
    try:
        with NodeClient(node.address) as c:
            held = c.info().held
        assert held == {tuple(k) for k in next(n for n in nodes if n["name"] == "c")["slabs"]}
    finally:
        node.stop()
    assert main(["node", str(shard_dir), "--plan", str(plan_file), "--name", "zz"]) == 2
    assert "has no node named 'zz'" in capsys.readouterr().err


def test_a_tight_plan_still_fits_and_an_impossible_one_says_by_how_much(shard_dir, capsys):
    m = read_manifest(shard_dir)
    slabs = {(s.layer, s.expert): s.size for s in m.slabs}
    total = sum(slabs.values())
    # one big device that must hold a copy of nearly everything, three small ones for the other copy
    devices = [Device("big", total), Device("a", total // 3 + 40_000), Device("b", total // 3 + 40_000),
               Device("c", total // 3 + 40_000)]  # fmt: skip
    _check(plan(slabs, devices, 2, uniform_loads(slabs, 4, 32)), slabs, devices, 2)

    caps = f"{total // 2},{total // 2}"
    assert main(["plan", str(shard_dir), "--capacities", caps, "--replicas", "2"]) == 1
    err = capsys.readouterr().err
    assert "does not fit" in err and "short by" in err and len(err.strip().splitlines()) == 1
    assert main(["plan", str(shard_dir), "--capacities", "1GiB", "--replicas", "2"]) == 1
    assert "needs at least 2 devices" in capsys.readouterr().err


def test_hot_experts_get_more_holders_from_run_statistics(shard_dir, tmp_path, capsys):
    stats = tmp_path / "stats.json"
    gguf = FIXTURES / "qwen3moe-tiny" / "model-f32.gguf"
    for prompt in ("A list keeps items in order.", "Sets hold unique items."):
        argv = ["run", str(gguf), "--local", "--prompt", prompt, "--max-tokens", "6", "--stats", str(stats)]
        assert main(argv) == 0
    data = json.loads(stats.read_text())
    assert data["tokens"] > 10 and sum(data["counts"].values()) == data["tokens"] * 4 * 4  # K=4, 4 layers
    capsys.readouterr()
    m = read_manifest(shard_dir)
    total = sum(s.size for s in m.slabs)
    caps = ",".join([str(total)] * 4)  # room for 4 copies of everything
    assert main(["plan", str(shard_dir), "--capacities", caps, "--stats", str(stats), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    holders: dict[str, int] = {}
    for node in out["nodes"]:
        for layer, e in node["slabs"]:
            holders[f"{layer}:{e}"] = holders.get(f"{layer}:{e}", 0) + 1
    hottest = max(data["counts"], key=data["counts"].get)
    assert holders[hottest] > 2, (hottest, holders[hottest])
    assert out["replicas"]["mean"] > 2
    shares = [n["load_share"] for n in out["nodes"]]
    assert max(shares) <= 1.5 / len(shares)


def test_a_running_coordinator_takes_in_slabs_a_node_announces_later() -> None:
    """A node that fetches its slabs announces them by mDNS as they verify; the coordinator routes to it from
    then on, without forgetting that it is down if it is."""
    from types import SimpleNamespace

    from swarm.coordinator.experts.remote.dispatch import SwarmExperts
    from swarm.coordinator.experts.remote.placement import Placement
    from swarm.proto.channel import PROTOCOL_VERSION

    def announced(address: str, held: list, version: int = PROTOCOL_VERSION) -> SimpleNamespace:
        return SimpleNamespace(address=address, identity=SimpleNamespace(fingerprint="f"), tls=False, held=held,
                               stream_port=0, dial=None, numerics_class="", protocol_version=version)  # fmt: skip

    node = announced("127.0.0.1:1", [(0, 0)])
    older = announced("127.0.0.1:2", [(0, 1)], PROTOCOL_VERSION - 1)  # refuses this coordinator's calls
    browser = SimpleNamespace(version=1, nodes=lambda: [node, older], close=lambda: None)
    experts = SwarmExperts({}, Placement(), "m.swarm", EngineConfig(), browser=browser)  # type: ignore[arg-type]
    experts.follow_mdns()
    assert experts.placement.pick(0, 0) == node.address and experts.placement.pick(0, 1) is None
    assert older.address not in experts.clients
    experts.placement.mark_down(node.address, 60.0)
    node.held = [(0, 0), (0, 1)]
    browser.version = 2
    experts.follow_mdns()
    assert experts.placement.holders()[(0, 1)] == [node.address]
    assert experts.placement.pick(0, 1) is None  # still backing off: announcing more is not answering
    node.held = [(0, 1)]  # it dropped a slab whose file failed its own check
    browser.version = 3
    experts.follow_mdns()
    assert node.address not in experts.placement.holders()[(0, 0)]
    assert experts.placement.holders()[(0, 1)] == [node.address]
    experts.close()
