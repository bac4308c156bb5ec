"""`swarm node` running: the store opened (or filled by --fetch), the server started, the node announced by
mDNS and in its ready file, and kept so (slabs fetched, dropped by its own check, taken back) until a signal
or the end of the process that started it."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarm.node.announce import Announcement
from swarm.node.auth import swarm_key
from swarm.node.holding import make_store, open_store, planned_model, report_problems, requested_slabs
from swarm.node.slab_files import shard_files, start_first_use, start_self_check, verified_manifest
from swarm.sharding.errors import UserError
from swarm.sharding.ranges import format_slabs, parse_size

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from swarm.node.fetch_cli import NodeFetch
    from swarm.node.selfcheck import SlabSelfCheck
    from swarm.sharding.manifest import SlabEntry


def run_node(args: argparse.Namespace) -> int:
    from swarm.compute.openmp import set_wait_policy

    set_wait_policy(experts_remote=True, node=True)  # before ggml loads OpenMP: a node shares its device
    from swarm.compute.malloc import keep_freed_memory

    keep_freed_memory()  # a call finds the memory the call before it freed
    from swarm.compute.expert_copies import default_memory_budget

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
        from swarm.compute.ggml import set_threads

        set_threads(args.threads)
    key = swarm_key(args, "node")
    tls = _tls(args.tls, key is not None, args.host)
    if args.join:
        from swarm.node.join import check_join

        check_join(args)

    checked_from = None  # slabs are hashed before their first use (swarm.node.first_use)
    fetch = None
    if args.fetch:
        from swarm.node.fetch_cli import NodeFetch

        checked_from = time.time_ns()  # --fetch hashes the slabs it finds: the later watch starts from here
        fetch = NodeFetch(args, key, requested_slabs(args), planned_model(args.plan))
        try:
            loaded = fetch.loaded()
            report_problems(loaded.problems)
            store = make_store(loaded, device, memory, args.source)
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
    """The device exact calls compute on; a GPU needs torch (a CPU node never loads it)."""
    if name == "cpu":
        return name
    try:
        import torch
    except ImportError:
        raise UserError(
            f"--device {name} computes with torch, which is not installed here; install the coordinator's "
            "extra (pip install 'swarm-moe[coordinator]') or use --device cpu"
        ) from None
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: this torch has no CUDA device; use --device cpu")
    if name == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise UserError("--device mps: Metal is not available here; use --device cpu")
    return name


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, path)


def _serve(
    args: argparse.Namespace,
    loaded: Any,
    store: Any,
    key: Any,
    tls: bool,
    memory: int,
    parent: int | None,
    fetch: NodeFetch | None,
    checked_from: int | None,
) -> int:
    """Serve (and fetch, with --fetch) until a signal, or the process that started this node is gone; with
    --recheck, drop the slabs whose files stop matching the manifest, and take them back once they match."""
    from swarm.compute.heap import freeze_startup

    manifest = verified_manifest(args)
    files = shard_files(args, store, manifest)
    server = _start_server(args, loaded, store, key, tls, files)
    node = _Serving(args, loaded, store, server, key, tls, memory, files, fetch)
    metrics_server = _serve_metrics(node)
    stop = _stop_on_signals()
    grown = threading.Event()  # slabs fetched since the last announcement
    checked = threading.Event()  # slabs dropped or taken back by the check since the last announcement
    check = start_self_check(args, store, files, manifest, checked_from, checked)
    _say_started(node)
    freeze_startup()
    node.write_ready()
    node.first_use = start_first_use(args, store, files, manifest, check, checked, checked_from is None)
    advertiser = Announcement(node).start() if not (args.no_mdns or args.join) else None
    link = None
    if fetch is not None:
        _start_fetch(node, fetch, check, stop, grown)
    try:
        if args.join:
            from swarm.node.join import join_from_args

            link = join_from_args(args, node.loaded, node.server, node.key, stop)
        _keep_announced(node, stop, parent, advertiser, grown, checked, link)
    finally:
        if link is not None:
            link.close()
        node.first_use.close()
        _shut_down(node, stop, check, advertiser, metrics_server)
    print("swarm node: stopped", flush=True)
    return 0


@dataclass
class _Serving:
    """A node while it serves: what its mDNS record, its ready file and its status lines say of it."""

    args: argparse.Namespace
    loaded: Any
    store: Any
    server: Any
    key: Any
    tls: bool
    memory: int
    files: Any
    fetch: NodeFetch | None
    metrics_port: int | None = None
    fetching: bool = False  # its --fetch has started and not ended
    first_use: Any = None  # its start-up pass over the slabs (swarm.node.first_use), once started
    said_prepared: bool = False  # the ready file has said that pass ended

    def properties(self) -> dict[str, str]:
        """Its mDNS record."""
        from swarm.compute.numclass import numerics_class
        from swarm.node.discovery import node_properties

        store, server = self.store, self.server
        return node_properties(
            self.loaded.fingerprint,
            store.held(),
            store.hidden_size or 0,
            self.memory,
            self.args.workers,
            str(store.device),
            source_sha256=self.loaded.source_sha256,
            key=self.key,
            tls=self.tls,
            serves_files=self.files is not None,
            stream_port=server.stream.port if server.stream is not None else 0,
            numerics_class=numerics_class(),
        )

    def write_ready(self) -> None:
        """The --ready-file, written again whenever what it says changes."""
        args, store, loaded, fetch = self.args, self.store, self.loaded, self.fetch
        if args.ready_file:
            _write_json_atomic(
                args.ready_file,
                {
                    "address": self.server.address,
                    "host": args.host,
                    "port": self.server.port,
                    "pid": os.getpid(),
                    "fingerprint": loaded.fingerprint,
                    "source_sha256": loaded.source_sha256,
                    "slabs": len(store.slabs),
                    "held": format_slabs(store.held()),
                    "dropped": format_slabs(store.dropped()),  # slabs whose files failed the check
                    "device": str(store.device),
                    "problems": loaded.problems,
                    "metrics_port": self.metrics_port,
                    # --fetch: slabs still to fetch, and those it could not (rewritten when the fetch ends)
                    "pending": fetch.pending if fetch is not None else 0,
                    "fetch_failed": fetch.failed() if fetch is not None else [],
                    # every slab hashed (before its first use) and made ready for the kernels
                    "prepared": self.said_prepared,
                },
            )

    def say_serving(self, extra: str = "") -> None:
        store = self.store
        print(
            f"swarm node: serving slabs={len(store.slabs)} held={format_slabs(store.held())}{extra}",
            flush=True,
        )


def _start_server(args: argparse.Namespace, loaded: Any, store: Any, key: Any, tls: bool, files: Any) -> Any:
    from swarm.node.server import NodeServer

    return NodeServer(
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


def _serve_metrics(node: _Serving) -> Any:
    """The --metrics-port endpoint, started (None without one); its port goes into the ready file."""
    args, server = node.args, node.server
    if args.metrics_port is None:
        return None
    from swarm.node.metrics import serve_metrics

    try:
        metrics_server, node.metrics_port = serve_metrics(
            server.servicer.stats, node.store, args.name or server.address, args.host, args.metrics_port
        )
    except OSError as e:
        server.stop(grace=0)
        raise UserError(f"cannot serve metrics on port {args.metrics_port} ({e}); pick another") from None
    return metrics_server


def _stop_on_signals() -> threading.Event:
    """An event that SIGTERM and SIGINT set."""
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop


def _say_started(node: _Serving) -> None:
    server, store, loaded = node.server, node.store, node.loaded
    print(
        f"swarm node: serving address={server.address} slabs={len(store.slabs)} held={format_slabs(store.held())} "
        f"fingerprint={loaded.fingerprint} device={store.device} pid={os.getpid()}",
        flush=True,
    )
    if node.key is None:
        print(
            "swarm node: warning: no swarm key: this is an OPEN swarm node; any process on this machine "
            "can use it (make a key with `swarm keygen` and pass --key-file)",
            file=sys.stderr,
        )


def _start_fetch(
    node: _Serving,
    fetch: NodeFetch,
    check: SlabSelfCheck | None,
    stop: threading.Event,
    grown: threading.Event,
) -> None:
    """Fetch the rest of the node's slabs on a thread: each serves (and is watched) once it verifies, and
    `grown` says so to the loop that announces the node."""
    from swarm.sharding.slabs import read_slab_file

    store, files, directory = node.store, node.files, Path(node.args.source)
    fetch.sources.exclude(node.server.address)
    assert files is not None  # --fetch fills a directory and verifies: it gives out what it holds

    def verified(entry: SlabEntry) -> None:
        store.add((entry.layer, entry.expert), read_slab_file(directory / entry.path))
        files.add_slab(entry.layer, entry.expert, entry.size)
        if check is not None:
            check.watch(entry)
        grown.set()

    fetch.start(stop, verified)
    node.fetching = True


def _keep_announced(
    node: _Serving,
    stop: threading.Event,
    parent: int | None,
    advertiser: Any,
    grown: threading.Event,
    checked: threading.Event,
    link: Any = None,
) -> None:
    """Until `stop` (or the parent is gone, or the coordinator refused a --join link): announce the node again
    whenever its slabs change (by mDNS, or over its --join link), and say so."""
    fetch = node.fetch
    while not stop.wait(0.5):
        if link is not None and link.failure:
            raise UserError(link.failure)
        if parent is not None and os.getppid() != parent:
            print("swarm node: the process that started this node is gone; stopping", file=sys.stderr)
            break
        fetch_ended = node.fetching and fetch is not None and fetch.done()
        # taken (cleared) before the node's state is read: a slab fetched or dropped meanwhile sets them again,
        # and is announced next time (cleared after the reading, its change could be missed for good)
        was_grown, was_checked = _take(grown), _take(checked)
        if was_grown or was_checked or fetch_ended:
            if advertiser is not None:
                advertiser.update()
            if link is not None:
                link.announce()  # a joined node's coordinator reads its slabs again
        if was_checked:
            dropped = node.store.dropped()
            node.say_serving(
                f" dropped={format_slabs(dropped)} (their files failed the check)" if dropped else ""
            )
            node.write_ready()
        if not node.said_prepared and node.first_use is not None and node.first_use.done.is_set():
            node.said_prepared = True
            node.write_ready()
        if fetch_ended:
            assert fetch is not None
            node.fetching = False
            for line in fetch.report():
                print(line, file=sys.stderr, flush=True)
            node.say_serving()
            node.write_ready()


def _take(event: threading.Event) -> bool:
    """Whether `event` was set, clearing it if so (one set after the look stays set for the next)."""
    if not event.is_set():
        return False
    event.clear()
    return True


def _shut_down(
    node: _Serving, stop: threading.Event, check: SlabSelfCheck | None, advertiser: Any, metrics_server: Any
) -> None:
    if check is not None:
        check.close()
    if node.fetching and node.fetch is not None:
        stop.set()
        node.fetch.join(timeout=10.0)
        for line in node.fetch.report():
            print(line, file=sys.stderr, flush=True)
    if advertiser is not None:
        advertiser.close()  # goodbye first, so coordinators stop routing here before the port closes
    node.server.stop(grace=2.0)
    if metrics_server is not None:
        metrics_server.shutdown()
