"""A node without torch: where importing torch fails, `swarm node` (and the other node-side commands) run, and
a node's answers equal in-process bit for bit; the coordinator's commands say what to install instead of
failing with a traceback; the plain install resolves to no torch at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from swarm.compute.slabs import load_slabs
from swarm.compute.store import ExpertStore
from swarm.coordinator.cli.spawn import SWARM_CLI, start_nodes, stop_nodes
from swarm.node.client import NodeClient
from swarm.proto.numerics import Numerics
from swarm.sharding.shard import shard_model

ROOT = Path(__file__).resolve().parent.parent
QUANT = ROOT / "tests" / "fixtures" / "qwen35moe-quant" / "model-q4_k_m.gguf"  # Q4_K / Q6_K / Q8_0 experts
TINY = ROOT / "tests" / "fixtures" / "qwen3moe-tiny" / "model-f32.gguf"


@pytest.fixture(scope="module")
def no_torch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An environment where `import torch` fails as it does where torch is not installed."""
    shadow = tmp_path_factory.mktemp("no-torch")
    (shadow / "torch").mkdir()
    (shadow / "torch" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n"
    )
    return {"PYTHONPATH": os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


def swarm(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *SWARM_CLI, *args], env={**os.environ, **env}, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def test_the_shadow_really_hides_torch(no_torch):
    done = subprocess.run([sys.executable, "-c", "import torch"], env={**os.environ, **no_torch},
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode != 0 and "No module named 'torch'" in done.stderr


def mapped_libraries(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("form", ["gguf", "shard"])
def test_a_node_without_torch_answers_bit_for_bit_as_in_process(tmp_path, no_torch, form):
    """Native and exact numerics, every wire type: a GGUF's stacked experts (one mul_mat_id) and a shard
    directory's slab files (per-expert graphs, repacked Q4_K copies, float32 working copies for exact)."""
    source = QUANT
    if form == "shard":
        source = tmp_path / "m.swarm"
        shard_model(QUANT, source)
    (node,) = start_nodes([(source, ["--experts", "0-7", "--no-mdns"])], tmp_path / "nodes", env=no_torch)
    try:
        assert "libtorch" not in mapped_libraries(node.process.pid)
        client = NodeClient(node.address, fingerprint=node.fingerprint, key=None)
        store = ExpertStore(load_slabs(source).slabs)
        rng = np.random.default_rng(7)
        ids, counts = [0, 3, 5, 7], [3, 1, 4, 2]
        for layer in (0, 3):
            for wire in (torch.float32, torch.float16, torch.bfloat16):
                for numerics in (Numerics.NATIVE, Numerics.EXACT):
                    rows = torch.from_numpy(rng.standard_normal((10, 256)).astype(np.float32)).to(wire)
                    got = client.compute(layer, ids, counts, rows, 60.0, numerics=numerics)
                    want = store.compute(layer, ids, counts, rows, numerics).to(wire)
                    assert got.dtype == wire
                    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (layer, wire, numerics)
        client.close()
        assert "libtorch" not in mapped_libraries(node.process.pid)
    finally:
        assert stop_nodes([node]) == [0]


@pytest.mark.slow
def test_the_node_side_commands_run_without_torch_and_the_coordinator_says_what_to_install(tmp_path, no_torch):
    out = tmp_path / "m.swarm"
    done = swarm(["shard", str(TINY), "-o", str(out)], no_torch)
    assert done.returncode == 0, done.stderr
    for args in (
        ["inspect", str(out)],
        ["keygen", "--out", str(tmp_path / "k.key")],
        ["plan", str(out), "--capacities", "4MiB,4MiB", "--replicas", "1"],
        ["node", "--help"],
    ):
        done = swarm(args, no_torch)
        assert done.returncode == 0, (args, done.stderr)
        assert "Traceback" not in done.stderr
    (node,) = start_nodes([(out, ["--experts", "0-31", "--no-mdns"])], tmp_path / "nodes", env=no_torch)
    try:
        done = swarm(["status", "--no-mdns", "--peer", node.address, "--json", str(out)], no_torch)
        assert done.returncode == 0, done.stderr
        status = json.loads(done.stdout)
        assert [n["address"] for n in status["nodes"]] == [node.address]
        assert "not probed" in done.stderr and "swarm-moe[coordinator]" in done.stderr
        fetch_args = ["--fetch", "--experts", "0-3", "--no-mdns", "--peer", node.address]
        (fetched,) = start_nodes([(tmp_path / "empty", fetch_args)], tmp_path / "fetched", env=no_torch)
        try:  # it serves each slab as soon as it has fetched and verified it
            with NodeClient(fetched.address, key=None) as client:
                deadline = time.monotonic() + 60
                while len(client.info().held) < 16:
                    assert time.monotonic() < deadline, "the fetching node did not get its 16 slabs in 60 s"
                    time.sleep(0.1)
            assert "libtorch" not in mapped_libraries(fetched.process.pid)
        finally:
            assert stop_nodes([fetched]) == [0]
    finally:
        stop_nodes([node])
    done = swarm(["run", str(out), "--prompt", "hi", "--max-tokens", "2", "--local"], no_torch)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "pip install 'swarm-moe[coordinator]'" in done.stderr


@pytest.mark.slow
def test_the_plain_install_pulls_no_torch(tmp_path):
    """pip's own resolver on this checkout, as a user on a board would install a node (`pip install .`)."""
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report",
         str(report), str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    names = {i["metadata"]["name"].lower().replace("_", "-") for i in json.loads(report.read_text())["install"]}
    assert {"swarm-moe", "ggml-python", "numpy", "grpcio", "zeroconf"} <= names
    assert not {n for n in names if n == "torch" or n.startswith(("nvidia-", "triton"))}, names
