"""The swarm as data: each node, the coverage of the model's slabs by live holders, and how often each
(layer, expert) is used. One structure for `swarm status --json` and `swarm serve`'s /swarm page and its
/swarm.json, built here so that the two cannot drift apart.

    {"model": ..., "nodes": [node_record ...], "coverage": [per layer: slabs with 0 / 1 / 2+ holders],
     "grid": {"layers": [...], "experts": E, "holders": [[live holders of each expert] per layer]},
     "routing": {"source": "router" | "nodes", "counts": [[uses of each expert] per layer]} or None}

`swarm serve` adds what only a server knows (its slots, requests, tokens/s history) beside these keys.
Nothing here imports torch: `swarm status` runs on a node's install.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from swarm.sharding.errors import UserError
from swarm.sharding.ranges import format_slabs
from swarm.sharding.slabs import SlabKey

# A node's state as the page colours it: up (takes calls), backoff (a call failed: passed over for a while),
# banned (caught answering wrong), down (does not answer), left (said goodbye / holds nothing now).
STATES = ("up", "backoff", "banned", "down", "left")


def node_record(
    address: str,
    info: Any,
    stats: Any,
    *,
    answering: bool = True,
    error: str | None = None,
    state: str | None = None,
    answers: str = "-",
    banned_because: str | None = None,
    audits_passed: int | None = None,
    recent: tuple[float, float | None] | None = None,
    layer_bytes: Mapping[int, int] | None = None,
) -> dict[str, Any]:
    """One node: `info` and `stats` are its Info and Stats replies (the last ones known; None: never read).
    `recent`: (calls per second, ms per call) over the last interval watched; without it the rate is taken
    over the node's uptime and the recent ms per call is not known. `layer_bytes`: one slab's bytes per layer,
    for the memory its slabs take."""
    if state is None:
        state = "banned" if banned_because else ("up" if answering else "down")
    held = sorted(info.held) if info is not None else []
    rec: dict[str, Any] = {
        "address": address,
        "answering": answering,
        "error": error,
        "state": state,
        "name": info.name if info is not None else None,
        "fingerprint": info.fingerprint if info is not None else None,
        "held": format_slabs(held) if info is not None else None,
        "slabs": len(held) if info is not None else None,
        "held_bytes": sum(layer_bytes.get(layer, 0) for layer, _ in held) if layer_bytes else None,
        "device": info.device if info is not None else None,
        "numerics_class": info.numerics_class if info is not None else None,  # "" from an older node
        "memory_budget_bytes": info.memory_budget_bytes if info is not None else None,
        "answers": answers,
        "banned_because": banned_because,
        "audits_passed": audits_passed,
    }
    rec.update(_stats_fields(stats, recent))
    if not answering:  # its last Stats say what it did, not what it does now
        rec.update(calls_per_second=None, ms_per_call_recent=None)
    return rec


def _stats_fields(stats: Any, recent: tuple[float, float | None] | None) -> dict[str, Any]:
    if stats is None:
        keys = ("calls", "rows", "errors", "in_flight", "load", "ms_per_call", "calls_per_second",
                "ms_per_call_recent", "cache_hit_rate", "cache_bytes", "busy_seconds", "uptime_seconds",
                "dropped", "dropped_slabs")  # fmt: skip
        return dict.fromkeys(keys)
    lookups = stats.cache_hits + stats.cache_misses
    up = stats.uptime_seconds
    return {
        "calls": stats.calls,
        "rows": stats.rows,
        "errors": stats.errors,
        "in_flight": stats.in_flight,
        "load": stats.busy_seconds / up if up > 0 else 0.0,
        "ms_per_call": 1e3 * stats.busy_seconds / stats.calls if stats.calls else None,
        "calls_per_second": recent[0] if recent is not None else (stats.calls / up if up > 0 else 0.0),
        "ms_per_call_recent": recent[1] if recent is not None else None,
        "cache_hit_rate": stats.cache_hits / lookups if lookups else None,
        "cache_bytes": stats.cache_bytes,  # the node's dequantized working copies
        "busy_seconds": stats.busy_seconds,
        "uptime_seconds": up,
        "dropped": format_slabs(stats.dropped),  # slabs whose files failed the node's own check
        "dropped_slabs": len(stats.dropped),
    }


def recent_rates(before: Any, after: Any, seconds: float) -> tuple[float, float | None]:
    """(calls per second, ms per call) between two Stats replies of one node `seconds` apart."""
    calls = max(0, after.calls - before.calls)
    busy = max(0.0, after.busy_seconds - before.busy_seconds)
    return (calls / seconds if seconds > 0 else 0.0, 1e3 * busy / calls if calls else None)


def coverage(needed: Iterable[SlabKey], holders: Mapping[SlabKey, int]) -> list[dict[str, int]]:
    """Per layer: how many of its slabs have 0, 1 and 2+ live (not banned) holders."""
    by_layer: dict[int, list[int]] = {}
    for layer, expert in needed:
        by_layer.setdefault(layer, [0, 0, 0])[min(2, holders.get((layer, expert), 0))] += 1
    return [
        {"layer": layer, "none": c[0], "one": c[1], "two_or_more": c[2]}
        for layer, c in sorted(by_layer.items())
    ]


def layer_grid(
    needed: Iterable[SlabKey], value: Mapping[SlabKey, int]
) -> tuple[list[int], int, list[list[int]]]:
    """(layers, experts per row, [[value of each (layer, expert)] per layer]); -1 where a layer has no such
    expert."""
    keys = sorted(set(needed))
    layers = sorted({layer for layer, _ in keys})
    width = 1 + max((e for _, e in keys), default=-1)
    row = {layer: i for i, layer in enumerate(layers)}
    cells = [[-1] * width for _ in layers]
    for layer, expert in keys:
        cells[row[layer]][expert] = int(value.get((layer, expert), 0))
    return layers, width, cells


def routing_from_nodes(stats: Iterable[Any]) -> Counter[SlabKey]:
    """Rows each (layer, expert) got, summed over the nodes' Stats (their per-expert counts): how busy each
    expert is, as its holders saw it (probes and hedged calls included)."""
    total: Counter[SlabKey] = Counter()
    for s in stats:
        if s is not None:
            for key, (_calls, rows) in s.experts.items():
                total[key] += rows
    return total


def snapshot(
    model: str | None,
    nodes: list[dict[str, Any]],
    needed: Iterable[SlabKey],
    holders: Mapping[SlabKey, int],
    routing: Mapping[SlabKey, int] | None = None,
    routing_source: str = "nodes",
) -> dict[str, Any]:
    """The structure both `swarm status --json` and /swarm.json give (see the module docstring)."""
    needed = sorted(set(needed))
    layers, width, cells = layer_grid(needed, holders)
    out: dict[str, Any] = {
        "model": model,
        "nodes": nodes,
        "coverage": coverage(needed, holders),
        "grid": {"layers": layers, "experts": width, "holders": cells},
        "routing": None,
    }
    if routing:
        out["routing"] = {"source": routing_source, "counts": layer_grid(needed, routing)[2]}
    return out


def layer_slab_bytes(path: str | Path) -> dict[int, int]:
    """Bytes one expert's slab takes in each MoE layer (its tensors' bytes as stored), from a shard
    directory's manifest or a GGUF's tensor table; {} when neither can be read."""
    from swarm.sharding.gguf_io import expert_tensors, open_gguf
    from swarm.sharding.manifest import read_manifest

    per_layer: dict[int, int] = {}
    try:
        p = Path(path)
        if p.is_dir():
            for t in read_manifest(p).expert_tensors:
                per_layer[t.layer] = per_layer.get(t.layer, 0) + t.slab_bytes
        else:
            for et in expert_tensors(open_gguf(p), p):
                per_layer[et.layer] = per_layer.get(et.layer, 0) + et.slab_bytes
    except (OSError, ValueError, UserError):
        return {}
    return per_layer
