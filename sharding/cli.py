"""Subcommands of this part (see swarm.coordinator.cli): `swarm shard`, `swarm inspect`."""

from __future__ import annotations

import argparse
import sys

from swarm.sharding.errors import UserError
from swarm.sharding.ranges import format_slabs, parse_ranges, parse_size


def register(sub: argparse._SubParsersAction) -> None:
    """Add this part's subcommands to the `swarm` parser."""
    p = sub.add_parser(
        "shard",
        help="cut a MoE GGUF into one file per (layer, expert) + dense.gguf + manifest.json",
        description=(
            "Cut MODEL.gguf into DIR: experts/<layer>/<expert>.gguf (byte-range copies of each expert's "
            "slabs), dense.gguf (every other tensor and all metadata) and manifest.json. A rerun resumes and "
            "skips what verifies. With --verify: swarm shard --verify DIR [MODEL.gguf]."
        ),
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="MODEL.gguf; with --verify: DIR [MODEL.gguf]")
    p.add_argument("-o", "--output", metavar="DIR", help="shard directory to write (created if needed)")
    p.add_argument(
        "--layers",
        metavar="RANGES",
        help="cut only these layers, e.g. 0-9,20 (the rest is still read, for the model fingerprint)",
    )
    p.add_argument("--experts", metavar="RANGES", help="cut only these experts of each layer, e.g. 0-63")
    p.add_argument(
        "--verify",
        action="store_true",
        help="re-hash DIR against its manifest (and against MODEL.gguf if given); name every mismatch",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no summary")
    p.set_defaults(func=run_shard)

    p = sub.add_parser(
        "inspect",
        help="what a MoE GGUF (or shard directory) is made of: dense vs expert bytes, slab size",
        description="Architecture, layers, experts, top-k, quant types, dense vs expert bytes, slab sizes.",
    )
    p.add_argument("path", metavar="MODEL.gguf|DIR", help="a GGUF file or a shard directory")
    p.set_defaults(func=run_inspect)

    p = sub.add_parser(
        "plan",
        help="assign every expert slab of a shard directory to devices, with replicas, within capacities",
        description=(
            "Assign every (layer, expert) slab of DIR to the devices given by --capacities: each slab on "
            "--replicas distinct devices, hot experts (from --stats, written by `swarm run --stats`) on more "
            "while memory is left, the per-token load spread evenly. Prints the `swarm node` command of each "
            "device and a summary; exits 1 and says by how much when the slabs do not fit."
        ),
    )
    p.add_argument("dir", metavar="DIR", help="a `swarm shard` directory")
    p.add_argument(
        "--capacities", required=True, help="bytes each device may hold, comma-separated: 4GiB,2GiB,512MiB"
    )
    p.add_argument("--names", default=None, help="device names, comma-separated (default: node0, node1, ...)")
    p.add_argument("--replicas", type=int, default=2, help="devices holding each slab (default 2)")
    p.add_argument(
        "--stats", default=None, metavar="FILE", help="routing statistics from `swarm run --stats`"
    )
    p.add_argument(
        "--json", action="store_true", help="the plan as JSON (for scripts and `swarm node --plan`)"
    )
    p.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    import json

    from swarm.sharding.plan import Device, loads_from_stats, plan, uniform_loads
    from swarm.sharding.slabs import read_manifest

    m = read_manifest(args.dir)
    caps = [parse_size(c) for c in args.capacities.split(",") if c.strip()]
    if not caps:
        raise UserError("--capacities: give one size per device, e.g. 4GiB,2GiB")
    names = (
        [n.strip() for n in args.names.split(",")] if args.names else [f"node{i}" for i in range(len(caps))]
    )
    if len(names) != len(caps) or len(set(names)) != len(names):
        raise UserError(f"--names: give {len(caps)} distinct names, one per capacity")
    slabs = {(s.layer, s.expert): s.size for s in m.slabs}
    if not slabs:
        raise UserError(f"{args.dir}: its manifest lists no slabs")
    loads = (
        loads_from_stats(args.stats, slabs, m.n_expert_used, m.n_expert)
        if args.stats
        else uniform_loads(slabs, m.n_expert_used, m.n_expert)
    )
    try:
        result = plan(slabs, [Device(n, c) for n, c in zip(names, caps, strict=True)], args.replicas, loads)
    except UserError as e:
        print(f"swarm plan: {e}", file=sys.stderr)
        return 1
    total = sum(a.load for a in result.nodes)
    rows = []
    for a in result.nodes:
        command = (
            f"swarm node {args.dir} --slab '{format_slabs(a.slabs)}' --name {a.device.name} --host 0.0.0.0 "
            "--key-file swarm.key"
        )
        rows.append((a, command))
    lo, mean = result.replicas()
    if args.json:
        print(json.dumps({
            "model": m.fingerprint,
            "replicas": {"min": lo, "mean": round(mean, 3)},
            "nodes": [
                {"name": a.device.name, "capacity_bytes": a.device.capacity, "bytes": a.bytes,
                 "load_share": round(a.load / total, 6) if total else 0.0,
                 "slabs": sorted([list(k) for k in a.slabs]), "command": cmd}
                for a, cmd in rows
            ],
        }))  # fmt: skip
        return 0
    for a, cmd in rows:
        share = a.load / total if total else 0.0
        print(f"# {a.device.name}: {len(a.slabs)} slabs, {a.bytes / 2**30:.2f} of {a.device.capacity / 2**30:.2f} "
              f"GiB, {100 * share:.1f}% of the per-token expert load")  # fmt: skip
        print(cmd)
    busiest = max(a.load for a in result.nodes)
    print(f"\n{len(slabs)} slabs on {len(result.nodes)} devices; replicas min {lo}, mean {mean:.2f}; busiest "
          f"device {busiest / (total / len(result.nodes)):.2f}x the mean load", file=sys.stderr)  # fmt: skip
    return 0


def run_shard(args: argparse.Namespace) -> int:
    from swarm.sharding.shard import shard_model
    from swarm.sharding.verify import verify_shard

    if args.verify:
        if len(args.paths) > 2 or args.output or args.layers or args.experts:
            raise UserError("--verify takes DIR [MODEL.gguf] and no -o/--layers/--experts")
        problems = verify_shard(args.paths[0], args.paths[1] if len(args.paths) > 1 else None)
        for line in problems:
            print(f"MISMATCH {line}")
        if problems:
            print(f"{len(problems)} mismatch(es) in {args.paths[0]}", file=sys.stderr)
            return 1
        if not args.quiet:
            print(
                f"{args.paths[0]}: every file matches its manifest"
                + (" and the source" if len(args.paths) > 1 else "")
            )
        return 0
    if len(args.paths) != 1:
        raise UserError("give one MODEL.gguf (or use --verify DIR [MODEL.gguf])")
    if not args.output:
        raise UserError("say where to write the shards: swarm shard MODEL.gguf -o DIR")
    layers = parse_ranges(args.layers, "layer") if args.layers else None
    experts = parse_ranges(args.experts, "expert") if args.experts else None
    result = shard_model(args.paths[0], args.output, layers, experts, progress=not args.quiet)
    if not args.quiet:
        m = result.manifest
        print(
            f"{args.output}: {len(m.slabs)} slab files + dense.gguf ({result.written} written, "
            f"{result.skipped} already there), fingerprint {m.fingerprint[:16]}"
        )
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    from swarm.sharding.inspect_model import format_survey, survey

    print(format_survey(survey(args.path)))
    return 0
