"""A node behind NAT joins by invite: network namespaces for the coordinator, a router and the node; the
router masquerades the node's traffic out and lets nothing in, multicast is dropped, the links are slow
(tc tbf) so that the run lasts. Mid-run the node's address changes under its connections (NAT rebinding):
the link goes silent, the node dials again from its new address, the coordinator's calls fail over meanwhile,
and the text is the in-process text. A node there on an empty directory fetches its slabs over the link, the
only path it has. Everything made is removed, also on failure."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import FIXTURES

from swarm.node.auth import SwarmKey, generate_key_text
from swarm.node.invite import make_invite
from swarm.sharding.identity import identity_of
from swarm.sharding.manifest import read_manifest
from swarm.sharding.shard import shard_model

CLI = [sys.executable, "-m", "swarm.coordinator.cli"]
RUN = ["--prompt", "A list keeps items in order.", "--max-tokens", "40"]
RATE = ["rate", "96kbit", "burst", "1600", "latency", "2s"]  # a decode token: a few hundred ms


def _why_not() -> str | None:
    """Why this machine cannot run the rig, or None when it can."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs Linux and root for network namespaces"
    for tool in ("ip", "tc", "iptables"):
        if shutil.which(tool) is None:
            return f"needs {tool} (./setup installs iptables)"
    probe = f"swj-probe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True)
    nat = subprocess.run(["ip", "netns", "exec", probe, "iptables", "-t", "nat", "-L"], capture_output=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if made.returncode != 0:
        return "cannot create network namespaces here"
    return None if nat.returncode == 0 else "iptables has no nat table in a namespace here"


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


@contextmanager
def nat_rig(tag: str, net: str, slow: bool = True) -> Iterator[dict[str, str]]:
    """Namespaces c (coordinator, net.1.1), r (router: net.1.2 out, net.2.1 in) and n (node, net.2.2 behind
    the router's masquerade), the links rate-limited when `slow`; removed on the way out, whatever happened."""
    ns = {k: f"swj-{tag}-{k}" for k in "crn"}
    try:
        for name in ns.values():
            sh("ip", "netns", "add", name)
            sh("ip", "-n", name, "link", "set", "lo", "up")
        sh("ip", "link", "add", f"swj{tag}c", "netns", ns["c"], "type", "veth", "peer", f"swj{tag}r0", "netns", ns["r"])
        sh("ip", "link", "add", f"swj{tag}n", "netns", ns["n"], "type", "veth", "peer", f"swj{tag}r1", "netns", ns["r"])
        for where, dev, addr in ((ns["c"], f"swj{tag}c", f"{net}.1.1/24"), (ns["r"], f"swj{tag}r0", f"{net}.1.2/24"),
                                 (ns["r"], f"swj{tag}r1", f"{net}.2.1/24"), (ns["n"], f"swj{tag}n", f"{net}.2.2/24")):
            sh("ip", "-n", where, "addr", "add", addr, "dev", dev)
            sh("ip", "-n", where, "link", "set", dev, "up")
        sh("ip", "-n", ns["n"], "route", "add", "default", "via", f"{net}.2.1")
        # a route in, so that what keeps connections out is the NAT's rule, not a missing route
        sh("ip", "-n", ns["c"], "route", "add", f"{net}.2.0/24", "via", f"{net}.1.2")
        sh("ip", "netns", "exec", ns["r"], "sysctl", "-qw", "net.ipv4.ip_forward=1")
        ipt = ["ip", "netns", "exec", ns["r"], "iptables"]
        sh(*ipt, "-t", "nat", "-A", "POSTROUTING", "-o", f"swj{tag}r0", "-j", "MASQUERADE")
        sh(*ipt, "-A", "FORWARD", "-d", "224.0.0.0/4", "-j", "DROP")
        sh(*ipt, "-A", "FORWARD", "-i", f"swj{tag}r0", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
        sh(*ipt, "-A", "FORWARD", "-i", f"swj{tag}r0", "-j", "DROP")  # nothing new comes in
        for chain in ("INPUT", "OUTPUT"):
            sh("ip", "netns", "exec", ns["n"], "iptables", "-A", chain, "-d", "224.0.0.0/4", "-j", "DROP")
        for where, dev in ((ns["r"], f"swj{tag}r1"), (ns["n"], f"swj{tag}n")) if slow else ():
            sh("ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root", "tbf", *RATE)
        yield ns
    finally:
        for name in ns.values():
            for pid in subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split():
                subprocess.run(["kill", "-9", pid], capture_output=True)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _in(ns: str, *cmd: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, *cmd], **kw)


def _swarm_to_join(tmp_path: Path, run: list[str]) -> tuple[Path, Path, Path, subprocess.CompletedProcess, str, str]:
    """(a shard directory, a key file, an invite of it to the rig's coordinator address, the in-process run,
    the rig's tag and network), or a skip where the machine cannot run the rig."""
    why = _why_not()
    if why:
        pytest.skip(why)
    shard = tmp_path / "m.swarm"
    shard_model(FIXTURES / "qwen3moe-tiny" / "model-f32.gguf", shard)
    key_file = tmp_path / "k.key"
    key_file.write_text(generate_key_text())
    local = subprocess.run([*CLI, "run", str(shard), "--local", *run], capture_output=True, timeout=180, check=True)
    tag, net = secrets.token_hex(2), f"10.{secrets.randbelow(150) + 100}"
    invite = tmp_path / "invite.txt"
    invite.write_text(make_invite(SwarmKey.load(key_file), identity_of(shard), [f"{net}.1.1:7470"]).text())
    return shard, key_file, invite, local, tag, net


@pytest.mark.slow
def test_a_node_behind_nat_joins_by_invite_and_survives_rebinding_mid_run(tmp_path):
    shard, key_file, invite, local, tag, net = _swarm_to_join(tmp_path, RUN)
    with nat_rig(tag, net) as ns:
        node_log = tmp_path / "node.log"
        with open(node_log, "wb") as out:
            node = _in(ns["n"], *CLI, "node", str(shard), "--threads", "1", "--join", str(invite),
                       "--link-timeout", "3", "--join-wait", "120", stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        coordinator = _in(ns["c"], *CLI, "run", str(shard), "--key-file", str(key_file), "--listen",
                          f"{net}.1.1:7470", "--wait", "120", *RUN, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        try:
            # nothing connects in: the router drops a new connection from the coordinator's side
            probe = _in(ns["n"], sys.executable, "-c", "import socket,time; s=socket.create_server(('0.0.0.0', 9)); time.sleep(30)")
            time.sleep(0.5)
            inward = subprocess.run(["ip", "netns", "exec", ns["c"], sys.executable, "-c",
                                     f"import socket; socket.create_connection(('{net}.2.2', 9), timeout=2)"],
                                    capture_output=True, text=True)  # fmt: skip
            probe.kill()
            assert inward.returncode != 0 and "timed out" in inward.stderr, inward.stderr
            text = b""
            os.set_blocking(coordinator.stdout.fileno(), False)
            deadline = time.monotonic() + 240
            while len(text) < len(local.stdout) // 4:  # a quarter of the answer is out: rebind the node
                assert coordinator.poll() is None, coordinator.stderr.read().decode() + node_log.read_text()
                assert time.monotonic() < deadline, node_log.read_text()
                text += coordinator.stdout.read() or b""
                time.sleep(0.05)
            dev = f"swj{tag}n"
            sh("ip", "-n", ns["n"], "addr", "del", f"{net}.2.2/24", "dev", dev)
            sh("ip", "-n", ns["n"], "addr", "add", f"{net}.2.3/24", "dev", dev)
            sh("ip", "-n", ns["n"], "route", "add", "default", "via", f"{net}.2.1")
            rest, err = coordinator.communicate(timeout=240)
            assert coordinator.returncode == 0, err.decode() + node_log.read_text()
            assert text != local.stdout, "the node was rebound mid-run, not after it"
            assert text + rest == local.stdout
            log = node_log.read_text()
            assert "(link 2)" in log and "nothing heard for 3 s" in log, log  # it dialed again, after a silence
        finally:
            for p in (coordinator, node):
                if p.poll() is None:
                    p.terminate()
                    p.wait(20)
        assert node.returncode == 0, node_log.read_text()  # it stopped cleanly on SIGTERM
        assert subprocess.run(["ip", "netns", "pids", ns["n"]], capture_output=True, text=True).stdout == ""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"swj-{tag}-" not in listed, "the rig removed its namespaces"
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert f"swj{tag}" not in links


@pytest.mark.slow
def test_a_node_behind_nat_on_an_empty_directory_fetches_over_its_link(tmp_path):
    """The node has the invite and nothing else (no key, no multicast, no way in): its manifest and slabs come
    from the coordinator over the link it dials, and the run is the in-process run."""
    run = ["--prompt", "A list keeps items in order.", "--max-tokens", "12"]
    shard, key_file, invite, local, tag, net = _swarm_to_join(tmp_path, run)
    dest = tmp_path / "phone"
    with nat_rig(tag, net, slow=False) as ns:
        node_log = tmp_path / "node.log"
        with open(node_log, "wb") as out:
            node = _in(ns["n"], *CLI, "node", str(dest), "--fetch", "--threads", "1", "--join", str(invite),
                       "--join-wait", "120", stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            coordinator = subprocess.run(
                ["ip", "netns", "exec", ns["c"], *CLI, "run", str(shard), "--key-file", str(key_file), "--listen",
                 f"{net}.1.1:7470", "--wait", "120", *run], capture_output=True, timeout=300,
            )  # fmt: skip
            assert coordinator.returncode == 0, coordinator.stderr.decode() + node_log.read_text()
            assert coordinator.stdout == local.stdout
            slabs = {p.relative_to(dest).as_posix() for p in dest.rglob("*.gguf")}
            assert slabs == {e.path for e in read_manifest(shard).slabs}
            assert all((dest / p).read_bytes() == (shard / p).read_bytes() for p in slabs)
            assert "joined the coordinator at" in node_log.read_text()
        finally:
            if node.poll() is None:
                node.terminate()
                node.wait(20)
        assert node.returncode == 0, node_log.read_text()
