"""`swarm node` that falsifies a share of its answers: bench/trust.py's liar.

    python bench/liar_node.py SHARE node SOURCE [swarm node options]

Each Compute call is answered honestly, then, with probability SHARE (drawn by the node, per call), every
row of the answer is moved by 1 % of its own scale: a node that lies on some answers and not others, so that
nobody can tell from one answer which kind it is. Everything else is the real node.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence

import torch

from swarm.compute.store import ExpertStore
from swarm.coordinator.cli import main

_honest = ExpertStore.compute
_rng = random.SystemRandom()
SHARE = 0.0


def _sometimes_wrong(
    self: ExpertStore,
    layer: int,
    ids: Sequence[int],
    counts: Sequence[int],
    rows: torch.Tensor,
    *rest: object,
) -> torch.Tensor:
    out = _honest(self, layer, ids, counts, rows, *rest)  # type: ignore[arg-type]
    if _rng.random() < SHARE:
        out = out + 0.01 * out.abs().amax(dim=1, keepdim=True).clamp_min(1e-6)
    return out


if __name__ == "__main__":
    SHARE = float(sys.argv[1])
    ExpertStore.compute = _sometimes_wrong  # type: ignore[method-assign]
    sys.exit(main(sys.argv[2:]))
