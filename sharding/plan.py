"""Placement: which devices hold which (layer, expert) slabs, within their capacities, with replicas.

Every slab goes on `replicas` distinct devices; then, while memory is left, the hottest slabs (by the
routing statistics: how often the router picks each expert) get more holders. Replicas share an expert's
work equally (the coordinator rotates among its holders), so a device's expected share of the per-token
load is the sum over its slabs of load / holders. The greedy places the heaviest slabs first, each on the
device with the least load so far that has room (LPT scheduling under a capacity bound), and then adds
holders to the slabs that keep the busiest device busiest.
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from swarm.sharding.errors import UserError
from swarm.sharding.slabs import SlabKey

# A slab gets at most this many holders more than --replicas (hot experts): past that the load is spread.
MAX_EXTRA_REPLICAS = 6
# Rebalancing stops once the busiest device carries at most this much more than the mean.
BALANCED = 1.02


@dataclass(frozen=True)
class Device:
    name: str
    capacity: int  # bytes of slabs it may hold


@dataclass
class Assignment:
    device: Device
    slabs: set[SlabKey] = field(default_factory=set)
    bytes: int = 0
    load: float = 0.0  # expected share of the per-token expert work (filled in by `plan`)


@dataclass
class Plan:
    nodes: list[Assignment]
    holders: dict[SlabKey, list[str]]
    loads: dict[SlabKey, float]

    def replicas(self) -> tuple[int, float]:
        counts = [len(h) for h in self.holders.values()]
        return min(counts), sum(counts) / len(counts)


def uniform_loads(slabs: Mapping[SlabKey, int], n_expert_used: int, n_expert: int) -> dict[SlabKey, float]:
    """Without statistics: every expert of a layer equally likely (K of E per token)."""
    return {k: n_expert_used / n_expert for k in slabs}


def loads_from_stats(
    path: str | Path, slabs: Mapping[SlabKey, int], n_expert_used: int, n_expert: int
) -> dict[SlabKey, float]:
    """Per-token selection rates from a `--stats` file ({"tokens": N, "counts": {"L:E": n}}); experts never
    seen get a small floor so that they still spread."""
    try:
        data = json.loads(Path(path).read_text())
        tokens = int(data["tokens"])
        counts = {tuple(int(x) for x in k.split(":")): int(v) for k, v in data["counts"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{path}: not a routing statistics file from `swarm run --stats` ({e})") from None
    if tokens <= 0:
        raise UserError(f"{path}: records no tokens; run some prompts with --stats first")
    floor = 0.1 * n_expert_used / n_expert
    return {k: max(floor, counts.get(k, 0) / tokens) for k in slabs}


def plan(
    slabs: Mapping[SlabKey, int],
    devices: Sequence[Device],
    replicas: int,
    loads: Mapping[SlabKey, float],
) -> Plan:
    """Assign every slab (size in bytes) to `replicas` distinct devices, hot ones to more (see the module)."""
    if replicas < 1:
        raise UserError("--replicas must be at least 1")
    if replicas > len(devices):
        raise UserError(f"--replicas {replicas} needs at least {replicas} devices; {len(devices)} given")
    need = sum(slabs.values()) * replicas
    have = sum(d.capacity for d in devices)
    if need > have:
        raise UserError(
            f"the plan does not fit: {replicas} x {_gib(sum(slabs.values()))} of slabs = {_gib(need)}, but the "
            f"devices hold {_gib(have)} in all: short by {_gib(need - have)}; add devices or capacity, or "
            "lower --replicas"
        )
    nodes = [Assignment(d) for d in devices]
    holders: dict[SlabKey, list[int]] = {k: [] for k in slabs}
    order = sorted(slabs, key=lambda k: (-loads[k], -slabs[k], k))
    # Each device's fair part of the work: the bytes it would hold if they were spread as evenly as the
    # capacities allow (a water level); load is balanced relative to that, so big devices are not left
    # with all the room at the end and small ones are not overfilled.
    target = _water_level([d.capacity for d in devices], need)
    heap = [(0.0, -d.capacity, i) for i, d in enumerate(devices)]  # (load / target, -room, device)
    heapq.heapify(heap)
    for key in order:
        size, share = slabs[key], loads[key] / replicas
        for _ in range(replicas):
            best = _pop_least_loaded(heap, nodes, size, exclude=holders[key])
            if best is None:
                best = _make_room(nodes, holders, slabs, loads, key)
                if best is not None:  # two devices changed: order them all again (the end of a tight plan)
                    heap = [
                        (a.load / target[i], -(a.device.capacity - a.bytes), i)
                        for i, a in enumerate(nodes)
                        if i != best
                    ]
                    heapq.heapify(heap)
            if best is None:
                short = size * (replicas - len(holders[key]))
                raise UserError(
                    f"the plan does not fit: slab {key[0]}:{key[1]} ({_gib(size)}) finds no device with room "
                    f"for replica {len(holders[key]) + 1} of {replicas} (short by at least {_gib(short)} where "
                    "it is needed); add devices or capacity, or lower --replicas"
                )
            _put(nodes[best], key, size, share)
            holders[key].append(best)
            heapq.heappush(
                heap, (nodes[best].load / target[best], -(devices[best].capacity - nodes[best].bytes), best)
            )
    _replicate_hot(nodes, holders, slabs, loads)
    _spread_hot(nodes, holders, slabs, loads, replicas)
    _swap_balance(nodes, holders, slabs, loads)
    _recompute_loads(nodes, holders, loads)
    names = [a.device.name for a in nodes]
    return Plan(nodes, {k: [names[i] for i in v] for k, v in holders.items()}, dict(loads))


def _swap_balance(
    nodes: list[Assignment],
    holders: dict[SlabKey, list[int]],
    slabs: Mapping[SlabKey, int],
    loads: Mapping[SlabKey, float],
    max_swaps: int = 20_000,
) -> None:
    """Trade a hot slab of the busiest device for a cold one of the least busy: bytes stay where capacity
    put them, load moves. Big devices end up with many cold slabs, small ones with a few hot ones."""

    def per(k: SlabKey) -> float:
        return loads[k] / len(holders[k])

    _recompute_loads(nodes, holders, loads)
    mean = sum(a.load for a in nodes) / len(nodes)
    for _ in range(max_swaps):
        hi = max(range(len(nodes)), key=lambda i: nodes[i].load)
        lo = min(range(len(nodes)), key=lambda i: nodes[i].load)
        b, s = nodes[hi], nodes[lo]
        gap = b.load - s.load
        if b.load <= BALANCED * mean or gap <= 1e-9:
            return
        hot = sorted((k for k in b.slabs if k not in s.slabs), key=per, reverse=True)
        cold = sorted((k for k in s.slabs if k not in b.slabs), key=per)
        done = False
        for h in hot[:32]:
            for c in cold[:32]:
                delta = per(h) - per(c)
                if delta <= 0 or delta >= gap:  # no gain, or the two would only change places
                    continue
                if (b.device.capacity - b.bytes + slabs[h] - slabs[c] < 0
                        or s.device.capacity - s.bytes + slabs[c] - slabs[h] < 0):  # fmt: skip
                    continue
                for a, out, into in ((b, h, c), (s, c, h)):
                    a.slabs.remove(out)
                    a.slabs.add(into)
                    a.bytes += slabs[into] - slabs[out]
                    a.load += per(into) - per(out)
                holders[h][holders[h].index(hi)] = lo
                holders[c][holders[c].index(lo)] = hi
                done = True
                break
            if done:
                break
        if not done:
            return


def _water_level(capacities: list[int], need: int) -> list[float]:
    """Per device: min(capacity, x), with x such that they add up to `need` (each at least 1 byte)."""
    lo, hi = 0.0, float(max(capacities))
    for _ in range(60):
        x = (lo + hi) / 2
        if sum(min(c, x) for c in capacities) < need:
            lo = x
        else:
            hi = x
    return [max(1.0, min(c, hi)) for c in capacities]


def _make_room(
    nodes: list[Assignment],
    holders: dict[SlabKey, list[int]],
    slabs: Mapping[SlabKey, int],
    loads: Mapping[SlabKey, float],
    key: SlabKey,
) -> int | None:
    """The end of a tight plan: every device with room already holds `key`. Move one slab off a device
    that lacks `key` onto a device with room that lacks that slab; the freed device takes `key`."""
    size = slabs[key]
    for j in sorted(range(len(nodes)), key=lambda i: nodes[i].load):
        a = nodes[j]
        if j in holders[key]:
            continue
        for other in sorted(a.slabs, key=lambda k: slabs[k]):
            if a.device.capacity - a.bytes + slabs[other] < size:
                continue
            for m, b in enumerate(nodes):
                if m == j or m in holders[other] or b.device.capacity - b.bytes < slabs[other]:
                    continue
                share = loads[other] / len(holders[other])
                a.slabs.remove(other)
                a.bytes -= slabs[other]
                a.load -= share
                _put(b, other, slabs[other], share)
                holders[other][holders[other].index(j)] = m
                return j
    return None


def _pop_least_loaded(
    heap: list[tuple[float, int, int]], nodes: list[Assignment], size: int, exclude: list[int]
) -> int | None:
    """Take the least loaded device with room for `size` that is not in `exclude` off the heap (the others
    looked at go back)."""
    passed, found = [], None
    while heap:
        entry = heapq.heappop(heap)
        i = entry[2]
        if i not in exclude and nodes[i].device.capacity - nodes[i].bytes >= size:
            found = i
            break
        if nodes[i].device.capacity - nodes[i].bytes >= 1:
            passed.append(entry)  # a device with no room left at all drops out for good
    for entry in passed:
        heapq.heappush(heap, entry)
    return found


def _least_loaded(nodes: list[Assignment], size: int, exclude: list[int]) -> int | None:
    best, best_score = None, None
    for i, a in enumerate(nodes):
        if i in exclude or a.device.capacity - a.bytes < size:
            continue
        # least load first; among equals, the most room left (keeps small devices for small slabs)
        score = (a.load, -(a.device.capacity - a.bytes))
        if best_score is None or score < best_score:
            best, best_score = i, score
    return best


def _recompute_loads(
    nodes: list[Assignment], holders: dict[SlabKey, list[int]], loads: Mapping[SlabKey, float]
) -> None:
    """Each device's share of the per-token load: its slabs' loads, each split among that slab's holders."""
    for a in nodes:
        a.load = sum(loads[k] / len(holders[k]) for k in a.slabs)


def _add_holder(
    nodes: list[Assignment],
    holders: dict[SlabKey, list[int]],
    slabs: Mapping[SlabKey, int],
    loads: Mapping[SlabKey, float],
    key: SlabKey,
    target: int,
) -> None:
    """One more holder of `key`: the holders it had give up part of their share of its load to it."""
    before, after = loads[key] / len(holders[key]), loads[key] / (len(holders[key]) + 1)
    for i in holders[key]:
        nodes[i].load -= before - after
    _put(nodes[target], key, slabs[key], after)
    holders[key].append(target)


def _put(a: Assignment, key: SlabKey, size: int, share: float) -> None:
    a.slabs.add(key)
    a.bytes += size
    a.load += share


def _replicate_hot(
    nodes: list[Assignment],
    holders: dict[SlabKey, list[int]],
    slabs: Mapping[SlabKey, int],
    loads: Mapping[SlabKey, float],
) -> None:
    """Where memory is left, a slab picked more than twice as often as the average gets one more holder per
    doubling (at most MAX_EXTRA_REPLICAS more): its work is shared wider, and more holders can fail."""
    mean = sum(loads.values()) / len(loads)
    for key in sorted(slabs, key=lambda k: (-loads[k], k)):
        ratio = loads[key] / mean if mean > 0 else 0.0
        if ratio < 2:
            return
        extra = min(MAX_EXTRA_REPLICAS, int(math.log2(ratio)))
        for _ in range(extra):
            target = _least_loaded(nodes, slabs[key], exclude=holders[key])
            if target is None:
                break
            _add_holder(nodes, holders, slabs, loads, key, target)


def _spread_hot(
    nodes: list[Assignment],
    holders: dict[SlabKey, list[int]],
    slabs: Mapping[SlabKey, int],
    loads: Mapping[SlabKey, float],
    replicas: int,
) -> None:
    """More holders for the slabs that weigh most on the busiest devices, while memory is left."""
    _recompute_loads(nodes, holders, loads)
    mean = sum(a.load for a in nodes) / len(nodes)
    # each step moves part of the busiest device's heaviest slab to another device; bounded by the slab count
    for _ in range(len(slabs)):
        busiest = max(range(len(nodes)), key=lambda i: nodes[i].load)
        if nodes[busiest].load <= BALANCED * mean:
            return
        candidates = [
            (-(loads[k] / len(holders[k])), k)
            for k in nodes[busiest].slabs
            if len(holders[k]) < replicas + MAX_EXTRA_REPLICAS
        ]
        heapq.heapify(candidates)
        placed = False
        while candidates:
            _, key = heapq.heappop(candidates)
            target = _least_loaded(nodes, slabs[key], exclude=holders[key])
            if target is None:
                continue
            before = loads[key] / len(holders[key])
            after = loads[key] / (len(holders[key]) + 1)
            if nodes[target].load + after >= nodes[busiest].load - (before - after):
                continue  # it would only move the peak
            _add_holder(nodes, holders, slabs, loads, key, target)
            placed = True
            break
        if not placed:
            return


def _gib(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"
