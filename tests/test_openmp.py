"""The coordinator's OpenMP wait policy: passive only when the experts are remote, never over a user's choice."""

from __future__ import annotations

import os
import subprocess
import sys

from swarm.node.openmp import WAIT_POLICY, set_wait_policy, wait_policy_env


def test_remote_experts_get_passive_waiting_local_ones_keep_the_default(monkeypatch):
    monkeypatch.delenv(WAIT_POLICY, raising=False)
    assert wait_policy_env(experts_remote=True) == {WAIT_POLICY: "PASSIVE"}
    assert wait_policy_env(experts_remote=False) == {}


def test_a_users_own_policy_wins(monkeypatch):
    monkeypatch.setenv(WAIT_POLICY, "ACTIVE")
    assert wait_policy_env(experts_remote=True) == {}


def test_set_before_torch_loads_and_not_after(monkeypatch):
    code = (
        "import os, sys\n"
        "from swarm.node.openmp import set_wait_policy\n"
        "set_wait_policy(experts_remote=True)\n"
        "print(os.environ.get('OMP_WAIT_POLICY'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != WAIT_POLICY}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "PASSIVE"
    # In this process torch is loaded already: changing the variable now would only mislead.
    import torch  # noqa: F401

    monkeypatch.delenv(WAIT_POLICY, raising=False)
    set_wait_policy(experts_remote=True)
    assert WAIT_POLICY not in os.environ
