"""`swarm plan` at Qwen3.5-122B size: 48 layers x 256 experts of real slab size over 200 devices.

Times the planner (as `swarm plan` runs it, minus reading a manifest) and simulates the per-token load it
leads to: tokens are routed by synthetic skewed statistics (per layer, expert popularity ~ Zipf), each pair
goes to one holder of its expert the way the coordinator picks (rotating among holders), and the busiest
device's share of the pairs is compared with the mean. Two fleets: roomy (phones and laptops with 1-8 GiB
free, far more than two copies need) and tight (the same mix scaled to 1.15x of what two copies need).

    python bench/plan.py [--seed 0] [--tokens 4000] [--no-write]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _doc import publish  # noqa: E402

from swarm.sharding.plan import Device, Plan, plan  # noqa: E402

LAYERS, EXPERTS, K = 48, 256, 8
# Qwen3.5-122B-A10B at 4-bit: 12,544 slabs of about 5.3 MB (the "Phase 2" note); a mini-GGUF header on top
SLAB_BYTES = 5_300_000
DEVICES = 200
ZIPF = 1.1  # expert popularity within a layer ~ 1 / rank^ZIPF (a strongly skewed router)


def routing(rng: np.random.Generator) -> np.ndarray:
    """[L, E] selection probability of each expert (K per token), ranks shuffled per layer."""
    p = 1.0 / np.arange(1, EXPERTS + 1) ** ZIPF
    p /= p.sum()
    return np.stack([rng.permutation(p) for _ in range(LAYERS)])


def loads_of(probs: np.ndarray) -> dict[tuple[int, int], float]:
    """Expected selections per token: K draws without replacement ~ min(1, K * p) renormalized to K."""
    out = {}
    for layer in range(LAYERS):
        r = np.minimum(1.0, K * probs[layer])
        r *= K / r.sum()
        for e in range(EXPERTS):
            out[(layer, e)] = float(min(1.0, r[e]))
    return out


def simulate(result: Plan, probs: np.ndarray, tokens: int, rng: np.random.Generator) -> tuple[float, float]:
    """(busiest / mean, the plan's own expected busiest / mean) of pairs per device over `tokens` tokens."""
    index = {a.device.name: i for i, a in enumerate(result.nodes)}
    holders = {k: [index[n] for n in v] for k, v in result.holders.items()}
    pairs = np.zeros(len(result.nodes))
    for turn in range(1, tokens + 1):  # one call per layer and token: each layer's turn counts up by one
        for layer in range(LAYERS):
            for e in rng.choice(EXPERTS, size=K, replace=False, p=probs[layer]):
                hs = holders[(layer, int(e))]
                pairs[hs[(layer * 31 + int(e) + turn) % len(hs)]] += 1
    expected = np.array([a.load for a in result.nodes])
    return float(pairs.max() / pairs.mean()), float(expected.max() / expected.mean())


def fleet(rng: random.Random, scale: float = 1.0) -> list[Device]:
    sizes = [1, 2, 2, 3, 4, 4, 6, 8]  # GiB free on phones, tablets and laptops
    return [Device(f"d{i:03d}", int(rng.choice(sizes) * scale * 2**30)) for i in range(DEVICES)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--reps", type=int, default=3, help="timed planner runs (median)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    probs = routing(rng)
    loads = loads_of(probs)
    slabs = {(layer, e): SLAB_BYTES for layer in range(LAYERS) for e in range(EXPERTS)}
    need = 2 * sum(slabs.values())
    roomy = fleet(random.Random(args.seed))
    scale = 1.15 * need / sum(d.capacity for d in roomy)
    tight = [Device(d.name, int(d.capacity * scale)) for d in roomy]

    rows = []
    for name, devices in (("roomy", roomy), ("tight (1.15x of two copies)", tight)):
        seconds = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            result = plan(slabs, devices, 2, loads)
            seconds.append(time.perf_counter() - t0)
        lo, mean = result.replicas()
        sim, expect = simulate(result, probs, args.tokens, rng)
        fill = sum(a.bytes for a in result.nodes) / sum(d.capacity for d in devices)
        rows.append((name, sum(d.capacity for d in devices), statistics.median(seconds), lo, mean,
                     max(len(h) for h in result.holders.values()), fill, expect, sim))  # fmt: skip
        print(f"{name}: {statistics.median(seconds):.2f} s, replicas min {lo} mean {mean:.2f}, busiest/mean "
              f"expected {expect:.2f} simulated {sim:.2f}", file=sys.stderr)  # fmt: skip

    cmd = "python bench/plan.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        "<!-- bench:plan -->",
        "## Planning a Qwen3.5-122B-sized swarm (`bench/plan.py`)",
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {platform.machine()}, 2 cores, Python {platform.python_version()}; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.  ",
        f"Table: {LAYERS} layers x {EXPERTS} experts = {len(slabs):,} slabs of {SLAB_BYTES / 1e6:.1f} MB "
        f"({sum(slabs.values()) / 2**30:.1f} GiB), --replicas 2, over {DEVICES} devices with 1-8 GiB free each "
        f"(seeded). Routing statistics: per layer, expert popularity ~ 1/rank^{ZIPF} (the hottest expert picked "
        f"{max(loads.values()):.2f} times per token, the median {statistics.median(loads.values()):.3f}). "
        f"Simulated load: {args.tokens:,} tokens, {K} experts per layer each drawn from those statistics, each pair "
        "sent to one holder the way the coordinator picks (rotating among holders). Planner time: median of "
        f"{args.reps} runs of the planning function (`swarm plan` adds reading the manifest).",
        "",
        "| fleet | capacity | plan time | replicas min / mean / max | memory used | busiest device vs mean, expected | simulated |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for name, cap, sec, lo, mean, hi, fill, expect, sim in rows:
        lines.append(f"| {name} | {cap / 2**30:.0f} GiB | {sec:.2f} s | {lo} / {mean:.2f} / {hi} | {100 * fill:.0f}% | "
                     f"{expect:.2f}x | {sim:.2f}x |")  # fmt: skip
    lines.append("<!-- /bench:plan -->")
    publish("plan", "\n".join(lines), not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
