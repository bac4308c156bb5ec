"""Subcommands of this part (see swarm.coordinator.cli): `swarm shard`, `swarm inspect`."""

from __future__ import annotations

import argparse
import sys

from swarm.sharding.errors import UserError
from swarm.sharding.ranges import parse_ranges


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


def run_shard(args: argparse.Namespace) -> int:
    from swarm.sharding.shard import shard_model, verify_shard

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
