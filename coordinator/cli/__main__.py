"""`python -m swarm.coordinator.cli ...`: the `swarm` command under a given Python (how launchers start nodes)."""

import sys

from swarm.coordinator.cli import main

sys.exit(main())
