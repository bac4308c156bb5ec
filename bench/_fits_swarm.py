"""The swarm on capped devices for bench/fits.py: node processes, each in its own memory group, holding
disjoint expert ranges of every layer; `swarm run` in a group of its own with the same cap; the nodes reached
directly over loopback or through the delaying relay (bench/_relay.py)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from _fits_groups import JOIN, Device, MiB, drop_page_cache
from _relay import relay

from swarm.compute.expert_copies import LATER_BYTES, MARGIN_FRACTION, MIN_MARGIN
from swarm.coordinator.cli.spawn import LocalNode, spawn_node, stop_nodes
from swarm.node.client import NodeClient
from swarm.sharding.slabs import read_manifest

SPEED = re.compile(r"prefill: (\d+) tokens, ([\d.]+) tok/s \| decode: (\d+) tokens, ([\d.]+) tok/s")
DRAFTED = Path(__file__).resolve().parent / "_rig_drafted.py"  # a drafted run's coordinator
RELAY_HOST = "127.0.0.2"  # the relay listens here at the nodes' own port numbers (see bench/_relay.py)
START_ANON = 24 * MiB  # a node's anonymous memory when it sizes its budget (measured: 18-20 MiB)
# The nodes' heap, where bench/fits.py is told to set it (--node-tunables): with swarm.compute.malloc's
# settings (blocks up to 32 MiB from the heap, 1 GiB of a freed top kept) the memory of an evicted repacked
# copy (589,824-byte matrices) can stay in the process, and a node under a cap grows past its budget until
# the kernel kills it (measured once: 1,008-1,580 MiB resident for a 522 MiB budget). A fixed mmap threshold
# under a copy's size gives it back at eviction.
MMAP_TUNABLES = "glibc.malloc.mmap_threshold=262144"


def node_budget(limit: int) -> int:
    """The budget a node under `limit` gives itself (swarm.compute.expert_copies.default_memory_budget)."""
    return limit - START_ANON - LATER_BYTES - max(MIN_MARGIN, limit // MARGIN_FRACTION)


def nodes_needed(shard_dir: Path, limit: int) -> int:
    """How many devices capped at `limit` keep every expert resident between them."""
    expert_bytes = sum(s.size for s in read_manifest(shard_dir).slabs)
    return max(1, math.ceil(expert_bytes / max(1, node_budget(limit))))


@dataclass(frozen=True)
class SwarmRun:
    prompt_tokens: int
    prompt_tps: float | None  # None: the run failed (why says how)
    decode_tokens: int
    decode_tps: float | None
    peak: int  # the coordinator's group
    why: str = ""
    # through the relay: bytes it carried to and from the nodes' gRPC ports and their compute streams (every
    # node's stream among them: see CappedSwarm.run), and the mean delay it added past the set one, ms
    grpc_bytes: int = 0
    stream_bytes: int = 0
    late_ms: float = 0.0
    # with drafts (bench/_rig_drafted.py): decode_tps is the drafted run's; these the same engine's without
    undrafted_tps: float | None = None
    drafts_made: int = 0
    drafts_kept: int = 0


class CappedSwarm:
    """n nodes, each on a device capped at `limit`, holding disjoint expert ranges of every layer. `devices`
    (one a node) and `coordinator` (a fresh device a run) replace the memory groups with other devices that
    have their methods (bench/_rig.py's: their own CPU too); the relay runs on `relay_device` where given."""

    def __init__(
        self,
        shard_dir: Path,
        limit: int,
        n_nodes: int,
        workdir: Path,
        tunables: str = "",
        devices: Sequence[Any] | None = None,
        coordinator: Callable[[], Any] | None = None,
        relay_device: Any = None,
    ) -> None:
        self.shard_dir, self.limit, self.workdir = shard_dir, limit, workdir
        n_expert = read_manifest(shard_dir).n_expert
        cuts = [n_expert * i // n_nodes for i in range(n_nodes + 1)]
        drop_page_cache(shard_dir)
        disk = shard_dir / "manifest.json"
        self.devices = (
            list(devices)
            if devices is not None
            else [Device(limit, f"node{i}", disk) for i in range(n_nodes)]
        )
        self.coordinator = coordinator or (lambda: Device(self.limit, "coordinator", disk))
        self.relay_prefix = (sys.executable, "-c", JOIN, *relay_device.procs(), "--") if relay_device else ()
        self.nodes: list[LocalNode] = []
        try:
            for i, dev in enumerate(self.devices):
                args = ["--no-mdns", "--experts", f"{cuts[i]}-{cuts[i + 1] - 1}"]
                program = ("-c", JOIN, *dev.procs(), "--swarm")
                env = {"GLIBC_TUNABLES": tunables} if tunables else None
                self.nodes.append(spawn_node(shard_dir, args, workdir, f"fits-node{i}", env, program))
            for node in self.nodes:
                node.wait_ready(600)
            self.stream_ports = [self._stream_port(n) for n in self.nodes]
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _stream_port(node: LocalNode) -> int:
        with NodeClient(node.address, fingerprint=node.fingerprint) as client:
            return client.info().stream_port

    def alive(self) -> bool:
        return all(n.process.poll() is None for n in self.nodes)

    def peaks(self) -> list[int]:
        return [d.peak() for d in self.devices]

    def anon(self) -> list[int]:
        return [d.anon() for d in self.devices]

    def oom_kills(self) -> int:
        return sum(d.oom_kills() for d in self.devices)

    def disk_reads(self) -> int | None:
        """Bytes the nodes have read from disk so far, all together (None: not known)."""
        reads = [d.read_bytes() for d in self.devices]
        return None if any(r is None for r in reads) else sum(r or 0 for r in reads)

    def run(
        self, rtt_ms: float, prompt: str, n_decode: int, threads: int, audit: bool = False,
        drafts: tuple[int, float, int] | None = None,
    ) -> SwarmRun:  # fmt: skip
        """One `swarm run` on its own capped device: directly (rtt_ms 0) or through a relay adding rtt_ms.
        `audit`: the coordinator checks answers at its default rate (else `--audit 0`). `drafts` (k, the chance a
        draft is wrong, the seed of its draws): bench/_rig_drafted.py in its place, the same run with and
        without k drafts a pass."""
        extra = ["--threads", str(threads), *([] if audit else ["--audit", "0"])]
        if drafts is not None:
            extra += ["--drafts", str(drafts[0]), "--wrong", str(drafts[1]), "--seed", str(drafts[2])]
        if not rtt_ms:
            return self._run([n.address for n in self.nodes], prompt, n_decode, extra, drafts is not None)
        grpc = [f"{RELAY_HOST}:{n.port}" for n in self.nodes]
        streams = [f"{RELAY_HOST}:{port}" for port in self.stream_ports]
        pairs = [(a, a.replace(RELAY_HOST, "127.0.0.1")) for a in grpc + streams]
        with relay(pairs, rtt_ms, self.relay_prefix) as said:
            run = self._run(grpc, prompt, n_decode, extra, drafts is not None)
        carried: dict[str, int] = said.get("carried", {})  # type: ignore[assignment]
        missing = [a for a in streams if not carried.get(a)]
        if run.decode_tps is not None and missing:
            # a node's compute calls went around the relay (or over gRPC): its figure would be partly fake
            why = f"no compute-stream bytes crossed the relay for {', '.join(missing)}"
            return SwarmRun(0, None, 0, None, run.peak, why)
        late: list[float] = said.get("late_ms", [0.0])  # type: ignore[assignment]
        return replace(
            run,
            grpc_bytes=sum(carried.get(a, 0) for a in grpc),
            stream_bytes=sum(carried.get(a, 0) for a in streams),
            late_ms=late[0],
        )

    def _run(self, peers: list[str], prompt: str, n_decode: int, extra: list[str], drafted: bool = False) -> SwarmRun:
        # each coordinator reads the dense weights into its own group (the run before would have them
        # resident, charged to its group, for free)
        drop_page_cache(self.shard_dir / "dense.gguf", self.shard_dir / "manifest.json")
        dev = self.coordinator()
        peer_args = [a for p in peers for a in ("--peer", p)]
        program = ["--", sys.executable, str(DRAFTED)] if drafted else ["--swarm"]
        cmd = [sys.executable, "-c", JOIN, *dev.procs(), *program, "run", str(self.shard_dir), "--no-mdns",
               *peer_args, "--prompt", prompt, "--max-tokens", str(n_decode), *extra]  # fmt: skip
        try:
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                (self.workdir / "coordinator.log").write_text(proc.stderr)  # the last run's, to look into
            except subprocess.TimeoutExpired:
                return SwarmRun(0, None, 0, None, dev.peak(), "no result in 600 s")
            if drafted and proc.returncode == 0 and "RESULT " in proc.stdout:
                r = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
                return SwarmRun(r["prompt_tokens"], r["drafted"][0], r["decode_tokens"], r["drafted"][1], dev.peak(),
                                undrafted_tps=r["plain"][1], drafts_made=r["drafts_made"],
                                drafts_kept=r["drafts_kept"])  # fmt: skip
            found = SPEED.search(proc.stderr)
            if proc.returncode != 0 or not found:
                killed = dev.oom_kills() > 0
                why = (
                    "killed by the cap (OOM)"
                    if killed
                    else f"exit code {proc.returncode}: {proc.stderr[-300:]}"
                )
                return SwarmRun(0, None, 0, None, dev.peak(), why)
            pt, ptps, dt, dtps = found.groups()
            return SwarmRun(int(pt), float(ptps), int(dt), float(dtps), dev.peak())
        finally:
            dev.close()

    def close(self) -> None:
        stop_nodes(self.nodes)
        for d in self.devices:
            d.close()
