"""Numerics classes: every node says which class its ggml build computes in (Info, mDNS, `swarm status`);
answers of the coordinator's class are checked bit for bit, of another class within the kernels' error
bound (swarm.coordinator.checks.tolerance); `--numerics-class same` takes only nodes of the coordinator's class.
Nodes of another class are real node processes that report an ARM class (tests/class_node.py); answers
recorded on real ARM builds are in test_arm_answers below."""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FIXTURES, flip_bytes

from swarm.compute.numclass import class_of, numerics_class, same_class
from swarm.coordinator.checks.audit import Auditor
from swarm.coordinator.cli import main
from swarm.coordinator.cli.spawn import start_nodes, stop_nodes
from swarm.coordinator.config import EngineConfig, Verify
from swarm.coordinator.decode.one import checked_logits, forward_one
from swarm.coordinator.engine import open_engine
from swarm.node.auth import KEY_ENV, SwarmKey, generate_key_text
from swarm.node.client import NodeClient
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
        work / "a.swarm", EngineConfig(peers=tuple(n.address for n in nodes), mdns=False, device="cpu", key=KEY, **kw))


def test_numerics_class_same_passes_over_a_node_of_another_class(rig, caplog):
    work, (x86, arm) = rig
    swarm = _swarm(work, [x86, arm], same_class_only=True)
    try:
        assert set(swarm.experts.clients) == {x86.address}
        assert "its numerics class is aarch64" in caplog.text
    finally:
        swarm.close()
    with pytest.raises(Exception, match="no swarm nodes found"):
        _swarm(work, [arm], same_class_only=True, wait=0.5)


@pytest.mark.slow
def test_another_class_is_checked_within_the_bound_and_caught_when_damaged(rig, tmp_path):
    """The ARM-class node's honest answers pass the bound (every answer of the prompt is checked); once
    its files are damaged it is banned, and the logits equal in-process bit for bit."""
    work, (x86, arm) = rig
    local = open_engine(work / "a.swarm", EngineConfig(local=True, device="cpu"))
    tokens = list(range(3, 15))
    expect = forward_one(local.model, tokens, local.model.new_state(), "cpu")
    local.close()
    for nodes in ([arm], [x86, arm]):
        swarm = _swarm(work, nodes, verify=Verify.ALL if len(nodes) == 1 else Verify.SAMPLE)
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
    from swarm.compute.slabs import load_slabs
    from swarm.compute.store import ExpertStore

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


RECORDED = sorted((FIXTURES / "numerics").glob("*.npz"))


def _recorded(path: Path) -> tuple[dict, dict]:
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    return json.loads(str(arrays.pop("meta"))), arrays


def _their_gguf(meta: dict) -> Path:
    for p in FIXTURES.rglob(meta["gguf"]):
        if hashlib.sha256(p.read_bytes()).hexdigest() == meta["gguf_sha256"]:
            return p
    raise AssertionError(f"no fixture GGUF {meta['gguf']} with SHA-256 {meta['gguf_sha256'][:12]}")


def test_answers_recorded_on_real_arm_builds_are_there():
    builds = {_recorded(p)[0]["build"] for p in RECORDED}
    assert len(builds) >= 2, f"answers of at least two ARM builds in tests/fixtures/numerics: {builds}"


@pytest.mark.parametrize("path", RECORDED, ids=[p.stem for p in RECORDED])
def test_arm_answers_pass_the_bound_and_damaged_ones_never_do(path):
    """Answers a real arm64 ggml build computed (tests/fixtures/numerics/README.md): an honest one is never
    banned by an x86 coordinator although its bits differ; the answers of a copy with 1 % of the bytes of
    each expert's slabs bit-flipped always are; and a node claiming the coordinator's own class is held to
    every bit."""
    meta, a = _recorded(path)
    feats = meta["ggml_features"]
    cls = class_of(meta["machine"], {k: bool(v) for k, v in feats.items()}, "ggml-python " + meta["ggml_python"],
                   int(feats.get("sve_cnt", 0)))  # fmt: skip
    assert cls.startswith("aarch64 ") and not same_class(cls, numerics_class())
    from swarm.compute.slabs import load_slabs
    from swarm.compute.store import ExpertStore

    auditor = Auditor(
        ExpertStore(load_slabs(_their_gguf(meta)).slabs), "native", torch.float32, rate=0.0, background=False
    )
    experts = [int(e) for e, n in zip(a["expert_ids"], a["counts"], strict=True) for _ in range(int(n))]
    differing = 0
    for i, layer in enumerate(int(x) for x in a["layers"]):
        rows = torch.from_numpy(a["rows"][i])
        honest, damaged = torch.from_numpy(a["answers"][i]), torch.from_numpy(a["damaged_answers"][i])
        for name, c in (("arm", cls), ("arm-damaged", cls), ("claims-mine", numerics_class())):
            auditor.classes[f"{name}-{layer}"] = c
        ours = auditor.expected(layer, [int(e) for e in a["expert_ids"]], [int(n) for n in a["counts"]], rows)
        differing += int((ours != honest).sum())
        assert auditor.decide(f"arm-{layer}", layer, experts, rows, honest), auditor.report.banned
        assert not auditor.decide(f"arm-damaged-{layer}", layer, experts, rows, damaged)
        if not torch.equal(ours, honest):
            assert not auditor.decide(f"claims-mine-{layer}", layer, experts, rows, honest)
    if meta["build"] != "x86":
        assert differing, "this build's answers equal the coordinator's: the test shows nothing about order"
