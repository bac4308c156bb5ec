"""How a process's compute threads wait between parallel regions, decided before torch is loaded.

torch and ggml share one GNU OpenMP runtime (the libgomp torch ships; see swarm.node.kernels).

torch's CPU build runs its parallel regions on GNU OpenMP, whose idle threads spin for a while after each
region before they sleep. With the experts in this process that costs nothing: the next region comes at
once. With the experts on nodes, the coordinator waits on the network for most of every MoE layer, and the
spinning threads take the cores that nodes on the same machine (a laptop that is coordinator and node at
once, `swarm demo`, loopback benchmarks) need to answer it: measured on 2 cores with 4 loopback nodes,
swarm decode went from 0.70x to 0.91x of in-process by letting the threads sleep, while in-process prefill
lost a quarter with the same setting. So: passive waiting when the experts are remote, OpenMP's default
otherwise, and a user's own OMP_WAIT_POLICY always wins.

A node waits passively too: it shares its device with whatever else runs there (apps on a phone, other nodes
and the coordinator on a loopback rig), and ggml's threads meet at a barrier after every op, so a spinning
thread whose partner was descheduled burns a whole time slice per op: measured on 2 cores with one other
busy process, a decode step of the 35B layer shape took seconds instead of 20 ms when spinning, 56 ms
waiting passively.

libgomp reads its environment once, when torch loads it, so this must run before the first `import torch`.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

WAIT_POLICY = "OMP_WAIT_POLICY"


def wait_policy_env(experts_remote: bool) -> dict[str, str]:
    """The OpenMP settings for a coordinator process (to merge into its environment)."""
    if experts_remote and WAIT_POLICY not in os.environ:
        return {WAIT_POLICY: "PASSIVE"}
    return {}


def set_wait_policy(experts_remote: bool) -> None:
    """Apply `wait_policy_env` to this process; too late (a no-op, logged) once torch is imported."""
    env = wait_policy_env(experts_remote)
    if not env:
        return
    if "torch" in sys.modules:
        log.debug("torch is already loaded: OpenMP keeps its wait policy")
        return
    os.environ.update(env)
