"""`swarm node` that falsifies a share of its answers: bench/trust.py's liar, and tests/test_projection_swarm.py's.

    python bench/liar_node.py SHARE[:HOW[:WHEN]] node SOURCE [swarm node options]

Each Compute call is computed honestly, then, with probability SHARE (drawn by the node, per call), its
answer is falsified. HOW (default `scale`):
- scale: every row of the answer moved by 1 % of its own scale;
- tiny: every row scaled by (1 + 1e-4);
- one: one element of one row changed by 1e-2 of its row's largest value (the same element each time: a
  coordinator's r, drawn once, misses it with probability ~0.4 % at the fixtures' widths, and then every time);
- row: each row answered with the next row's answer (rows copied from another row);
- expert: every row computed through another expert of the layer (answers copied from another expert);
- replay: the previous call's answer given again where its shape fits;
- gate: the rows moved by 1e-3 before the experts see them: gate, up and the answer all consistent with each
  other, not with the rows sent.
WHEN (default `all`): `decode`: only calls of single rows (a decode step's; a prompt's and a probe's calls
are answered honestly); `prompt`: only calls of more than two rows (a prompt's; a probe's are two). The inner products are those of the falsified computation where there is one, else
honest. Everything else is the real node.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from swarm.compute.store import ExpertStore
from swarm.coordinator.cli import main

_honest = ExpertStore._compute
_rng = random.SystemRandom()
SHARE, HOW, WHEN = 0.0, "scale", "all"
_last: dict[tuple[int, ...], np.ndarray] = {}


def _other(self: ExpertStore, layer: int, expert: int) -> int:
    held = sorted(e for n, e in self.held() if n == layer and e != expert)
    return held[0] if held else expert


def _lying(
    self: ExpertStore,
    layer: int,
    ids: Sequence[int],
    counts: Sequence[int],
    rows: Any,
    numerics: Any,
    inner: Any,
) -> Any:
    lie = _rng.random() < SHARE and {
        "all": True, "decode": all(c == 1 for c in counts), "prompt": sum(counts) > 2
    }[WHEN]  # fmt: skip
    if lie and HOW == "gate":
        rows = np.asarray(rows, np.float32) * np.float32(1 + 1e-3)
    if lie and HOW == "expert":
        ids = [_other(self, layer, e) for e in ids]
    out = _honest(self, layer, ids, counts, rows, numerics, inner)
    if not lie or HOW in ("gate", "expert"):
        _last[tuple(out.shape)] = np.array(out, copy=True)
        return out
    if HOW == "scale":
        out = out + 0.01 * np.abs(out).max(axis=1, keepdims=True).clip(1e-6)
    elif HOW == "tiny":
        out = out * np.float32(1 + 1e-4)
    elif HOW == "one":
        out = np.array(out, copy=True)
        out[0, out.shape[1] // 2] += 1e-2 * max(float(np.abs(out[0]).max()), 1e-6)
    elif HOW == "row":
        out = np.roll(out, -1, axis=0) if out.shape[0] > 1 else out * np.float32(1.01)
    elif HOW == "replay":
        before = _last.get(tuple(out.shape))
        _last[tuple(out.shape)] = np.array(out, copy=True)
        out = before if before is not None else out * np.float32(1.01)
    return out


if __name__ == "__main__":
    share, *how = sys.argv[1].split(":")
    SHARE = float(share)
    HOW = how[0] if how else HOW
    WHEN = how[1] if len(how) > 1 else WHEN
    ExpertStore._compute = _lying  # type: ignore[method-assign]
    sys.exit(main(sys.argv[2:]))
