"""`swarm node` that reports another numerics class than its ggml build's: what an ARM phone's node says,
for tests on an x86 machine. Its answers are this machine's (they differ from the coordinator's in no bit),
so a coordinator that takes the claim checks them within the cross-class bound.

    python tests/class_node.py CLASS node SOURCE [swarm node options]
"""

from __future__ import annotations

import sys

import swarm.compute.numclass as numclass
import swarm.node.server as server
from swarm.coordinator.cli import main

if __name__ == "__main__":
    claimed = sys.argv[1]
    numclass.numerics_class = lambda: claimed  # type: ignore[assignment]
    server.numerics_class = lambda: claimed  # type: ignore[assignment]
    sys.exit(main(sys.argv[2:]))
