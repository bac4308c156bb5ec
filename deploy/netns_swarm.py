"""A multi-host swarm on one Linux machine: every node in a network namespace of its own.

    sudo python deploy/netns_swarm.py q36.swarm --nodes 4 --replicas 2 --rate 100mbit -- --prompt "Hello"

Builds a bridge (10.77.0.1/24 on the host side) and, per node, a namespace `swarm-TAG-nI` joined to it
by a veth pair (10.77.0.1I/24), optionally shaped with a token bucket (`--rate`, tc tbf: the bandwidth of a
phone on Wi-Fi). Placement is `swarm plan DIR --replicas R --json` over the nodes. A seed node serves DIR
on the bridge (host side, not advertised); every namespace node starts on an EMPTY directory with
`swarm node EMPTY --fetch --peer SEED --plan plan.json --name nI --host 10.77.0.1I` and fetches its slabs
across its link (from the seed, or from the other nodes as they get theirs: mDNS finds them). Once every
node has fetched its slabs the seed stops, and `swarm run DIR --mdns-interface 10.77.0.1 ARGS...` runs on
the host. So discovery is real multicast mDNS across interfaces, and every slab and every expert call
crosses a veth link: what loopback tests cannot show. Traffic stays on the bridge and in the namespaces,
and everything the rig creates is removed on the way out, Ctrl-C included. Needs root (or CAP_NET_ADMIN)
and iproute2; `tc netem` (latency) is not needed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Net:
    """The names and addresses of one rig; `tag` keeps two rigs on one machine apart."""

    tag: str = "0"
    subnet: str = "10.77.0"  # the first three octets of a /24

    @property
    def bridge(self) -> str:
        return f"swbr{self.tag}"

    @property
    def host_ip(self) -> str:
        return f"{self.subnet}.1"

    def ns(self, i: int) -> str:
        return f"swarm-{self.tag}-n{i}"

    def veth(self, i: int) -> str:
        return f"swv{self.tag}x{i}"  # at most 15 characters: keep tags short

    def ip(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def build_network(net: Net, n: int, rate: str | None) -> None:
    sh("ip", "link", "add", net.bridge, "type", "bridge")
    # No IGMP querier on this bridge: with snooping on, it would drop the mDNS multicast between ports.
    sh("ip", "link", "set", net.bridge, "type", "bridge", "mcast_snooping", "0")
    sh("ip", "addr", "add", f"{net.host_ip}/24", "dev", net.bridge)
    sh("ip", "link", "set", net.bridge, "up")
    for i in range(n):
        ns, host_end = net.ns(i), net.veth(i)
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "link", "set", host_end, "master", net.bridge)
        sh("ip", "link", "set", host_end, "up")
        sh("ip", "-n", ns, "addr", "add", f"{net.ip(i)}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "route", "add", "224.0.0.0/4", "dev", "eth0")
        if rate:  # both directions: what reaches the node and what it sends back
            tbf = ("root", "tbf", "rate", rate, "burst", "64kb", "latency", "100ms")
            sh("tc", "qdisc", "add", "dev", host_end, *tbf)
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", *tbf)


def tear_down(net: Net, n: int) -> None:
    for i in range(n):
        sh("ip", "netns", "del", net.ns(i), check=False)
        sh("ip", "link", "del", net.veth(i), check=False)
    sh("ip", "link", "del", net.bridge, check=False)


SWARM = (sys.executable, "-m", "swarm.coordinator.cli")


def make_plan(model: str, n: int, replicas: int, workdir: Path) -> Path:
    """`swarm plan` over n equal nodes with room for `replicas` copies of every slab (and a quarter more for
    the hot experts the plan adds holders to)."""
    manifest = json.loads((Path(model) / "manifest.json").read_text())
    total = sum(int(s["size"]) for s in manifest["slabs"])
    capacity = math.ceil(1.25 * replicas * total / n) + max(int(s["size"]) for s in manifest["slabs"])
    out = subprocess.run([*SWARM, "plan", model, "--capacities", ",".join([str(capacity)] * n), "--names",
                          ",".join(f"n{i}" for i in range(n)), "--replicas", str(replicas), "--json"],
                         check=True, capture_output=True, text=True)  # fmt: skip
    plan = workdir / "plan.json"
    plan.write_text(out.stdout)
    return plan


def start_seed(net: Net, model: str, workdir: Path, extra: list[str]) -> subprocess.Popen[bytes]:
    """A node on the shard directory, on the bridge's host address: where the empty nodes fetch from. It
    is not advertised, so the coordinator never computes on it."""
    log = open(workdir / "seed.log", "wb")  # noqa: SIM115 - open for the node's lifetime
    cmd = [*SWARM, "node", model, "--host", net.host_ip, "--port", "0", "--no-mdns", "--threads", "1",
           "--ready-file", str(workdir / "seed.ready.json"), *extra]  # fmt: skip
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def start_node(
    net: Net, i: int, seed: str, plan: Path, workdir: Path, extra: list[str]
) -> subprocess.Popen[bytes]:
    """Node i in its namespace on an empty directory, fetching the slabs the plan gives it."""
    log = open(workdir / f"node{i}.log", "wb")  # noqa: SIM115 - open for the node's lifetime
    cmd = ["ip", "netns", "exec", net.ns(i), *SWARM, "node", str(workdir / f"node{i}.swarm"), "--fetch",
           "--peer", seed, "--plan", str(plan), "--name", f"n{i}", "--host", net.ip(i), "--port", "0",
           "--threads", "1", "--ready-file", str(workdir / f"node{i}.ready.json"), *extra]  # fmt: skip
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def wait_ready(
    workdir: Path, names: list[str], procs: list[subprocess.Popen[bytes]], timeout: float
) -> list[dict[str, object]]:
    """Each process's ready file once it serves with nothing left to fetch (SystemExit when one fails)."""
    deadline = time.monotonic() + timeout
    out = []
    for name, proc in zip(names, procs, strict=True):
        ready = workdir / f"{name}.ready.json"
        while not ready.exists() or json.loads(ready.read_text()).get("pending"):
            if proc.poll() is not None:
                log = (workdir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise SystemExit(f"{name} exited ({proc.returncode}):\n{log}")
            if time.monotonic() > deadline:
                raise SystemExit(f"{name} not serving all its slabs after {timeout:.0f} s")
            time.sleep(0.1)
        info = json.loads(ready.read_text())
        if info.get("fetch_failed"):
            raise SystemExit(f"{name} could not fetch slabs {info['fetch_failed']}; see {name}.log")
        out.append(info)
    return out


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The rig's arguments, and those after `--` that go to `swarm run`."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a `swarm shard` directory")
    p.add_argument("--nodes", type=int, default=3, help="nodes, each in a namespace of its own")
    p.add_argument("--replicas", type=int, default=1, help="nodes holding each slab (swarm plan --replicas)")
    p.add_argument("--rate", default=None, help="bandwidth of each node's link, e.g. 100mbit (tc tbf)")
    p.add_argument(
        "--key-file",
        type=Path,
        default=None,
        help="swarm key for the nodes and the coordinator (default: a new one for this rig; nodes off "
        "loopback need a key, and serve TLS with it)",
    )
    p.add_argument("--keep-logs", type=Path, default=None, help="copy the node logs here at the end")
    p.add_argument("--tag", default="0", help="a short name for this rig (1-4 characters), to run several")
    p.add_argument("--subnet", default="10.77.0", help="first three octets of the rig's /24")
    p.epilog = "Everything after -- goes to `swarm run`."
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    return p.parse_args(argv[:cut]), argv[cut + 1 :]


def refusal(args: argparse.Namespace) -> str | None:
    """Why the rig cannot run as asked (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc)"
    if not 1 <= len(args.tag) <= 4 or not args.tag.isalnum():
        return "--tag must be 1-4 letters or digits"
    if not 1 <= args.replicas <= args.nodes:
        return "--replicas must be between 1 and --nodes"
    return None


def run_rig(
    net: Net,
    args: argparse.Namespace,
    run_args: list[str],
    workdir: Path,
    key_args: list[str],
    procs: list[subprocess.Popen[bytes]],
) -> int:
    """Build the network, fetch the slabs into the namespace nodes, then `swarm run` on the host: its exit
    status. Every process it starts goes into `procs`, for the caller to stop."""
    total = args.nodes
    tear_down(net, total)  # leftovers of a run that was killed
    build_network(net, total, args.rate)
    plan = make_plan(args.model, total, args.replicas, workdir)
    seed = start_seed(net, args.model, workdir, key_args)
    procs.append(seed)
    (seed_info,) = wait_ready(workdir, ["seed"], [seed], timeout=120)
    nodes = [start_node(net, i, str(seed_info["address"]), plan, workdir, key_args) for i in range(total)]
    procs += nodes
    infos = wait_ready(workdir, [f"node{i}" for i in range(total)], nodes, timeout=300)
    seed.terminate()  # from here on the swarm is the namespace nodes alone
    seed.wait(timeout=10)
    for i, info in enumerate(infos):
        print(f"node {i}: namespace {net.ns(i)}, {net.ip(i)}, fetched slabs {info['held']}", file=sys.stderr)
    cmd = [
        *SWARM,
        "run",
        args.model,
        "--mdns-interface",
        net.host_ip,
        "--wait",
        "10",
        *key_args,
        *run_args,
    ]
    return subprocess.run(cmd).returncode


def clean_up(net: Net, args: argparse.Namespace, workdir: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    """Stop the rig's processes, remove its network, keep the logs where asked."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    tear_down(net, args.nodes)
    if args.keep_logs:
        args.keep_logs.mkdir(parents=True, exist_ok=True)
        for f in workdir.glob("*.log"):
            shutil.copy(f, args.keep_logs / f.name)
    shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args, run_args = parse_args(argv)
    why = refusal(args)
    if why is not None:
        print(f"netns_swarm: {why}", file=sys.stderr)
        return 2
    net = Net(args.tag, args.subnet)
    workdir = Path(tempfile.mkdtemp(prefix="netns-swarm-"))
    key_file = args.key_file
    if key_file is None:
        key_file = workdir / "swarm.key"
        subprocess.run([*SWARM, "keygen", "--out", str(key_file)],
                       check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    key_args = ["--key-file", str(key_file)]
    procs: list[subprocess.Popen[bytes]] = []
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return run_rig(net, args, run_args, workdir, key_args, procs)
    except KeyboardInterrupt:
        return 130
    finally:
        clean_up(net, args, workdir, procs)
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
