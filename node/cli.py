"""`swarm node` and `swarm keygen`: their arguments (see swarm.coordinator.cli); swarm.node.daemon runs the
node, swarm.node.holding opens what it holds."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from swarm.node.auth import add_key_argument
from swarm.node.daemon import run_node
from swarm.node.fetch_cli import add_fetch_arguments
from swarm.node.selfcheck import DEFAULT_INTERVAL, WATCH_SECONDS
from swarm.sharding.errors import UserError


def register(sub: argparse._SubParsersAction) -> None:
    """Add `swarm node` and `swarm keygen` to the `swarm` parser."""
    k = sub.add_parser(
        "keygen",
        help="make a new swarm key",
        description="Write a new random swarm key (32 bytes) for nodes and coordinators to share: give it to "
        "each with --key-file FILE or $SWARM_KEY_FILE. Without --out it is printed (for $SWARM_KEY).",
    )
    k.add_argument("--out", type=Path, default=None, help="write the key to this file (mode 600)")
    k.add_argument("--force", action="store_true", help="replace an existing --out file")
    k.set_defaults(func=run_keygen)
    p = sub.add_parser(
        "node",
        help="hold expert slabs and compute them for the swarm over gRPC",
        description=(
            "Serve expert slabs of one model to swarm coordinators: from a shard directory written by "
            "`swarm shard` (slabs verified against its manifest) or straight from a whole GGUF. With no "
            "--experts/--layers/--slab it serves every slab of the model."
        ),
    )
    _add_slab_arguments(p)
    _add_network_arguments(p)
    _add_compute_arguments(p)
    _add_identity_arguments(p)
    _add_upkeep_arguments(p)
    add_fetch_arguments(p)
    p.set_defaults(func=run_node)


def _add_slab_arguments(p: argparse.ArgumentParser) -> None:
    """Where the slabs come from and which of them the node holds."""
    p.add_argument(
        "source",
        metavar="DIR_OR_GGUF",
        help="shard directory (swarm shard output) or a .gguf model; with --fetch, the (empty) directory to fill",
    )
    p.add_argument(
        "--experts", help="expert ids to hold in every chosen layer, e.g. 0-63 or 0-7,16 (default: all)"
    )
    p.add_argument("--layers", help="layers to hold, e.g. 0-19 (default: every MoE layer)")
    p.add_argument(
        "--slab",
        action="append",
        default=[],
        metavar="LAYER:EXPERT",
        help="hold one slab (repeatable; ranges allowed: 0-3:0-7); adds to --experts/--layers",
    )
    p.add_argument(
        "--plan",
        type=Path,
        default=None,
        metavar="FILE",
        help="hold the slabs a `swarm plan --json` file gives this node (--name says which node)",
    )


def _add_network_arguments(p: argparse.ArgumentParser) -> None:
    """Where the node listens for gRPC calls and for its compute stream."""
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 or a LAN address to serve "
        "other devices)",
    )
    p.add_argument("--port", type=int, default=0, help="port to listen on (0: any free port)")
    stream = p.add_mutually_exclusive_group()
    stream.add_argument(
        "--stream-port",
        type=int,
        default=0,
        help="port of the compute stream, which takes the coordinator's Compute calls on kept connections at "
        "a third of a gRPC call's CPU for a decode step's calls (0: any free port; the node announces it); a firewall must let it "
        "through beside --port, or the coordinator falls back to gRPC",
    )
    stream.add_argument(
        "--no-stream", action="store_true", help="no compute stream: Compute calls go over gRPC only"
    )


def _add_compute_arguments(p: argparse.ArgumentParser) -> None:
    """The memory, device and threads the node computes with."""
    p.add_argument(
        "--memory",
        default=None,
        help="budget for the copies of experts this node keeps, e.g. 4GiB, 0 for unlimited (default: half "
        "the RAM, or under a cgroup memory limit that leaves less, as a phone app or a container has: the "
        "limit less the node's own memory and a margin, so that the node stays within the limit; the node "
        "logs what it chose), least recently used first out. Native calls (the default) multiply the "
        "memory-mapped slabs, whose pages the OS keeps resident while they are used and can drop under "
        "pressure, or, for the types ggml has repacked kernels for on this CPU (Q4_0, Q4_K, IQ4_NL on x86), "
        "a repacked copy (about the "
        "slab's own size) that takes the slab pages' place: made at start-up for as many experts as the "
        "budget holds, the others when a call needs them. Exact-numerics calls (swarm run --exact) and slab "
        "types without a ggml kernel use float32 copies (4-8x the slab) under the same budget. An evicted "
        "expert is copied again when needed: the same answers, slower calls. A call naming more experts than "
        "the budget holds (a long prompt's) multiplies them in groups that fit it",
    )
    p.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda", "mps"),
        help="where exact-numerics calls compute (native calls always run ggml's CPU kernels on the stored "
        "slabs)",
    )
    p.add_argument("--workers", type=int, default=8, help="calls served concurrently")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="compute threads (ggml's and torch's, one pool; default: one per core); on a machine that other "
        "busy processes share (loopback test rigs), 1 can be much faster",
    )


def _add_identity_arguments(p: argparse.ArgumentParser) -> None:
    """How the node is named, secured (swarm key, TLS) and announced (mDNS, metrics)."""
    p.add_argument("--name", default=None, help="name to advertise (default: swarm-node-HOST-PORT-xxxxxx)")
    add_key_argument(p)
    p.add_argument(
        "--tls",
        choices=("auto", "on", "off"),
        default="auto",
        help="serve TLS with the swarm key's identity (auto: whenever there is a key and --host is not "
        "loopback, so that activations are private on the network)",
    )
    p.add_argument("--no-mdns", action="store_true", help="do not advertise by mDNS (static --peer use only)")
    p.add_argument(
        "--join",
        default=None,
        metavar="INVITE|FILE|HOST:PORT",
        help="dial out to the coordinator and serve it over that link (behind NAT, on a phone, where multicast "
        "does not reach): an invite from `swarm invite` (or a file holding it, which no process listing "
        "shows), or the coordinator's --listen HOST:PORT with --key-file. With --fetch the manifest and the "
        "slabs come over the same link from the coordinator's shard directory, so DIR may start empty. The "
        "node is not announced by mDNS; the link is dialed again with backoff whenever it drops",
    )
    p.add_argument(
        "--join-wait",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="give up when no coordinator answers the first --join within this long (default 60)",
    )
    p.add_argument(
        "--link-timeout",
        type=float,
        default=20.0,
        metavar="SECONDS",
        help="a --join link that brings nothing (not even a ping) for this long is taken as lost and dialed "
        "again (default 20)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (0: any free port; default: none)",
    )
    p.add_argument(
        "--mdns-interface",
        action="append",
        default=None,
        metavar="ADDR",
        help="interface address to advertise on (repeatable; default: 127.0.0.1 when --host is loopback, "
        "the --host address when it is one, every interface for 0.0.0.0)",
    )


def _add_upkeep_arguments(p: argparse.ArgumentParser) -> None:
    """The checks of its slab files, and what tools that start a node need."""
    p.add_argument("--no-verify", action="store_true", help="skip the SHA-256 check of shard slab files")
    p.add_argument(
        "--recheck",
        type=float,
        default=DEFAULT_INTERVAL,
        metavar="SECONDS",
        help="while it serves, hash every slab file against the manifest again in rounds: a full pass, then "
        f"a pause of SECONDS (default {DEFAULT_INTERVAL:g}; 0: no checks after start), on a thread at idle "
        f"priority; every {WATCH_SECONDS:g} s (less often for very many files) each file is also stat'ed, "
        "and one whose size, times or inode changed is hashed at once. A slab whose file fails is dropped: no "
        "longer served, announced or given out, an ERROR in the log, listed by `swarm status`; once its file "
        "matches again (restored, or fetched again) it is served again. Shard directories only: a whole GGUF "
        "has no per-slab hashes, and --no-verify checks nothing",
    )
    p.add_argument(
        "--ready-file", type=Path, default=None, help="write JSON (address, port, ...) here once serving"
    )
    p.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop when the process that started this node is gone (for nodes that tools start: "
        "swarm demo, tests, benchmarks; they must not outlive a launcher that was killed)",
    )


def run_keygen(args: argparse.Namespace) -> int:
    from swarm.node.auth import SwarmKey, generate_key_text

    text = generate_key_text()
    if args.out is None:
        print(text)
        return 0
    if args.out.exists() and not args.force:
        raise UserError(f"{args.out} exists; keep it (its nodes use it) or pass --force to replace it")
    tmp = args.out.with_name(args.out.name + f".tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, args.out)
    print(f"swarm keygen: wrote {args.out} (swarm id {SwarmKey.from_text(text).id}); give it to every node "
          "and coordinator with --key-file or $SWARM_KEY_FILE")  # fmt: skip
    return 0
