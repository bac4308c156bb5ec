"""Nodes under a memory cap: real node processes in real cgroup v1 memory groups (root only), and a store
whose budget is smaller than a call's experts.

A node whose slabs outgrow its group's limit sizes the copies it keeps to the limit (`--memory` defaults to
it) and serves the in-process bits instead of being killed, its anonymous memory (what the kernel cannot
reclaim) never past the limit less the margin left for page cache, even through calls that name a whole
layer's experts, more than its budget holds; the same node told `--memory 0` (unlimited) is killed by the
same limit, which shows the cap is real. With two replicas, a node killed by its cap (the kernel's OOM
killer) in the middle of a `swarm logits` run costs the run nothing: the same logits, bit for bit, as in
process. In process, without a cap, such a call grows the process by about the budget.

The page cache counts against a v1 group, but a page stays charged to the group that first read it: the
slab files this test wrote (or read in process) are dropped from the page cache before a capped node maps
them, so that the node's own group pays for every slab page it reads.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from swarm.compute.cgroup import memory_cap
from swarm.compute.expert_copies import MARGIN_FRACTION, MIN_MARGIN, TRIM_STEP
from swarm.compute.store import ExpertStore
from swarm.coordinator.cli.spawn import LocalNode, spawn_node
from swarm.node.client import NodeClient
from swarm.proto.numerics import Numerics
from swarm.sharding.shard import shard_model
from swarm.sharding.slabs import read_manifest, slabs_from_shard

MiB = 1 << 20
# The nodes' cap: under the 864 MiB of slabs the test model has, over a node's own memory (~50 MiB) and one
# layer's 256 experts as the copies a prefill call multiplies at once (432 MiB).
CAP = 600 * MiB
V1 = Path("/sys/fs/cgroup/memory")
# What runs `swarm` in a group: the child joins the group named by its first argument before Python
# allocates much, then runs the CLI with the rest (`-v`: the node logs its memory budget).
JOIN = (
    "import os, sys; open(sys.argv[1], 'w').write(str(os.getpid())); del sys.argv[1]; "
    "from swarm.coordinator.cli import main; sys.exit(main(sys.argv[1:]))"
)
# A process in a group that takes memory until the kernel's OOM killer has killed someone there: the node's
# oom_score_adj of +1000 makes the node the one chosen first. (The balloon cannot exempt itself: lowering an
# oom_score_adj needs CAP_SYS_RESOURCE, which a container's root may lack, so the balloon may be killed too
# when it takes more before the node's memory is freed.)
BALLOON = """
import os, sys
group = sys.argv[1]
open(os.path.join(group, 'cgroup.procs'), 'w').write(str(os.getpid()))
def kills():
    for line in open(os.path.join(group, 'memory.oom_control')):
        if line.startswith('oom_kill '):
            return int(line.split()[1])
    return 0
before, held = kills(), []
for _ in range(4096):
    if kills() > before:
        print('killed', flush=True)
        break
    held.append(bytearray(b'x') * (8 << 20))
else:
    print('no kill', flush=True)
held.clear()
sys.stdin.read()
"""


def _need_cgroup_v1() -> None:
    """These tests need the cgroup v1 memory controller mounted at /sys/fs/cgroup/memory and root: fail
    (never skip) where either is missing, saying so."""
    if os.geteuid() != 0:
        pytest.fail("test_memcap needs root: it makes memory cgroups under /sys/fs/cgroup/memory")
    if not (V1 / "memory.limit_in_bytes").exists():
        pytest.fail(
            "the cgroup v1 memory controller is not mounted at /sys/fs/cgroup/memory (mount -t cgroup -o "
            "memory cgroup /sys/fs/cgroup/memory): test_memcap puts nodes under real memory caps with it"
        )


class MemoryGroup:
    """A cgroup v1 memory group with a limit; removed by close() once the processes in it are gone."""

    def __init__(self, limit: int) -> None:
        self.path = V1 / f"swarm-test-{uuid.uuid4().hex[:12]}"
        self.path.mkdir()
        self.limit = limit
        (self.path / "memory.limit_in_bytes").write_text(str(limit))

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def read(self, name: str) -> int:
        return int((self.path / name).read_text().split()[0])

    def anon(self) -> int:
        """Anonymous memory charged to the group now (v1's total_rss: no swap here)."""
        for line in (self.path / "memory.stat").read_text().splitlines():
            if line.startswith("total_rss "):
                return int(line.split()[1])
        raise AssertionError(f"no total_rss in {self.path / 'memory.stat'}")

    def oom_kills(self) -> int:
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def close(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)  # a killed process leaves its group a moment after it is reaped


@pytest.fixture
def groups():
    _need_cgroup_v1()
    made: list[MemoryGroup] = []

    def make(limit: int) -> MemoryGroup:
        made.append(MemoryGroup(limit))
        return made[-1]

    yield make
    for g in made:
        g.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """2 layers of the Qwen3.6-35B-A3B layer shape (256 Q4_K experts of 1.7 MiB each a layer), sharded:
    432 MiB of slabs a layer."""
    from swarm.sharding.synth import synthesize
    from swarm.sharding.synth_spec import preset

    work = tmp_path_factory.mktemp("memcap")
    gguf, shard_dir = work / "q36.gguf", work / "q36.swarm"
    synthesize(gguf, preset("qwen3.6-35b-a3b", n_layers=2, experts_type="Q4_K", dense_type="Q8_0"))
    shard_model(gguf, shard_dir, progress=False)
    gguf.unlink()
    return shard_dir


def _slab_bytes(shard_dir: Path) -> int:
    return sum(s.size for s in read_manifest(shard_dir).slabs)


def _drop_page_cache(shard_dir: Path) -> None:
    """Drop the shard's clean pages from the page cache (pages mapped by a live process stay)."""
    os.sync()
    for f in shard_dir.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class PeakAnon:
    """Anonymous memory (`read()`: a group's, this process's) sampled every few milliseconds on a thread, its
    peak kept."""

    def __init__(self, read: Callable[[], int]) -> None:
        self.read, self.peak = read, read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.read())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _capped_node(shard_dir: Path, group: MemoryGroup, workdir: Path, name: str, *args: str) -> LocalNode:
    return spawn_node(
        shard_dir, ["--no-mdns", *args], workdir, name, program=("-c", JOIN, str(group.procs), "-v")
    )


def _calls(n_layers: int, n_expert: int, d: int) -> list[tuple[int, list[int], list[int], np.ndarray]]:
    """Every expert of each layer in one call (a prefill's worth: the whole layer's copies at once), then
    decode-sized calls (8 experts, 1-2 rows) over the layers, then the first layer whole again (its copies
    evicted meanwhile, made again)."""
    rng = np.random.default_rng(7)
    calls = []
    for layer in range(n_layers):
        ids = list(range(n_expert))
        counts = [1 + (e % 2) for e in ids]
        calls.append((layer, ids, counts, rng.standard_normal((sum(counts), d), dtype=np.float32)))
    for step in range(12):
        ids = sorted(rng.choice(n_expert, 8, replace=False).tolist())
        counts = [1 + (step + e) % 2 for e in ids]
        calls.append((step % n_layers, ids, counts, rng.standard_normal((sum(counts), d), dtype=np.float32)))
    calls.append(calls[0])
    return calls


def _own_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no RssAnon in /proc/self/status")


def _trim_heap() -> None:
    ctypes.CDLL(None).malloc_trim(0)


@pytest.mark.slow
def test_a_call_naming_more_experts_than_the_budget_holds_stays_within_it(model):
    """In process, no cap: a call naming a whole layer's 256 experts (432 MiB of repacked copies) of a store
    whose budget holds 37 of them gives the bits of an unlimited store while this process grows by about the
    budget, not by the call's copies (held at once) nor by the copies it freed (kept by the heap); the same in
    the exact numerics, whose float32 copies are 12 MiB an expert."""
    slabs, _ = slabs_from_shard(model)
    manifest = read_manifest(model)
    rng = np.random.default_rng(5)
    ids = list(range(manifest.n_expert))
    counts = [1 + e % 3 for e in ids]
    rows = rng.standard_normal((sum(counts), manifest.n_embd), dtype=np.float32)
    exact_ids, exact_counts = ids[:24], counts[:24]
    exact_rows = rows[: sum(exact_counts)]
    unlimited = ExpertStore(slabs)
    want = np.asarray(unlimited.compute(0, ids, counts, rows))
    want_exact = np.asarray(unlimited.compute(1, exact_ids, exact_counts, exact_rows, Numerics.EXACT))
    del unlimited
    gc.collect()
    _trim_heap()

    budget = 64 * MiB
    store = ExpertStore(slabs, memory_budget=budget)
    before = _own_anon()
    sampler = PeakAnon(_own_anon)
    try:
        for _ in range(2):  # the second time every expert is copied again, the first ones evicted
            assert np.array_equal(np.asarray(store.compute(0, ids, counts, rows)), want)
        got_exact = np.asarray(store.compute(1, exact_ids, exact_counts, exact_rows, Numerics.EXACT))
        assert np.array_equal(got_exact, want_exact)
    finally:
        grown = sampler.stop() - before
    stats = store.cache_stats()
    # the second call found only the experts the budget held (1.7 MiB each) and copied the others again
    assert stats.repacks >= 2 * manifest.n_expert - budget // (3 * MiB // 2), stats
    # the budget, the heap's freed memory not yet handed back and 64 MiB for the rest: one copy past the
    # budget before its eviction (a float32 one is 12 MiB), dequantizing's temporaries, the rows, the outputs
    # and a group's graph. Without groups the call would hold 432 MiB of copies.
    slack = budget + TRIM_STEP + 64 * MiB
    assert grown <= slack, f"grew by {grown / MiB:.0f} MiB with a {budget // MiB} MiB budget"


@pytest.mark.slow
def test_a_node_with_more_slabs_than_its_cap_serves_the_in_process_bits(groups, model, tmp_path):
    manifest = read_manifest(model)
    slab_bytes = _slab_bytes(model)
    group = groups(CAP)
    assert slab_bytes > 1.4 * group.limit, "the node must hold more slab bytes than its cap"

    slabs, _ = slabs_from_shard(model)
    store = ExpertStore(slabs)
    calls = _calls(manifest.n_layer, manifest.n_expert, manifest.n_embd)
    expect = [np.asarray(store.compute(layer, ids, counts, rows)) for layer, ids, counts, rows in calls]
    del store, slabs
    gc.collect()  # the slab files unmapped: mapped pages stay in the page cache
    _drop_page_cache(model)

    node = _capped_node(model, group, tmp_path, "capped").wait_ready(180)
    try:
        client = NodeClient(node.address, fingerprint=node.fingerprint)
        budget = client.info().memory_budget_bytes
        assert 0 < budget < group.limit - 200 * MiB, (
            f"budget {budget / MiB:.0f} MiB under a {CAP // MiB} MiB cap"
        )
        sampler = PeakAnon(group.anon)
        try:
            for (layer, ids, counts, rows), want in zip(calls, expect, strict=True):
                got = np.asarray(client.compute(layer, ids, counts, rows, timeout=120))
                assert np.array_equal(got, want), f"layer {layer}: other bits than in process"
        finally:
            peak = sampler.stop()
        client.close()
        assert node.process.poll() is None, f"the node died:\n{node.log_tail()}"
        assert group.oom_kills() == 0
        assert group.read("memory.failcnt") > 0, "the group never reached its limit: the cap did not bind"
        # what the budget promises: the node's own memory and its copies leave the margin for page cache
        margin = max(MIN_MARGIN, group.limit // MARGIN_FRACTION)
        assert peak <= group.limit - margin, (
            f"peak anonymous memory {peak / MiB:.0f} MiB under a {CAP // MiB} MiB cap with a "
            f"{budget / MiB:.0f} MiB budget: over the cap less its {margin / MiB:.0f} MiB margin"
        )
        assert f"sized to the cgroup v1 memory.limit_in_bytes {CAP // MiB} MiB" in node.log_file.read_text()
    finally:
        node.stop()


@pytest.mark.slow
def test_the_same_node_with_an_unlimited_budget_is_killed_by_the_cap(groups, model, tmp_path):
    """The control: `--memory 0` keeps a repacked copy of every expert, more than the cap holds. The node
    makes them once it serves, so it may be killed before or after it says it is ready."""
    group = groups(CAP)
    _drop_page_cache(model)
    node = _capped_node(model, group, tmp_path, "unlimited", "--memory", "0")
    try:
        try:
            node.wait_ready(180)
        except RuntimeError as e:
            assert "exited with code -9" in str(e)
        assert node.process.wait(180) == -signal.SIGKILL
        assert group.oom_kills() >= 1
    finally:
        node.stop()


TOKENS = ",".join(str(t) for t in np.random.default_rng(3).integers(0, 4000, 48))


@pytest.fixture(scope="module")
def local_logits(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "local.npy"
    local = _logits(model, TOKENS, out, "--local")
    assert local.wait(600) == 0, local.stdout.read() if local.stdout else ""
    return np.load(out)


def _logits(shard_dir: Path, tokens: str, out: Path, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "swarm.coordinator.cli", "logits", str(shard_dir), "--tokens", tokens,
           "-o", str(out), "--threads", "1", *args]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_a_replica_killed_by_its_cap_costs_a_logits_run_nothing(groups, model, local_logits, tmp_path):
    """Two capped replicas of every expert; once the victim has answered its first call of the run it is
    stopped (so that the kill lands mid-run, not after it) and a balloon fills its group until the kernel's
    OOM killer kills it. The run's logits are the in-process ones, bit for bit."""
    _drop_page_cache(model)

    caps = [groups(CAP), groups(CAP)]
    nodes = [_capped_node(model, g, tmp_path, f"replica{i}") for i, g in enumerate(caps)]
    balloon = None
    try:
        for n in nodes:
            n.wait_ready(180)
        victim, group = nodes[1], caps[1]
        Path(f"/proc/{victim.pid}/oom_score_adj").write_text("1000")
        peers = [a for n in nodes for a in ("--peer", n.address)]
        run = _logits(model, TOKENS, tmp_path / "swarm.npy", *peers, "--no-mdns", "--wait", "5")
        with NodeClient(victim.address, fingerprint=victim.fingerprint) as client:
            while client.stats().calls == 0:
                assert run.poll() is None, "the run ended before the victim got a call"
                time.sleep(0.02)
        os.kill(victim.pid, signal.SIGSTOP)
        assert run.poll() is None, "the run ended before the victim was stopped"
        cmd = [sys.executable, "-c", BALLOON, str(group.path)]
        balloon = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        # "killed", or nothing when the balloon was killed as well
        assert balloon.stdout is not None and balloon.stdout.readline().strip() != "no kill"
        assert group.oom_kills() >= 1
        assert victim.process.wait(60) == -signal.SIGKILL
        assert run.wait(600) == 0, run.stdout.read() if run.stdout else ""
        assert np.array_equal(np.load(tmp_path / "swarm.npy"), local_logits)
        assert nodes[0].process.poll() is None and caps[0].oom_kills() == 0
    finally:
        if balloon is not None:
            balloon.communicate(timeout=30)
        for n in nodes:
            n.stop()


def test_memory_cap_reads_the_tightest_limit_of_v2_and_of_a_v1_mount_of_a_subgroup(tmp_path):
    """From the files as the kernel lays them out: v2 with a limit on the parent of the process's group;
    v1 mounted from a sub-group (as in a container), the limit on the process's own group."""
    v2, v1 = tmp_path / "unified", tmp_path / "memory"
    (v2 / "a" / "b").mkdir(parents=True)
    (v2 / "a" / "memory.max").write_text("734003200\n")
    (v2 / "a" / "b" / "memory.max").write_text("max\n")
    (v2 / "a" / "memory.stat").write_text("anon 104857600\nfile 52428800\nshmem 4096\n")
    (v1 / "job").mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (v1 / "job" / "memory.limit_in_bytes").write_text("943718400\n")
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text("4:memory:/docker/abc/job\n1:cpu:/\n0::/a/b\n")
    (proc / "mountinfo").write_text(
        f"35 31 0:32 /docker/abc {v1} rw,relatime - cgroup cgroup rw,memory\n"
        f"41 31 0:38 / {v2} rw,relatime - cgroup2 cgroup2 rw\n"
        f"32 31 0:29 / {tmp_path}/cpu rw,relatime - cgroup cgroup rw,cpu\n"
    )
    cap = memory_cap(proc)
    assert cap is not None
    assert (cap.limit, cap.version, cap.path) == (734003200, 2, v2 / "a")
    assert (cap.anon, cap.cache) == (104857600 + 4096, 52428800 - 4096)
    (v2 / "a" / "memory.max").write_text("max\n")
    cap = memory_cap(proc)
    assert cap is not None and (cap.limit, cap.version, cap.path) == (943718400, 1, v1 / "job")
    (v1 / "job" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert memory_cap(proc) is None


def test_a_coordinators_audit_copies_fit_under_its_cap(groups):
    """The coordinator's answer audits keep copies of experts under AUDIT_MEMORY, or under a cap that
    leaves less, a share of its room (a coordinator under a 600 MiB cap with 512 MiB of audit copies beside
    its model is killed by the cap)."""
    from swarm.coordinator.checks.recompute import AUDIT_MEMORY

    code = (
        "import os, sys; open(sys.argv[1], 'w').write(str(os.getpid()))\n"
        "from swarm.compute.expert_copies import within_cap\n"
        f"print(within_cap({AUDIT_MEMORY}))"
    )
    group = groups(600 * MiB)
    capped = subprocess.run([sys.executable, "-c", code, str(group.procs)], capture_output=True, text=True,
                            timeout=120, check=True)  # fmt: skip
    budget = int(capped.stdout.split()[-1])
    assert MiB <= budget < (600 * MiB - 160 * MiB) // 2, capped.stderr
    assert "for copies of experts instead of 512 MiB" in capped.stderr
    free = subprocess.run([sys.executable, "-c", code, os.devnull], capture_output=True, text=True, timeout=120,
                          check=True)  # fmt: skip
    assert int(free.stdout.split()[-1]) == AUDIT_MEMORY
