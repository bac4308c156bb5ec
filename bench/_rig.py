"""The device rig the benches share: a "device" is a cgroup with its own CPU (a cpuset and/or a CFS quota with a
short period) and its own memory cap, optionally its own network namespace (bench/_rig_net.py) behind the
delaying relay, and for llama.cpp the model file on a loop device with a chosen read-ahead (bench/_rig_disk.py).

    with Rig() as rig:
        coord = rig.device(DeviceSpec("coord", cpus="0", memory=600 * MiB))
        node = rig.device(DeviceSpec("node0", cpus="1", cpu_share=0.25, memory=900 * MiB, netns=True))
        proc = rig.popen(node, ["swarm", "node", ...])

Everything the rig makes is named with PREFIX and the run's id, and everything is undone by Rig.close(), which
runs on leaving the block, at interpreter exit, and on SIGINT/SIGTERM. A run killed with SIGKILL leaves its
groups, namespaces, mounts and loop devices behind: `sweep()` (or `python bench/_rig.py --sweep`) finds them by
the prefix and removes them, killing what still runs in a leftover group first (a group is how the rig keeps
track of its processes: every process it starts joins one, so none can escape the sweep by forking).

Every device's cpu group gets a weight in proportion to its share and far above an ordinary process's (`_weight`):
when other work shares the machine's cores, a device still gets its quota (what a real device would have), and
the quota, not the weight, bounds it.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _rig_cpus  # noqa: E402
import _rig_disk  # noqa: E402
import _rig_net  # noqa: E402

log = logging.getLogger(__name__)
MiB = 1 << 20
PREFIX = "swrig"  # short: network interface names are at most 15 characters
CGROUP = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("cpu", "cpuset", "memory", "blkio")
MIN_QUOTA_US = 1000  # the kernel's smallest CFS quota (and period)
DEFAULT_PERIOD_US = 10_000
MAX_SHARES = 262144  # cpu.shares' upper bound (v1); cpu.weight's is 10000 (v2)
MAX_CORES = 8  # the largest share a device's weight is scaled for
REST = "rest"  # the cpuset group the machine's other processes wait in while a rig holds cores (Rig.reserve)


def _weight(share: float, top: int) -> int:
    """A device's scheduler weight: in proportion to its share, so that devices on one core split it as their
    quotas do while all are runnable (with equal weights a quarter-core device beside a half-core one got 0.22 of
    the core: it spent its quota at half speed and then waited on the half-core one's), and far above an
    ordinary process's 1024 (v1) or 100 (v2), so that other work does not take a device's quota."""
    return max(2, min(top, round(top * share / MAX_CORES)))


@dataclass(frozen=True)
class DeviceSpec:
    """One device: `cpus` a cpuset ("0", "1-3"; None: any core), `cpu_share` cores of CPU time by CFS quota
    (0.25: a quarter of one core; None: no quota), `memory` its cap in bytes (None: measured, not capped),
    `netns` its own network namespace, `rate` that link's bandwidth (tc tbf, e.g. "20mbit")."""

    name: str
    cpus: str | None = None
    cpu_share: float | None = None
    memory: int | None = None
    netns: bool = False
    rate: str | None = None
    period_us: int | None = None  # None: `period`'s default

    @property
    def period(self) -> int:
        """The CFS period, µs. Shorter periods throttle in smaller steps (a device out of quota waits less), but
        the kernel enforces a quota only at its ticks and bandwidth slices: at the shortest periods a device
        gets less than its quota (measured here: 0.32 of a core for a half-core quota at 2 ms, 0.38-0.44 at
        4-5 ms; within 1 % from 8 ms). 10 ms is the default; a quota is at least 1 ms, so small shares get a
        longer period. bench/_rig_check.py measures both the share and the latency throttling adds."""
        if self.period_us is not None:
            return self.period_us
        share = self.cpu_share or 1.0
        return max(DEFAULT_PERIOD_US, min(1_000_000, round(MIN_QUOTA_US / share)))


class Lacks(RuntimeError):
    """What this machine lacks for a rig (not root, no controller): the message says what to do."""


def cgroup_version() -> int:
    """2 where the unified hierarchy is the machine's only one (cgroup.controllers at the root), else 1."""
    return 2 if (CGROUP / "cgroup.controllers").exists() else 1


def lacks(spec: DeviceSpec | None = None) -> list[str]:
    """What this machine lacks to make devices (of `spec`, or of any kind): empty when nothing."""
    missing: list[str] = []
    if sys.platform != "linux":
        return ["Linux (cgroups, network namespaces, loop devices)"]
    if os.geteuid() != 0:
        missing.append("root (cgroups, namespaces and loop devices need it: run with sudo)")
    if cgroup_version() == 2:
        have = set((CGROUP / "cgroup.controllers").read_text().split())
        need = {"cpu", "memory", "cpuset"} if spec is None else _v2_needs(spec)
        missing += [
            f"the cgroup v2 {c} controller (add it to cgroup.subtree_control)" for c in sorted(need - have)
        ]
    else:
        need = {"cpu", "cpuset", "memory"} if spec is None else _v1_needs(spec)
        for c in sorted(need):
            if not (CGROUP / c / "cgroup.procs").exists():
                missing.append(
                    f"the cgroup v1 {c} controller (mount -t cgroup -o {c} cgroup /sys/fs/cgroup/{c})"
                )
    if spec is not None and spec.netns:
        missing += _rig_net.lacks(spec.rate is not None)
    return missing


def _v1_needs(spec: DeviceSpec) -> set[str]:
    need = {"memory"}  # always: it is how the rig tracks a device's processes and measures their peak
    if spec.cpu_share is not None:
        need.add("cpu")
    if spec.cpus is not None:
        need.add("cpuset")
    return need


def _v2_needs(spec: DeviceSpec) -> set[str]:
    return {"memory"} | ({"cpu"} if spec.cpu_share else set()) | ({"cpuset"} if spec.cpus else set())


class Device:
    """A made device: its cgroup directories (one per v1 controller, or the one v2 group), its namespace."""

    def __init__(self, spec: DeviceSpec, tag: str) -> None:
        self.spec = spec
        self.tag = tag
        self.groups: list[Path] = []
        self.memory_group = CGROUP / self.tag if cgroup_version() == 2 else CGROUP / "memory" / tag
        self.net: _rig_net.Link | None = None

    def _make(self, index: int) -> None:
        spec = self.spec
        if cgroup_version() == 2:
            g = CGROUP / self.tag
            g.mkdir()
            self.groups.append(g)
            if spec.cpus is not None:
                (g / "cpuset.cpus").write_text(spec.cpus)
            if spec.cpu_share is not None:
                (g / "cpu.max").write_text(f"{round(spec.cpu_share * spec.period)} {spec.period}")
                (g / "cpu.weight").write_text(str(_weight(spec.cpu_share, 10000)))
            if spec.memory is not None:
                (g / "memory.max").write_text(str(spec.memory))
                if (g / "memory.swap.max").exists():
                    (g / "memory.swap.max").write_text("0")
        else:
            for c in sorted(_v1_needs(spec)):
                g = CGROUP / c / self.tag
                g.mkdir()
                self.groups.append(g)
                if c == "cpuset":
                    (g / "cpuset.mems").write_text((CGROUP / "cpuset" / "cpuset.mems").read_text().strip())
                    (g / "cpuset.cpus").write_text(spec.cpus or "")
                elif c == "cpu":
                    assert spec.cpu_share is not None
                    quota = round(spec.cpu_share * spec.period)
                    if quota < MIN_QUOTA_US:
                        raise ValueError(
                            f"device {spec.name}: a quota of {quota} µs is under the kernel's 1 ms"
                        )
                    (g / "cpu.cfs_period_us").write_text(str(spec.period))
                    (g / "cpu.cfs_quota_us").write_text(str(quota))
                    (g / "cpu.shares").write_text(str(_weight(spec.cpu_share, MAX_SHARES)))
                elif c == "memory" and spec.memory is not None:
                    (g / "memory.limit_in_bytes").write_text(str(spec.memory))
                    with contextlib.suppress(OSError):  # no swap accounting: nothing to forbid
                        (g / "memory.swappiness").write_text("0")
        if spec.netns:
            self.net = _rig_net.make_link(self.tag, index, spec.rate)

    @property
    def procs_files(self) -> list[Path]:
        return [g / "cgroup.procs" for g in self.groups]

    def pids(self) -> list[int]:
        """The processes in the device now."""
        return _pids(self.memory_group)

    def peak(self) -> int:
        """The most memory (anonymous and page cache) charged to the device at once."""
        g = self.memory_group
        for name in ("memory.max_usage_in_bytes", "memory.peak"):
            if (g / name).exists():
                return int((g / name).read_text())
        return int((g / "memory.current").read_text())  # a v2 kernel before 5.19 keeps no peak

    def oom_kills(self) -> int:
        g = self.memory_group
        for name in ("memory.oom_control", "memory.events"):
            if (g / name).exists():
                for line in (g / name).read_text().splitlines():
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
        return 0

    def procs(self) -> list[str]:
        """The cgroup.procs files a process joins to run on this device (bench/_fits_groups.JOIN takes them)."""
        return [str(f) for f in self.procs_files]

    def anon(self) -> int:
        """Anonymous memory charged to the device now (its processes' own: never evicted, there is no swap)."""
        stat = dict(line.split() for line in (self.memory_group / "memory.stat").read_text().splitlines())
        return int(stat.get("total_rss", stat.get("anon", 0))) + int(
            stat.get("total_shmem", stat.get("shmem", 0))
        )

    def read_bytes(self) -> int | None:
        """Bytes read from disk: not counted on a rig device (bench/_fits_groups' blkio groups count them)."""
        return None

    def close(self) -> None:
        """Remove the device now (what runs in it killed); the rig's close() does this for every device left."""
        for g in self.groups:
            _remove_group(g)
        if self.net is not None:
            _rig_net.remove_link(self.net)
            self.net = None

    def command(self, argv: Sequence[str]) -> list[str]:
        """argv as it runs on this device: inside its namespace where it has one."""
        return (["ip", "netns", "exec", self.net.ns, *argv]) if self.net is not None else list(argv)


def _pids(group: Path) -> list[int]:
    try:
        return [int(x) for x in (group / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def _remove_group(group: Path, timeout: float = 10.0) -> None:
    """Kill what runs in the group, then remove it."""
    _rig_cpus.empty_and_remove(group, lambda pid: os.kill(pid, signal.SIGKILL), timeout)


def _all_groups(tag_prefix: str) -> list[Path]:
    roots = [CGROUP] if cgroup_version() == 2 else [CGROUP / c for c in V1_CONTROLLERS]
    return [g for r in roots if r.is_dir() for g in sorted(r.glob(f"{tag_prefix}*")) if g.is_dir()]


class Rig:
    """Devices, the processes started in them, loop images: all undone by close(), exactly once."""

    def __init__(self, run_id: str | None = None) -> None:
        missing = lacks()
        if missing:
            raise Lacks("the device rig needs " + "; ".join(missing))
        self.run = run_id or secrets.token_hex(2)
        self.devices: list[Device] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.images: list[_rig_disk.LoopImage] = []
        self._rest: Path | None = None  # the group the machine's other processes wait in (reserve)
        self._closed = False
        self._previous: dict[int, object] = {}
        atexit.register(self.close)
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread: atexit and the block still clean up
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.close()
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        else:
            raise SystemExit(128 + signum)

    @property
    def tag_prefix(self) -> str:
        return f"{PREFIX}-{self.run}-"

    def reserve(self, cpus: str) -> None:
        """Give these cores to the rig's devices alone until it closes (bench/_rig_cpus.py; cgroup v1): a CFS quota
        caps a device's share but reserves nothing (beside two busy processes a quarter core got 0.217)."""
        if cgroup_version() != 1 or self._rest is not None:
            raise Lacks("reserving cores takes cgroup v1's cpuset controller, once a rig")
        self._rest = CGROUP / "cpuset" / f"{self.tag_prefix}{REST}"  # (close() releases it, whatever happens)
        why = _rig_cpus.reserve(self._rest, cpus)
        if why:
            self._rest = None
            raise Lacks(why)

    def device(self, spec: DeviceSpec) -> Device:
        if spec.name == REST:
            raise ValueError(f"{REST!r} names the group of the machine's other processes; name the device otherwise")
        missing = lacks(spec)
        if missing:
            raise Lacks(f"device {spec.name} needs " + "; ".join(missing))
        dev = Device(spec, f"{self.tag_prefix}{spec.name}")
        self.devices.append(dev)  # before it is made: close() removes what a failed make left
        dev._make(len(self.devices) - 1)
        return dev

    def popen(self, device: Device | None, argv: Sequence[str], **kwargs: object) -> subprocess.Popen[bytes]:
        """Start argv on `device` (None: on the rig's own unlimited group, so the sweep still finds it). The child
        joins the device's groups before it execs, so nothing it starts runs outside them even for a moment."""
        if device is None:
            device = self.host()
        procs = [str(f) for f in device.procs_files]

        def join() -> None:
            pid = str(os.getpid())
            for f in procs:
                with open(f, "w") as fh:
                    fh.write(pid)

        proc = subprocess.Popen(device.command(argv), preexec_fn=join, start_new_session=True, **kwargs)  # type: ignore[call-overload]
        self.procs.append(proc)
        return proc

    def host(self) -> Device:
        """An unlimited device for the rig's helpers (the relay): tracked, never capped."""
        for d in self.devices:
            if d.spec.name == "host":
                return d
        return self.device(DeviceSpec("host"))

    def loop_image(self, gguf: Path, read_ahead_kb: int, workdir: Path | None = None) -> Path:
        """A copy of `gguf` on an ext4 image on a loop device with direct I/O and `read_ahead_kb` of read-ahead;
        its path (bench/_rig_disk.py)."""
        image = _rig_disk.LoopImage(gguf, read_ahead_kb, self.tag_prefix, workdir)
        self.images.append(image)
        return image.open()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sig, previous in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, previous)  # type: ignore[arg-type]
        errors: list[str] = []
        if self._rest is not None:
            try:
                _rig_cpus.release(self._rest)
            except OSError as e:
                errors.append(f"{self._rest}: {e}")
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for dev in reversed(self.devices):
            for g in dev.groups:
                try:
                    _remove_group(g)
                except OSError as e:
                    errors.append(f"{g}: {e}")
            if dev.net is not None:
                errors += _rig_net.remove_link(dev.net)
        for image in reversed(self.images):
            errors += image.close()
        errors += [str(p) for p in sweep(self.tag_prefix)]  # what a failure halfway through a make left
        atexit.unregister(self.close)
        if errors:
            log.error("the rig could not remove: %s", "; ".join(errors))

    def __enter__(self) -> Rig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def leftovers(tag_prefix: str = PREFIX) -> list[str]:
    """What runs or exists under the prefix: groups, namespaces, links, mounts, loop devices."""
    found = [str(g) for g in _all_groups(tag_prefix)]
    found += _rig_net.leftovers(tag_prefix)
    found += _rig_disk.leftovers(tag_prefix)
    return found


def sweep(tag_prefix: str = PREFIX) -> list[str]:
    """Remove every leftover under the prefix (the processes in its groups and namespaces killed first, but
    those of a REST group, the machine's own, moved back to the root cpuset); what could not be removed."""
    _rig_cpus.release_leftovers(CGROUP / "cpuset", tag_prefix)
    for g in _all_groups(tag_prefix):
        for pid in _pids(g):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    _rig_net.sweep(tag_prefix)
    for g in _all_groups(tag_prefix):
        with contextlib.suppress(OSError):
            _remove_group(g)
    _rig_disk.sweep(tag_prefix)
    return leftovers(tag_prefix)


@contextlib.contextmanager
def rig(run_id: str | None = None) -> Iterator[Rig]:
    r = Rig(run_id)
    try:
        yield r
    finally:
        r.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true", help="remove what a killed run left (groups, namespaces, ...)")
    p.add_argument("--lacks", action="store_true", help="say what this machine lacks for the rig")
    args = p.parse_args(argv)
    if args.lacks:
        missing = lacks()
        print("; ".join(missing) if missing else f"nothing: cgroup v{cgroup_version()}, root")
        return 1 if missing else 0
    if args.sweep:
        before = leftovers()
        left = sweep()
        print(f"removed {len(before) - len(left)}: " + ", ".join(x for x in before if x not in left))
        if left:
            print("could not remove: " + ", ".join(left), file=sys.stderr)
            return 1
        return 0
    p.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
