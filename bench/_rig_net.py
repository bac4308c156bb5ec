"""A rig device's own network: a namespace named after the device, one veth pair to the host (a /30 of its own,
so a device reaches the host and the host the device, and nothing else), and `tc tbf` on both ends where the
device's link has a bandwidth. Latency is not added here (there is no netem on these machines): the delaying
relay (bench/_relay.py) runs on the host in front of the device's address.

Deleting the namespace deletes its end of the pair and with it the host's end; the sweep also deletes host
ends whose namespace is already gone (a run killed between the two `ip` calls)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import zlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """A device's namespace and its link: `ip` is the device's address, `host_ip` the host's on the link."""

    ns: str
    host_if: str
    ip: str
    host_ip: str


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def lacks(shaped: bool) -> list[str]:
    missing = [] if shutil.which("ip") else ["iproute2's ip (network namespaces)"]
    if shaped and not shutil.which("tc"):
        missing.append("iproute2's tc (a link's bandwidth)")
    return missing


def _subnet(tag: str, index: int) -> tuple[str, str]:
    """The host's and the device's addresses on a /30 picked from the run's id, so two rigs' links differ."""
    h = zlib.crc32(tag.split("-")[1].encode())
    n = ((h & 0xFF) << 6 | index % 64) * 4  # 64 devices a run
    third, fourth = (n >> 8) & 255, n & 255
    base = f"10.{((h >> 8) % 64) + 128}.{third}"
    return f"{base}.{fourth + 1}", f"{base}.{fourth + 2}"


def make_link(tag: str, index: int, rate: str | None) -> Link:
    # swrig-RUN-N: within the 15 characters an interface's name may have
    host_if = f"{'-'.join(tag.split('-')[:2])}-{index}"
    host_ip, ip = _subnet(tag, index)
    link = Link(tag, host_if, ip, host_ip)
    _sh("ip", "netns", "add", tag)
    _sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", tag)
    _sh("ip", "addr", "add", f"{host_ip}/30", "dev", host_if)
    _sh("ip", "link", "set", host_if, "up")
    _sh("ip", "-n", tag, "addr", "add", f"{ip}/30", "dev", "eth0")
    _sh("ip", "-n", tag, "link", "set", "eth0", "up")
    _sh("ip", "-n", tag, "link", "set", "lo", "up")
    _sh("ip", "-n", tag, "route", "add", "default", "via", host_ip)
    if rate:  # both directions: what reaches the device and what it sends back
        tbf = ("root", "tbf", "rate", rate, "burst", "64kb", "latency", "100ms")
        _sh("tc", "qdisc", "add", "dev", host_if, *tbf)
        _sh("ip", "netns", "exec", tag, "tc", "qdisc", "add", "dev", "eth0", *tbf)
    return link


def _kill_in(ns: str) -> None:
    for pid in _sh("ip", "netns", "pids", ns, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def remove_link(link: Link) -> list[str]:
    """Remove the namespace (its processes killed first) and the host's end; what could not be removed."""
    _kill_in(link.ns)
    errors = []
    if link.ns in _namespaces(link.ns):
        proc = _sh("ip", "netns", "del", link.ns, check=False)
        if proc.returncode != 0:
            errors.append(f"netns {link.ns}: {proc.stderr.strip()}")
    if link.host_if in _links(link.host_if):
        _sh("ip", "link", "del", link.host_if, check=False)
    return errors


def _namespaces(prefix: str) -> list[str]:
    if not shutil.which("ip"):
        return []
    out = _sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def _links(prefix: str) -> list[str]:
    if not shutil.which("ip"):
        return []
    out = _sh("ip", "-o", "link", "show", check=False).stdout
    names = [line.split(": ")[1].split("@")[0] for line in out.splitlines() if ": " in line]
    # a host end is named swrig-RUN-N: its tag prefix without the device name
    short = "-".join(prefix.split("-")[:2])
    return [n for n in names if n.startswith(short)]


def leftovers(prefix: str) -> list[str]:
    return [f"netns {n}" for n in _namespaces(prefix)] + [f"link {n}" for n in _links(prefix)]


def sweep(prefix: str) -> None:
    for ns in _namespaces(prefix):
        _kill_in(ns)
        _sh("ip", "netns", "del", ns, check=False)
    for name in _links(prefix):
        _sh("ip", "link", "del", name, check=False)
