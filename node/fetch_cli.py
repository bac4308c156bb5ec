"""`swarm node DIR --fetch`'s side of the command: sources, the manifest, what to fetch, progress, the report.

The node serves from the moment the manifest is in place: first the slabs already in DIR that verify (an
earlier fetch), then each fetched slab as soon as it verifies (swarm.node.fetch); the daemon re-announces its
held set by mDNS as it grows.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarm.sharding.errors import UserError
from swarm.sharding.ranges import format_slabs

if TYPE_CHECKING:  # the fetch machinery (grpc, torch) loads when a fetch starts, not when the parser is built
    from swarm.compute.slabs import LoadedSlabs
    from swarm.node.auth import SwarmKey
    from swarm.node.fetch import Fetcher, FetchResult
    from swarm.node.fetch_job import FetchJob
    from swarm.sharding.manifest import Manifest, SlabEntry

DEFAULT_PARALLEL = 4  # slabs downloaded at once
PROGRESS_LINE_SECONDS = 10.0  # without a terminal: one progress line this often
MiB = 1 << 20


def add_fetch_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "fetching (--fetch)",
        "Start on an empty directory and fetch the manifest and this node's slabs from the swarm: from any "
        "node on a shard directory that holds them (found by mDNS, or given with --peer) and, with --join, "
        "from the coordinator's shard directory over the link this node dials (all a phone or a device "
        "behind NAT needs: the invite is enough), each slab checked against the manifest's SHA-256 and "
        "served as soon as it verifies. Run the same command again to resume an interrupted fetch.",
    )
    g.add_argument("--fetch", action="store_true", help="fetch the slabs to hold into DIR (see above)")
    g.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a node to fetch from (repeatable); mDNS finds the others unless --no-mdns",
    )
    g.add_argument("--wait", type=float, default=3.0, help="seconds to look by mDNS for nodes to fetch from")
    g.add_argument(
        "--fingerprint",
        default=None,
        metavar="FP",
        help="the model to fetch when the sources serve several (a prefix will do; default: DIR's, the --plan's, "
        "or the only one)",
    )
    g.add_argument(
        "--fetch-parallel",
        type=int,
        default=DEFAULT_PARALLEL,
        metavar="N",
        help=f"slabs downloaded at once (default {DEFAULT_PARALLEL})",
    )


class Progress:
    """Bytes fetched: a tqdm bar on a terminal, else a line on stderr every PROGRESS_LINE_SECONDS."""

    def __init__(self, total: int, slabs: int) -> None:
        from tqdm import tqdm

        self.total, self.slabs = total, slabs
        self.done_bytes = self.done_slabs = 0
        self._bar = tqdm(
            total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="fetching slabs", file=sys.stderr,
            disable=None, leave=False,
        )  # fmt: skip
        self._lock = threading.Lock()
        self._started = self._last_line = time.monotonic()

    def bytes(self, n: int) -> None:
        with self._lock:
            self.done_bytes += n
            self._bar.update(n)
            now = time.monotonic()
            if self._bar.disable and now - self._last_line >= PROGRESS_LINE_SECONDS:
                self._last_line = now
                rate = self.done_bytes / MiB / max(now - self._started, 1e-9)
                print(
                    f"swarm node: fetching: {self.done_slabs} of {self.slabs} slabs, "
                    f"{self.done_bytes / MiB:.1f} of {self.total / MiB:.1f} MiB ({rate:.1f} MiB/s)",
                    file=sys.stderr,
                    flush=True,
                )

    def slab(self) -> None:
        with self._lock:
            self.done_slabs += 1

    def close(self) -> None:
        self._bar.close()


class NodeFetch:
    """One node's fetch: the directory held, the sources found, the manifest in place, the job sorted out."""

    def __init__(
        self,
        args: argparse.Namespace,
        key: SwarmKey | None,
        slab_request: tuple[Any, Any, Any],
        plan_model: str | None = None,
    ) -> None:
        if args.no_verify:
            raise UserError(
                "--fetch checks every slab it fetches against the manifest; leave out --no-verify"
            )
        if args.fetch_parallel < 1:
            raise UserError("--fetch-parallel must be at least 1")
        if not args.peer and args.no_mdns and not args.join:
            raise UserError(
                "--fetch needs sources: give --peer HOST:PORT or --join (the coordinator), or leave out --no-mdns"
            )
        from swarm.compute.slabs import wanted_slabs
        from swarm.node.fetch_job import (
            choose_model,
            ensure_manifest,
            local_manifest,
            locked,
            plan_fetch,
            wait_for_holders,
        )
        from swarm.node.fetch_sources import Sources

        self.directory = Path(args.source)
        self._exit = contextlib.ExitStack()
        self._exit.enter_context(locked(self.directory))
        try:
            have = local_manifest(self.directory)
            from swarm.node.discovery import default_mdns_interfaces

            interfaces = (
                False if args.no_mdns else (args.mdns_interface or default_mdns_interfaces(args.host))
            )
            link = None
            if args.join:
                from swarm.node.join import fetch_link
                from swarm.sharding.identity import ModelIdentity

                model = ModelIdentity(have.fingerprint, have.source.header_sha256) if have is not None else None
                if model is None and (args.fingerprint or plan_model):
                    model = ModelIdentity(args.fingerprint or plan_model or "")
                link = fetch_link(args, key, model)
            self.sources = Sources(key, args.peer, interfaces, link)
            self._exit.callback(self.sources.close)
            self.sources.discover(args.wait)
            if self.sources.link_error:
                if not self.sources.all():
                    raise UserError(self.sources.link_error)
                print(f"swarm node: {self.sources.link_error}; fetching from the others", file=sys.stderr)
            choose_model(self.sources, have, args.fingerprint or plan_model)
            self.manifest: Manifest = ensure_manifest(self.directory, self.sources, have)
            layers, experts, slab_keys = slab_request
            wanted = wanted_slabs(
                layers, experts, slab_keys, list(self.manifest.moe_layers), self.manifest.n_expert
            )
            self.job: FetchJob = plan_fetch(self.directory, self.manifest, wanted)
            wait_for_holders(self.sources, self.job.to_fetch, args.wait)
        except BaseException:
            self._exit.close()
            raise
        self.parallel = args.fetch_parallel
        self.result: FetchResult | None = None
        self._thread: threading.Thread | None = None
        self._fetcher: Fetcher | None = None
        self._progress: Progress | None = None

    def loaded(self) -> LoadedSlabs:
        """The slabs already here and verified, opened (what the node serves from the start)."""
        from swarm.compute.slabs import LoadedSlabs
        from swarm.sharding.slabs import read_slab_file

        m = self.manifest
        slabs = {(e.layer, e.expert): read_slab_file(self.directory / e.path) for e in self.job.present}
        return LoadedSlabs(
            slabs, m.fingerprint, list(self.job.problems), str(self.directory), m.source.header_sha256
        )

    @property
    def pending(self) -> int:
        if self.result is not None:
            return 0
        return len(self.job.to_fetch) - (self._progress.done_slabs if self._progress else 0)

    def start(self, stop: threading.Event, on_verified: Callable[[SlabEntry], None]) -> None:
        """Fetch the rest on a thread; `on_verified(entry)` for each slab once it is in place."""
        from swarm.node.fetch import Fetcher

        to_fetch = self.job.to_fetch
        self._progress = progress = Progress(sum(e.size for e in to_fetch), len(to_fetch))
        self._fetcher = Fetcher(self.directory, self.sources, stop, self.parallel, progress.bytes)

        def verified(entry: SlabEntry) -> None:
            on_verified(entry)
            progress.slab()

        def run() -> None:
            assert self._fetcher is not None
            try:
                self.result = self._fetcher.run(to_fetch, verified)
            finally:
                progress.close()

        if to_fetch:
            print(
                f"swarm node: fetching {len(to_fetch)} slabs ({progress.total / MiB:.1f} MiB) from "
                f"{len(self.sources.all())} sources into {self.directory}",
                file=sys.stderr,
                flush=True,
            )
        self._thread = threading.Thread(target=run, name="swarm-fetch", daemon=True)
        self._thread.start()

    def failed(self) -> list[str]:
        """The slabs it could not fetch, as LAYER:EXPERT."""
        return [f"{layer}:{e}" for layer, e in sorted(self.result.failed)] if self.result is not None else []

    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def report(self) -> list[str]:
        """The lines that say how the fetch went (for stderr)."""
        r = self.result
        if r is None:
            return [
                "swarm node: fetch interrupted; the partial files are kept: run the same command to resume"
            ]
        if not self.job.to_fetch:
            return [
                f"swarm node: nothing to fetch: the {len(self.job.present)} slabs asked for are here and verify"
            ]
        lines = []
        if r.fetched or not r.failed:
            resumed = f", {r.resumed / MiB:.1f} MiB resumed from partial files" if r.resumed else ""
            lines.append(
                f"swarm node: fetched {len(r.fetched)} slabs ({r.downloaded / MiB:.1f} MiB downloaded{resumed}) "
                f"from {len(r.sources)} sources in {r.seconds:.1f} s"
            )
        for key, why in sorted(r.failed.items()):
            lines.append(f"swarm node: could not fetch slab {key[0]}:{key[1]}: {why}")
        if r.failed:
            lines.append(
                f"swarm node: serving without {len(r.failed)} slabs ({format_slabs(r.failed)}); run the same "
                "command again once a node holds them"
            )
        if r.interrupted:
            lines.append(
                "swarm node: fetch interrupted; the partial files are kept: run the same command to resume"
            )
        return lines

    def close(self) -> None:
        self._exit.close()
