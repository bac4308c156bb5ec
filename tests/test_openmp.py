"""OpenMP's wait, decided per role before torch loads: a brief spin for a coordinator of remote experts,
passive waiting for a node, OpenMP's default in process, and never over a user's own choice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.compute.openmp import BRIEF_SPIN, OURS, SPIN_COUNT, WAIT_POLICY, set_wait_policy, wait_policy_env


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for k in (WAIT_POLICY, SPIN_COUNT, OURS):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_each_role_gets_its_wait(clean_env: pytest.MonkeyPatch) -> None:
    assert wait_policy_env(experts_remote=True) == {SPIN_COUNT: BRIEF_SPIN, OURS: SPIN_COUNT}
    assert wait_policy_env(experts_remote=False) == {OURS: ""}
    assert wait_policy_env(experts_remote=True, node=True) == {WAIT_POLICY: "PASSIVE", OURS: WAIT_POLICY}


@pytest.mark.parametrize("var, value", [(WAIT_POLICY, "ACTIVE"), (SPIN_COUNT, "5")])
def test_a_users_own_setting_wins(clean_env: pytest.MonkeyPatch, var: str, value: str) -> None:
    clean_env.setenv(var, value)
    assert wait_policy_env(experts_remote=True) == {}
    assert wait_policy_env(experts_remote=True, node=True) == {}


PROBE = (
    "import os, sys\n"
    "from swarm.compute.openmp import set_wait_policy\n"
    "set_wait_policy(experts_remote=True, node=sys.argv[1] == 'node')\n"
    "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))\n"
)


def _probe(role: str, env: dict[str, str]) -> str:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, role], env=env, capture_output=True, text=True, check=True, timeout=60
    )
    return out.stdout.strip()


def test_set_before_torch_loads_and_a_child_decides_its_own_role() -> None:
    base = {k: v for k, v in os.environ.items() if k not in (WAIT_POLICY, SPIN_COUNT, OURS)}
    assert _probe("coordinator", base) == f"None {BRIEF_SPIN}"
    assert _probe("node", base) == "PASSIVE None"
    # A node started by a coordinator (swarm demo) inherits what the coordinator set: it is not the user's.
    coordinator = {**base, **wait_policy_env(experts_remote=True)}
    assert _probe("node", coordinator) == "PASSIVE None"
    # What the user set is passed on and kept.
    assert _probe("node", {**base, SPIN_COUNT: "7"}) == "None 7"


def test_too_late_once_torch_is_loaded(clean_env: pytest.MonkeyPatch) -> None:
    import torch  # noqa: F401

    set_wait_policy(experts_remote=True)
    assert SPIN_COUNT not in os.environ and WAIT_POLICY not in os.environ


# Through the real CLI: what OpenMP's variables hold at the moment torch or ggml is first imported (libgomp
# reads them then: a node loads it with ggml, never torch), for each command. Building the parser must load
# neither, or every command is too late.
AT_TORCH_IMPORT = (
    "import os, sys\n"
    "class AtTorch:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name in ('torch', 'ggml'):\n"
    "            print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), flush=True)\n"
    "            os._exit(0)\n"
    "sys.meta_path.insert(0, AtTorch())\n"
    "from swarm.coordinator.cli import main\n"
    "main(sys.argv[1:])\n"
    "print('torch never loaded')\n"
)


@pytest.mark.parametrize(
    "command, expected",
    [
        ("node {gguf} --no-mdns", "PASSIVE None"),
        ("run {gguf} --prompt hi", f"None {BRIEF_SPIN}"),
        ("run {gguf} --prompt hi --local", "None None"),
        ("serve {gguf} --no-mdns", f"None {BRIEF_SPIN}"),
        ("logits {gguf} --prompt hi -o {tmp}/logits.npy", f"None {BRIEF_SPIN}"),
        ("perplexity {gguf} {tmp}/text.txt --local", "None None"),
        ("demo --workdir {tmp}/demo", f"None {BRIEF_SPIN}"),
    ],
)
def test_every_command_sets_the_wait_before_torch_or_ggml_loads(
    command: str, expected: str, fixtures_dir: Path, tmp_path: Path
) -> None:
    gguf = f"{fixtures_dir}/qwen35moe-tiny/model-bf16.gguf"
    (tmp_path / "text.txt").write_text("some text\n")
    argv = command.format(gguf=gguf, tmp=tmp_path).split()
    env = {k: v for k, v in os.environ.items() if k not in (WAIT_POLICY, SPIN_COUNT, OURS)}
    out = subprocess.run(
        [sys.executable, "-c", AT_TORCH_IMPORT, *argv], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip().splitlines()[-1:] == [expected], out.stderr[-2000:]
