"""`swarm node` whose Compute calls answer zeros without multiplying anything: bench/decode.py's transport floor.

    python bench/zero_node.py node SOURCE [swarm node options]

Everything else is the real node (slabs opened, the call checked, decoded, answered and encoded, the same
gRPC server and client): a swarm decode step through such nodes costs what the coordinator and the transport
cost with no expert compute at all. Its tokens are not the model's (every routed expert adds zero); the
benchmark says so and never compares them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from swarm.compute.store import ExpertStore
from swarm.coordinator.cli import main


def _zeros(self: ExpertStore, layer: int, ids: Sequence[int], counts: Sequence[int], rows: torch.Tensor,
           *_: object) -> torch.Tensor:  # fmt: skip
    """ExpertStore.compute's checks (held slabs, counts, shapes), then zeros instead of the products."""
    self.check(layer, ids, counts, rows)
    return torch.zeros(rows.shape, dtype=torch.float32)


def _zeros_inner(self: ExpertStore, layer: int, ids: Sequence[int], counts: Sequence[int], rows: torch.Tensor,
                 *_: object) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """ExpertStore.compute_inner's checks, then zeros for the answer and its gate and up products."""
    widths = {self.ffn_width(layer, e) for e, n in zip(ids, counts, strict=True) if n}
    return _zeros(self, layer, ids, counts, rows), torch.zeros(rows.shape[0], 2 * max(widths, default=0))


if __name__ == "__main__":
    ExpertStore.compute = _zeros  # type: ignore[method-assign]
    ExpertStore.compute_inner = _zeros_inner  # type: ignore[method-assign]
    sys.exit(main(sys.argv[1:]))
