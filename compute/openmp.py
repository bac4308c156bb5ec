"""How a process's compute threads wait between parallel regions, decided before OpenMP is loaded.

torch and ggml share one GNU OpenMP runtime (the libgomp torch ships; see swarm.compute.ggml); a node, which
never loads torch, has ggml's alone. ggml runs a
graph as one parallel region and meets at an OpenMP barrier after every op; torch runs a region per op.
How long a thread that arrives first spins before it sleeps is libgomp's spin count (GOMP_SPINCOUNT;
OMP_WAIT_POLICY=PASSIVE makes it 0, the default is 300000 spins, ~ms).

- Experts in this process: OpenMP's default. The next op or region comes at once.
- A coordinator whose experts are remote: a brief spin (BRIEF_SPIN spins, tens of microseconds). Its
  threads catch every barrier of a graph while spinning (ops end microseconds apart: a sleeping thread
  would be woken through the kernel at each one) and sleep soon while the step waits on the nodes, whose
  cores they would take where nodes share the machine (a laptop that is coordinator and node at once,
  `swarm demo`, loopback benchmarks). Passive waiting makes the coordinator's threads slower per decode
  step than one thread; OpenMP's default spin keeps a core busy for milliseconds after each region
  (bench/threads.py --swarm, docs/BENCHMARKS.md).
- A node waits passively: it shares its device with whatever else runs there (apps on a phone, other
  nodes and the coordinator on a loopback rig), so a spinning thread whose partner was descheduled burns a
  whole time slice per op: beside one other busy process a decode step takes seconds instead of
  milliseconds when spinning.

A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT always wins. libgomp reads its environment once, when torch
or ggml loads it, so this must run before the first `import torch` or `import ggml`.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

WAIT_POLICY = "OMP_WAIT_POLICY"
SPIN_COUNT = "GOMP_SPINCOUNT"
BRIEF_SPIN = "1000"  # spins (each a pause instruction): tens of microseconds
# The variables above that swarm set (not the user): a swarm process started from this one (nodes of
# `swarm demo`, a benchmark's children) decides them again for its own role.
OURS = "SWARM_OPENMP_SET"


def _ours() -> set[str]:
    return {k for k in os.environ.get(OURS, "").split(",") if k}


def wait_policy_env(experts_remote: bool, node: bool = False) -> dict[str, str]:
    """The OpenMP settings for a coordinator process, or with `node` a node's, to merge into its
    environment (with OURS naming them); none where the user set their own."""
    ours = _ours()
    if any(k in os.environ and k not in ours for k in (WAIT_POLICY, SPIN_COUNT)):
        return {}
    if node:
        env = {WAIT_POLICY: "PASSIVE"}
    elif experts_remote:
        env = {SPIN_COUNT: BRIEF_SPIN}
    else:
        env = {}
    return {**env, OURS: ",".join(env)}


def set_wait_policy(experts_remote: bool, node: bool = False) -> None:
    """Apply `wait_policy_env` to this process; too late (a no-op, logged) once torch or ggml is imported."""
    loaded = [m for m in ("torch", "ggml") if m in sys.modules]
    if loaded:
        log.debug("%s already loaded: OpenMP keeps its wait policy", " and ".join(loaded))
        return
    env = wait_policy_env(experts_remote, node)
    if not env:
        return  # the user's own
    for k in _ours():
        os.environ.pop(k, None)  # a swarm parent's choice for its own role
    os.environ.update(env)
