"""`swarm node` that speaks another swarm protocol version: what a device left on an older release runs, for
tests of a coordinator meeting one. It says the version in its Info and mDNS record and refuses calls of any
other, as that release's node does.

    python tests/old_node.py VERSION node SOURCE [swarm node options]
"""

from __future__ import annotations

import sys

import swarm.node.discovery as discovery
import swarm.node.server as server
from swarm.coordinator.cli import main

if __name__ == "__main__":
    version = int(sys.argv[1])
    server.PROTOCOL_VERSION = version  # type: ignore[misc]
    discovery.PROTOCOL_VERSION = version  # type: ignore[misc]
    sys.exit(main(sys.argv[2:]))
