"""deploy/netns_swarm.py: nodes in network namespaces of their own, found by real multicast mDNS across a
bridge, expert calls over rate-limited veth links; the answer is the in-process answer, word for word."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES

from swarm.sharding.shard import shard_model

SCRIPT = Path(__file__).resolve().parent.parent / "deploy" / "netns_swarm.py"


def _can_make_namespaces() -> str | None:
    """Why this machine cannot run the rig, or None when it can."""
    if sys.platform != "linux" or shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs Linux with iproute2 (ip, tc)"
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    probe = f"swarm-probe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None if made.returncode == 0 else "cannot create network namespaces here"


@pytest.mark.slow
def test_a_swarm_across_network_namespaces_answers_like_in_process(tmp_path):
    why = _can_make_namespaces()
    if why:
        pytest.skip(why)
    shard_dir = tmp_path / "m.swarm"
    shard_model(FIXTURES / "qwen3moe-tiny" / "model-f32.gguf", shard_dir)
    run = ["--prompt", "A list keeps items in order.", "--max-tokens", "12"]
    local = subprocess.run(
        [sys.executable, "-m", "swarm.coordinator.cli", "run", str(shard_dir), "--local", *run],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    tag = secrets.token_hex(2)
    subnet = f"10.77.{secrets.randbelow(200) + 20}"
    rig = subprocess.run(
        [sys.executable, str(SCRIPT), str(shard_dir), "--nodes", "4", "--replicas", "2", "--rate", "50mbit",
         "--tag", tag, "--subnet", subnet, "--", *run],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert rig.returncode == 0, rig.stdout + rig.stderr
    assert rig.stdout == local.stdout  # the answer text
    used = [ln for ln in rig.stderr.splitlines() if ln.strip().startswith(f"node {subnet}.")]
    assert len(used) == 4, rig.stderr  # every node, found by mDNS on the bridge, got calls
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"swarm-{tag}-" not in namespaces, "the rig removed its namespaces"
