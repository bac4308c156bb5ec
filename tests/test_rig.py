"""bench/_rig.py, the device rig: real cgroups, namespaces and loop devices. A device gets its CPU share, its
memory cap holds as the kernel holds it, its own namespace reaches the host at its link's rate, and nothing the
rig made outlives it: not after Ctrl-C, and not after its driver is killed outright once the sweep has run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def rig_mod() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCH))
    try:
        import _rig

        missing = _rig.lacks()
        if missing or _rig.lacks(_rig.DeviceSpec("probe", cpus="0", cpu_share=0.5, memory=1 << 30)):
            pytest.skip("this machine cannot make rig devices: " + "; ".join(missing))
        yield _rig
    finally:
        sys.path.remove(str(BENCH))


def _last_cpu() -> str:
    return str(max(os.sched_getaffinity(0)))


@pytest.fixture
def busy() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Two processes spinning beside the test, as CI's and a user's machines have."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def _cpuset_of(pid: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpuset" in controllers.split(","):
            return path
    return ""


@pytest.mark.slow
def test_a_device_gets_its_cpu_share_within_10_percent_beside_busy_processes(rig_mod, busy):
    """Two devices on one core, a quarter and a half of it by quota, each busy at once, while two other
    processes spin: the rig reserves the devices' core (the other processes wait on the other cores), each
    device gets its quota, and once the rig closes the other processes are back where they were, alive."""
    import _rig_check

    cpu = _last_cpu()
    specs = [
        rig_mod.DeviceSpec("quarter", cpus=cpu, cpu_share=0.25),
        rig_mod.DeviceSpec("half", cpus=cpu, cpu_share=0.5),
    ]
    before = [_cpuset_of(p.pid) for p in busy]
    with rig_mod.Rig() as rig:
        rig.reserve(cpu)
        assert all(_cpuset_of(p.pid).endswith(f"-{rig_mod.REST}") for p in busy)
        got = _rig_check.cpu_shares(rig, specs, seconds=5.0)
    assert [_cpuset_of(p.pid) for p in busy] == before and all(p.poll() is None for p in busy)
    assert rig_mod.leftovers(rig.tag_prefix) == []
    for spec in specs:
        assert abs(got[spec.name] - spec.cpu_share) <= 0.1 * spec.cpu_share, (spec.name, got)


HOG = "b = bytearray({n}); b[::4096] = b'x' * len(b[::4096]); print('survived')"


@pytest.mark.slow
def test_a_device_memory_cap_holds(rig_mod, tmp_path):
    """Anonymous memory over the cap: the kernel's OOM killer ends the process. A file read through the page
    cache, larger than the cap: its pages are reclaimed, the device's peak stays under the cap."""
    cap = 64 << 20
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.write(os.urandom(1 << 20) * 160)
    os.sync()
    fd = os.open(
        big, os.O_RDONLY
    )  # out of the page cache: charged to the device that reads it, not to this test
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    with rig_mod.Rig() as rig:
        dev = rig.device(rig_mod.DeviceSpec("capped", memory=cap))
        hog = rig.popen(dev, [sys.executable, "-c", HOG.format(n=4 * cap)], stdout=subprocess.PIPE)
        out = hog.communicate(timeout=60)[0]
        assert hog.returncode == -signal.SIGKILL and b"survived" not in out
        assert dev.oom_kills() >= 1
        reader = rig.popen(dev, ["cat", str(big)], stdout=subprocess.DEVNULL)
        assert reader.wait(timeout=60) == 0
        assert dev.peak() <= cap


DRIVER = """
import sys, time
sys.path.insert(0, {bench!r})
import _rig
rig = _rig.Rig({run!r})
rig.reserve("0")
dev = rig.device(_rig.DeviceSpec("n0", cpus="0", cpu_share=0.5, memory=256 << 20, netns=True, rate="20mbit"))
rig.loop_image(__import__("pathlib").Path({model!r}), 128)
proc = rig.popen(dev, ["sleep", "1000"])
print(proc.pid, flush=True)
time.sleep(1000)
"""


def _start_driver(rig_mod: ModuleType, tmp_path: Path, run: str) -> tuple[subprocess.Popen[str], int]:
    model = tmp_path / "model.gguf"
    model.write_bytes(os.urandom(1 << 20))
    code = textwrap.dedent(DRIVER.format(bench=str(BENCH), run=run, model=str(model)))
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert driver.stdout is not None
    line = driver.stdout.readline()
    assert line.strip().isdigit(), f"the driver did not start its device: {line!r}"
    return driver, int(line)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _kinds(found: list[str]) -> set[str]:
    return {"cgroup" if x.startswith("/sys/fs/cgroup") else x.split()[0] for x in found}


@pytest.mark.slow
def test_a_killed_run_leaves_nothing_once_swept(rig_mod, tmp_path):
    run = f"k{os.getpid() % 4096:03x}"
    driver, child = _start_driver(rig_mod, tmp_path, run)
    try:
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=10)
        prefix = f"{rig_mod.PREFIX}-{run}-"
        left = rig_mod.leftovers(prefix)
        assert {"cgroup", "netns", "link", "mount", "loop"} <= _kinds(left), left
        assert _alive(child)
        assert _cpuset_of(os.getpid()).endswith(f"-{rig_mod.REST}")  # the machine's processes wait aside
        assert rig_mod.sweep(prefix) == []
        assert _cpuset_of(os.getpid()) == "/"  # moved back, not killed
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        rig_mod.sweep(f"{rig_mod.PREFIX}-{run}-")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_run_cleans_up_by_itself(rig_mod, tmp_path, sig):
    run = f"i{os.getpid() % 4096:03x}"
    driver, child = _start_driver(rig_mod, tmp_path, run)
    prefix = f"{rig_mod.PREFIX}-{run}-"
    try:
        driver.send_signal(sig)
        driver.wait(timeout=30)
        assert rig_mod.leftovers(prefix) == []
        assert not _alive(child)
    finally:
        rig_mod.sweep(prefix)


SENDER = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2]))) as s:
    s.sendall(b"x" * (1 << 20))
"""


@pytest.mark.slow
def test_a_device_with_its_own_namespace_reaches_the_host_at_its_link_rate(rig_mod):
    """A device in its own network namespace sends 1 MiB to the host over its veth link: at 8 Mbit/s (tc tbf)
    that takes about a second, where the unshaped link takes a small part of one."""
    import socket

    def send_time(rig, rate: str | None, name: str) -> float:
        dev = rig.device(rig_mod.DeviceSpec(name, netns=True, rate=rate))
        with socket.create_server((dev.net.host_ip, 0)) as server:
            port = server.getsockname()[1]
            sender = rig.popen(dev, [sys.executable, "-c", SENDER, dev.net.host_ip, str(port)])
            conn, _ = server.accept()
            t0, got = time.monotonic(), 0
            with conn:
                while chunk := conn.recv(1 << 16):
                    got += len(chunk)
            assert sender.wait(timeout=30) == 0 and got == 1 << 20
            return time.monotonic() - t0

    with rig_mod.Rig() as rig:
        shaped = send_time(rig, "8mbit", "shaped")
        free = send_time(rig, None, "free")
    assert 0.8 < shaped < 5.0, shaped
    assert free < shaped / 3, (free, shaped)
