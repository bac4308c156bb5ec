"""`swarm node`: hold expert slabs and compute them for the swarm (see swarm.coordinator.cli)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarm.node.auth import add_key_argument, swarm_key
from swarm.sharding.errors import UserError
from swarm.sharding.ranges import format_slabs, parse_ranges, parse_size

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from swarm.node.fetch_cli import NodeFetch
    from swarm.node.selfcheck import SlabSelfCheck
    from swarm.sharding.manifest import Manifest, SlabEntry

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
    p.add_argument(
        "--memory",
        default=None,
        help="budget for the copies of experts this node keeps, e.g. 4GiB, 0 for unlimited (default: half "
        "the RAM), least recently used first out. Native calls (the default) multiply the memory-mapped slabs, "
        "whose pages the OS keeps resident while they are used and can drop under pressure, or, for the types "
        "ggml has repacked kernels for on this CPU (Q4_0, Q4_K, IQ4_NL on x86), a repacked copy (about the "
        "slab's own size) that takes the slab pages' place: made at start-up for as many experts as the "
        "budget holds, the others when a call needs them. Exact-numerics calls (swarm run --exact) and slab "
        "types without a ggml kernel use float32 copies (4-8x the slab) under the same budget. An evicted "
        "expert is copied again when needed: the same answers, slower calls",
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
    p.add_argument("--no-verify", action="store_true", help="skip the SHA-256 check of shard slab files")
    from swarm.node.selfcheck import DEFAULT_INTERVAL, WATCH_SECONDS

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
    from swarm.node.fetch_cli import add_fetch_arguments

    add_fetch_arguments(p)
    p.set_defaults(func=run_node)


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


def _tls(mode: str, has_key: bool, host: str) -> bool:
    """Whether the node serves TLS; refuses the setups that would leave a network-facing node open."""
    from swarm.node.auth import is_loopback_host

    loopback = is_loopback_host(host)
    if not has_key:
        if not loopback:
            raise UserError(
                f"--host {host} serves the network, and without a swarm key anyone there could use this node "
                "and read its traffic: make a key (`swarm keygen --out swarm.key`) and pass --key-file to "
                "the nodes and the coordinator"
            )
        if mode == "on":
            raise UserError("--tls on needs a swarm key (its identity is derived from it): give --key-file")
        return False
    return mode == "on" or (mode == "auto" and not loopback)


def _device(name: str) -> str:
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: this torch has no CUDA device; use --device cpu")
    if name == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise UserError("--device mps: Metal is not available here; use --device cpu")
    return name


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, path)


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
    """The slabs `swarm node` was asked for, checked and opened: (LoadedSlabs, ExpertStore). Slabs refused
    are named on stderr (one line each, then a count); a source with none to serve is a UserError."""
    from swarm.compute.slabs import load_slabs, slab_progress

    layers, experts, slab_keys = requested_slabs(args)
    with slab_progress("checking slabs" if not args.no_verify else "opening slabs") as progress:
        loaded = load_slabs(
            args.source, layers, experts, slab_keys, verify=not args.no_verify, progress=progress
        )
    report_problems(loaded.problems)
    if not loaded.slabs:
        raise UserError(f"{args.source}: none of the requested slabs can be served; see the lines above")
    return loaded, _store(loaded, device, memory, args.source)


def run_node(args: argparse.Namespace) -> int:
    from swarm.compute.openmp import set_wait_policy

    set_wait_policy(experts_remote=True, node=True)  # before torch loads: a node shares its device
    from swarm.compute.malloc import keep_freed_memory

    keep_freed_memory()  # a call finds the memory the call before it freed
    from swarm.compute.store import default_memory_budget

    parent = os.getppid() if args.exit_with_parent else None  # read first: it may go while slabs load

    if args.workers < 1:
        raise UserError("--workers must be at least 1")
    if not args.recheck >= 0:
        raise UserError("--recheck must be 0 (off) or a number of seconds")
    memory = parse_size(args.memory) if args.memory is not None else default_memory_budget()
    device = _device(args.device)
    if args.threads is not None:
        if args.threads < 1:
            raise UserError("--threads must be at least 1")
        import torch

        torch.set_num_threads(args.threads)
    key = swarm_key(args, "node")
    tls = _tls(args.tls, key is not None, args.host)

    checked_from = time.time_ns()  # the slab files are checked from here on: the later watch starts from it
    fetch = None
    if args.fetch:
        from swarm.node.fetch_cli import NodeFetch

        fetch = NodeFetch(args, key, requested_slabs(args), planned_model(args.plan))
        try:
            loaded = fetch.loaded()
            report_problems(loaded.problems)
            store = _store(loaded, device, memory, args.source)
        except BaseException:
            fetch.close()
            raise
    else:
        loaded, store = open_store(args, device, memory)
    try:
        return _serve(args, loaded, store, key, tls, memory, parent, fetch, checked_from)
    finally:
        if fetch is not None:
            fetch.close()


def _store(loaded: Any, device: str, memory: int, source: str) -> Any:
    from swarm.compute.store import ExpertStore

    try:
        store = ExpertStore(loaded.slabs, device=device, memory_budget=memory)
    except ValueError as e:
        raise UserError(f"{source}: {e}") from e
    t0 = time.perf_counter()
    store.prepare()  # the repacked copies, before the node is announced: no slow first calls
    log.info("experts ready for ggml's kernels in %.1f s", time.perf_counter() - t0)
    return store


def _verified_manifest(args: argparse.Namespace) -> Manifest | None:
    """The manifest a node's slabs verified against (None for a whole GGUF or --no-verify)."""
    from swarm.sharding.manifest import read_manifest

    if not Path(args.source).is_dir() or args.no_verify:
        return None
    return read_manifest(args.source)


def _shard_files(args: argparse.Namespace, store: Any, manifest: Manifest | None) -> Any:
    """The files a node on a verified shard directory gives out (None for a whole GGUF or --no-verify)."""
    from swarm.node.files import ShardFiles

    if manifest is None:
        return None
    files = ShardFiles(args.source)
    for layer, expert in store.held():
        entry = manifest.slab(layer, expert)
        assert entry is not None  # the store holds only slabs that verified against this manifest
        files.add_slab(layer, expert, entry.size)
    return files


def _self_check(
    args: argparse.Namespace,
    store: Any,
    files: Any,
    manifest: Manifest | None,
    checked_from: int,
    changed: threading.Event,
) -> SlabSelfCheck | None:
    """The watch over the slab files the node serves (swarm.node.selfcheck), started; None when --recheck 0,
    or when there is nothing to check against (a whole GGUF, --no-verify). A slab whose file fails is taken
    out of the store and of the files given out, and `changed` says so to the loop that announces the node."""
    from swarm.node.selfcheck import SlabSelfCheck
    from swarm.sharding.slabs import read_slab_file

    if manifest is None or not args.recheck:
        return None
    directory = Path(args.source)

    def failed(entry: SlabEntry, why: str) -> None:
        store.remove((entry.layer, entry.expert))
        files.remove_slab(entry.layer, entry.expert)
        log.error(
            "slab %d:%d failed its check and is no longer served or announced: %s. Restore the file from a "
            "good copy (this node serves the slab again once it matches the manifest), or fetch it again: "
            "restart this node with --fetch, which fetches from the swarm every slab whose file does not "
            "match",
            entry.layer, entry.expert, why,
        )  # fmt: skip
        changed.set()

    def restored(entry: SlabEntry) -> None:
        store.add((entry.layer, entry.expert), read_slab_file(directory / entry.path))
        files.add_slab(entry.layer, entry.expert, entry.size)
        log.warning(
            "slab %d:%d: %s matches the manifest again; serving it again",
            entry.layer, entry.expert, directory / entry.path,
        )  # fmt: skip
        changed.set()

    check = SlabSelfCheck(directory, args.recheck, failed, restored)
    for layer, expert in store.held():
        entry = manifest.slab(layer, expert)
        assert entry is not None  # the store holds only slabs that verified against this manifest
        check.watch(entry, checked_from)
    return check.start()


def _serve(
    args: argparse.Namespace,
    loaded: Any,
    store: Any,
    key: Any,
    tls: bool,
    memory: int,
    parent: int | None,
    fetch: NodeFetch | None,
    checked_from: int,
) -> int:
    """Serve (and fetch, with --fetch) until a signal, or the process that started this node is gone; with
    --recheck, drop the slabs whose files stop matching the manifest, and take them back once they match."""
    from swarm.node.server import NodeServer
    from swarm.sharding.slabs import read_slab_file

    manifest = _verified_manifest(args)
    files = _shard_files(args, store, manifest)
    server = NodeServer(
        store,
        loaded.fingerprint,
        host=args.host,
        port=args.port,
        workers=args.workers,
        key=key,
        tls=tls,
        name=args.name or "",
        source_sha256=loaded.source_sha256,
        files=files,
        stream_port=None if args.no_stream else args.stream_port,
    ).start()
    metrics_server, metrics_port = None, None
    if args.metrics_port is not None:
        from swarm.node.metrics import serve_metrics

        try:
            metrics_server, metrics_port = serve_metrics(
                server.servicer.stats, store, args.name or server.address, args.host, args.metrics_port
            )
        except OSError as e:
            server.stop(grace=0)
            raise UserError(f"cannot serve metrics on port {args.metrics_port} ({e}); pick another") from None
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    print(
        f"swarm node: serving address={server.address} slabs={len(store.slabs)} held={format_slabs(store.held())} "
        f"fingerprint={loaded.fingerprint} device={store.device} pid={os.getpid()}",
        flush=True,
    )
    if key is None:
        print(
            "swarm node: warning: no swarm key: this is an OPEN swarm node; any process on this machine "
            "can use it (make a key with `swarm keygen` and pass --key-file)",
            file=sys.stderr,
        )

    def write_ready() -> None:
        if args.ready_file:
            _write_json_atomic(
                args.ready_file,
                {
                    "address": server.address,
                    "host": args.host,
                    "port": server.port,
                    "pid": os.getpid(),
                    "fingerprint": loaded.fingerprint,
                    "source_sha256": loaded.source_sha256,
                    "slabs": len(store.slabs),
                    "held": format_slabs(store.held()),
                    "dropped": format_slabs(store.dropped()),  # slabs whose files failed the check
                    "device": str(store.device),
                    "problems": loaded.problems,
                    "metrics_port": metrics_port,
                    # --fetch: slabs still to fetch, and those it could not (rewritten when the fetch ends)
                    "pending": fetch.pending if fetch is not None else 0,
                    "fetch_failed": fetch.failed() if fetch is not None else [],
                },
            )

    from swarm.compute.heap import freeze_startup

    freeze_startup()
    write_ready()
    advertiser = None
    if not args.no_mdns:
        from swarm.compute.numclass import numerics_class
        from swarm.node.discovery import Advertiser, default_mdns_interfaces, node_properties

        def properties() -> dict[str, str]:
            return node_properties(
                loaded.fingerprint,
                store.held(),
                store.hidden_size or 0,
                memory,
                args.workers,
                str(store.device),
                source_sha256=loaded.source_sha256,
                key=key,
                tls=tls,
                serves_files=files is not None,
                stream_port=server.stream.port if server.stream is not None else 0,
                numerics_class=numerics_class(),
            )

        interfaces = args.mdns_interface if args.mdns_interface else default_mdns_interfaces(args.host)
        try:
            advertiser = Advertiser(server.port, args.host, properties(), interfaces, args.name).start()
        except OSError as e:
            print(
                f"swarm node: warning: mDNS advertising failed ({e}); reach this node by --peer",
                file=sys.stderr,
            )
    grown = threading.Event()  # slabs fetched since the last announcement
    checked = threading.Event()  # slabs dropped or taken back by the check since the last announcement
    check = _self_check(args, store, files, manifest, checked_from, checked)
    if fetch is not None:
        fetch.sources.exclude(server.address)
        assert files is not None  # --fetch fills a directory and verifies: it gives out what it holds

        def verified(entry: SlabEntry) -> None:
            store.add((entry.layer, entry.expert), read_slab_file(Path(args.source) / entry.path))
            files.add_slab(entry.layer, entry.expert, entry.size)
            if check is not None:
                check.watch(entry)
            grown.set()

        fetch.start(stop, verified)
    fetching = fetch is not None
    try:
        while not stop.wait(0.5):
            if parent is not None and os.getppid() != parent:
                print("swarm node: the process that started this node is gone; stopping", file=sys.stderr)
                break
            if grown.is_set() or checked.is_set() or (fetching and fetch.done()):
                grown.clear()
                if advertiser is not None:
                    advertiser.update(properties())
            if checked.is_set():
                checked.clear()
                dropped = store.dropped()
                print(
                    f"swarm node: serving slabs={len(store.slabs)} held={format_slabs(store.held())}"
                    + (
                        f" dropped={format_slabs(dropped)} (their files failed the check)" if dropped else ""
                    ),
                    flush=True,
                )
                write_ready()
            if fetching and fetch.done():
                fetching = False
                for line in fetch.report():
                    print(line, file=sys.stderr, flush=True)
                print(
                    f"swarm node: serving slabs={len(store.slabs)} held={format_slabs(store.held())}",
                    flush=True,
                )
                write_ready()
    finally:
        if check is not None:
            check.close()
        if fetching:
            stop.set()
            fetch.join(timeout=10.0)
            for line in fetch.report():
                print(line, file=sys.stderr, flush=True)
        if advertiser is not None:
            advertiser.close()  # goodbye first, so coordinators stop routing here before the port closes
        server.stop(grace=2.0)
        if metrics_server is not None:
            metrics_server.shutdown()
    print("swarm node: stopped", flush=True)
    return 0
