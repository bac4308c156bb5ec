"""What `swarm node` holds: the slabs its arguments ask for (--layers, --experts, --slab, --plan with --name),
opened as its ExpertStore, with the slabs it refuses named on stderr."""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

from swarm.sharding.errors import UserError
from swarm.sharding.ranges import parse_ranges

log = logging.getLogger(__name__)

MAX_PROBLEM_LINES = 20  # refused slabs named one per line, then a count


def parse_slab_specs(specs: list[str]) -> set[tuple[int, int]]:
    """ "3:17", "0-3:0-7", several comma-free specs or ';'-separated -> {(layer, expert)}."""
    keys: set[tuple[int, int]] = set()
    for spec in specs:
        for part in re.split(r"[;\s]+", spec.strip()):
            if not part:
                continue
            layers, sep, experts = part.partition(":")
            if not sep:
                raise UserError(f"bad slab {part!r}; write LAYER:EXPERT like 3:17 or ranges like 0-3:0-7")
            keys |= {
                (layer, e)
                for layer in parse_ranges(layers, "slab layer")
                for e in parse_ranges(experts, "slab expert")
            }
    return keys


def _read_plan(plan: Path) -> dict[str, Any]:
    try:
        data = json.loads(plan.read_text())
        if not isinstance(data, dict) or not isinstance(data["nodes"], list):
            raise TypeError("no list of nodes")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{plan}: not a `swarm plan --json` file ({e})") from None
    return data


def planned_model(plan: Path | None) -> str | None:
    """The model fingerprint a `swarm plan --json` file was made for (None without a plan)."""
    if plan is None:
        return None
    return str(_read_plan(plan).get("model") or "") or None


def planned_slabs(plan: Path | None, name: str | None) -> set[tuple[int, int]]:
    """The slabs `swarm plan --json` gave the node called `name` (none without a plan)."""
    if plan is None:
        return set()
    if not name:
        raise UserError("--plan needs --name: which node of the plan this is")
    nodes = _read_plan(plan)["nodes"]
    try:
        mine = [n for n in nodes if n["name"] == name]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{plan}: not a `swarm plan --json` file ({e})") from None
    if not mine:
        names = ", ".join(str(n.get("name")) for n in nodes[:8])
        raise UserError(
            f"{plan}: has no node named {name!r} (it has {names}{', ...' if len(nodes) > 8 else ''})"
        )
    try:
        return {(int(layer), int(e)) for layer, e in mine[0]["slabs"]}
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{plan}: node {name!r} has a damaged slab list ({e})") from None


def requested_slabs(
    args: argparse.Namespace,
) -> tuple[list[int] | None, list[int] | None, set[tuple[int, int]]]:
    """(layers, experts, single slabs) as --layers, --experts, --slab and --plan/--name ask for them."""
    layers = parse_ranges(args.layers, "layer") if args.layers else None
    experts = parse_ranges(args.experts, "expert") if args.experts else None
    return layers, experts, parse_slab_specs(args.slab) | planned_slabs(args.plan, args.name)


def report_problems(problems: list[str]) -> None:
    """Refused slabs on stderr, one line each, then a count."""
    for problem in problems[:MAX_PROBLEM_LINES]:
        print(f"swarm node: refused {problem}", file=sys.stderr)
    if len(problems) > MAX_PROBLEM_LINES:
        print(f"swarm node: refused {len(problems) - MAX_PROBLEM_LINES} more slabs", file=sys.stderr)


def open_store(args: argparse.Namespace, device: str = "cpu", memory: int = 0) -> tuple[Any, Any]:
    """The slabs `swarm node` was asked for, opened: (LoadedSlabs, ExpertStore). A shard directory's slab
    files are mapped and their sizes checked, nothing read: each is hashed against the manifest before its
    first use (swarm.node.first_use). Slabs refused are named on stderr (one line each, then a count); a
    source with none to serve is a UserError."""
    from swarm.compute.slabs import load_slabs, slab_progress

    layers, experts, slab_keys = requested_slabs(args)
    with slab_progress("opening slabs") as progress:
        loaded = load_slabs(
            args.source, layers, experts, slab_keys, verify=False, progress=progress, map_only=True
        )
    report_problems(loaded.problems)
    if not loaded.slabs:
        raise UserError(f"{args.source}: none of the requested slabs can be served; see the lines above")
    return loaded, make_store(loaded, device, memory, args.source)


def make_store(loaded: Any, device: str, memory: int, source: str) -> Any:
    """The ExpertStore over the loaded slabs (a UserError naming `source` when the slabs do not fit
    together). Its repacked copies are made once the node serves (swarm.node.first_use)."""
    from swarm.compute.store import ExpertStore

    try:
        return ExpertStore(loaded.slabs, device=device, memory_budget=memory)
    except ValueError as e:
        raise UserError(f"{source}: {e}") from e
