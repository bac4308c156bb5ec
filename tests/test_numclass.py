"""Numerics classes: every node says which class its ggml build computes in (Info, mDNS, `swarm status`);
answers of the coordinator's class are checked bit for bit, of another class within the kernels' error
bound (swarm.coordinator.tolerance); `--numerics-class same` takes only nodes of the coordinator's class.
Nodes of another class are real node processes that report an ARM class (tests/class_node.py); answers
recorded on real ARM builds are in test_arm_answers below."""

from __future__ import annotations

import json
import platform
import shutil
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, flip_bytes

from swarm.coordinator.audit import Auditor
from swarm.coordinator.cli import main
from swarm.coordinator.engine import open_engine
from swarm.coordinator.generate import checked_logits, forward_one
from swarm.node.auth import KEY_ENV, SwarmKey, generate_key_text
from swarm.node.client import NodeClient
from swarm.node.launch import start_nodes, stop_nodes
from swarm.node.numclass import numerics_class, same_class
from swarm.sharding.gguf_io import open_gguf
from swarm.sharding.shard import shard_model

MODEL = FIXTURES / "qwen35moe-quant" / "model-q4_k_m.gguf"
KEY_TEXT = generate_key_text()
KEY = SwarmKey.from_text(KEY_TEXT)
ARM = "aarch64 neon+dotprod / ggml-python 0.0.45"
CLASS_NODE = (str(Path(__file__).resolve().parent / "class_node.py"), ARM)
DOWN_IN_PLACE = 2  # the fixture's layer whose down matrices (Q6_K) a node multiplies where they lie


def test_this_build_says_its_class():
    cls = numerics_class()
    machine = platform.machine().lower().replace("amd64", "x86_64").replace("arm64", "aarch64")
    assert cls.startswith(machine + " ") and " / ggml-python " in cls
    if machine == "x86_64":
        assert "avx2" in cls.split(" / ")[0]  # the README's build
    assert same_class(cls, cls) and not same_class(cls, ARM) and not same_class("", "")


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    work = tmp_path_factory.mktemp("classes")
    shard_model(MODEL, work / "a.swarm")
    shutil.copytree(work / "a.swarm", work / "arm.swarm")
    nodes = start_nodes([(work / "a.swarm", [])], work / "nodes", env={KEY_ENV: KEY_TEXT})
    nodes += start_nodes(
        [(work / "arm.swarm", ["--recheck", "0"])], work / "nodes", env={KEY_ENV: KEY_TEXT}, prefix="arm",
        program=CLASS_NODE,
    )  # fmt: skip
    yield work, nodes
    stop_nodes(nodes)


def test_a_node_reports_its_class_in_info_mdns_and_status(rig, capsys, monkeypatch):
    work, (x86, arm) = rig
    for node, cls in ((x86, numerics_class()), (arm, ARM)):
        client = NodeClient(node.address, key=KEY)
        try:
            assert client.info().numerics_class == cls
        finally:
            client.close()
    from swarm.node.discovery import browse

    browser = browse(interfaces=["127.0.0.1"], key=KEY)
    try:
        found = browser.wait_for(lambda ns: len(ns) >= 2, 10.0)
        assert found is not None
        assert {n.address: n.numerics_class for n in browser.nodes()} == {
            x86.address: numerics_class(),
            arm.address: ARM,
        }
    finally:
        browser.close()
    monkeypatch.setenv(KEY_ENV, KEY_TEXT)
    capsys.readouterr()
    assert (
        main(
            [
                "status",
                str(work / "a.swarm"),
                "--no-mdns",
                "--peer",
                x86.address,
                "--peer",
                arm.address,
                "--json",
            ]
        )
        == 0
    )
    nodes = {n["address"]: n for n in json.loads(capsys.readouterr().out)["nodes"]}
    assert nodes[arm.address]["numerics_class"] == ARM and nodes[arm.address]["answers"] == "ok"
    assert nodes[x86.address]["numerics_class"] == numerics_class()
    assert (
        main(["status", str(work / "a.swarm"), "--no-mdns", "--peer", x86.address, "--peer", arm.address])
        == 0
    )
    out = capsys.readouterr().out
    assert "aarch64 neon+dotprod" in out and numerics_class().split(" / ")[0] + " (=)" in out


def _swarm(work, nodes, **kw):
    return open_engine(
        work / "a.swarm", peers=tuple(n.address for n in nodes), mdns=False, device="cpu", key=KEY, **kw
    )


def test_numerics_class_same_passes_over_a_node_of_another_class(rig, caplog):
    work, (x86, arm) = rig
    swarm = _swarm(work, [x86, arm], numerics_class="same")
    try:
        assert set(swarm.experts.clients) == {x86.address}
        assert "its numerics class is aarch64" in caplog.text
    finally:
        swarm.close()
    with pytest.raises(Exception, match="no swarm nodes found"):
        _swarm(work, [arm], numerics_class="same", wait=0.5)


@pytest.mark.slow
def test_another_class_is_checked_within_the_bound_and_caught_when_damaged(rig, tmp_path):
    """The ARM-class node's honest answers pass the bound (every answer of the prompt is checked); once
    its files are damaged it is banned, and the logits equal in-process bit for bit."""
    work, (x86, arm) = rig
    local = open_engine(work / "a.swarm", local=True, device="cpu")
    tokens = list(range(3, 15))
    expect = forward_one(local.model, tokens, local.model.new_state(), "cpu")
    local.close()
    for nodes in ([arm], [x86, arm]):
        swarm = _swarm(work, nodes, verify="all" if len(nodes) == 1 else "sample")
        try:
            got = checked_logits(swarm.model, tokens, swarm.model.new_state(), "cpu", swarm.checker)
            assert not swarm.checker.report.banned
            assert swarm.checker.classes[arm.address] == ARM
            assert torch.equal(got, expect)
        finally:
            swarm.close()
    layer_dir = work / "arm.swarm" / "experts" / str(DOWN_IN_PLACE)
    for path in sorted(layer_dir.glob("*.gguf")):
        flip_bytes(path, open_gguf(path).data_offset, mask=0x01)  # lowest bits: small, still far outside
    swarm = _swarm(work, [x86, arm])
    try:
        got = checked_logits(swarm.model, tokens, swarm.model.new_state(), "cpu", swarm.checker)
        assert set(swarm.checker.report.banned) == {arm.address}
        assert torch.equal(got, expect)
    finally:
        swarm.close()


def test_a_same_class_answer_one_ulp_off_is_caught_and_another_class_keeps_it(rig):
    """Bit for bit within a class: one unit in the last place of one element bans a node of this class; a
    node of another class is allowed that (its sums run in another order)."""
    from swarm.node.source import load_slabs
    from swarm.node.store import ExpertStore

    auditor = Auditor(
        ExpertStore(load_slabs(MODEL).slabs), "native", torch.float32, rate=0.0, background=False
    )
    auditor.classes.update({"same": numerics_class(), "other": ARM})
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5))
    right = auditor.expected(DOWN_IN_PLACE, [4], [3], x)
    off = right.clone()
    off[1, 7] = torch.nextafter(off[1, 7], torch.tensor(float("inf")))
    assert auditor.decide("other", DOWN_IN_PLACE, [4, 4, 4], x, off)
    assert not auditor.decide("same", DOWN_IN_PLACE, [4, 4, 4], x, off)
    far = right.clone()
    far[1, 7] += 0.05 * right.abs().max()
    assert not auditor.decide("other", DOWN_IN_PLACE, [4, 4, 4], x, far)
    assert set(auditor.report.banned) == {"same", "other"}
