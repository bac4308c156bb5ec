"""A node checks its own slab files: a slab whose file is damaged under a running node is dropped (no longer
served, announced, given out; said in its log and by `swarm status`) while its other slabs answer the same
bits, and it is served again once its file is restored. The check itself, on real files in process: it runs
at idle priority, stats unchanged files without reading them, hashes a changed file at once, and catches in
its rounds what a stat cannot see."""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch
from conftest import FIXTURES, flip_bytes

from swarm.compute.slabs import load_slabs
from swarm.compute.store import ExpertStore, MissingSlabs
from swarm.coordinator.cli import main
from swarm.coordinator.cli.spawn import start_nodes, stop_nodes
from swarm.node.auth import SwarmKey, generate_key_text
from swarm.node.client import NodeCallError, NodeClient
from swarm.node.discovery import browse
from swarm.node.selfcheck import SlabSelfCheck
from swarm.sharding.manifest import SlabEntry, read_manifest
from swarm.sharding.shard import shard_model

MODEL = FIXTURES / "qwen35moe-quant" / "model-q4_k_m.gguf"  # 4 layers x 8 experts, D = 256
# Layer 0's experts are all Q4_K: a node multiplies them as repacked copies made at start-up, which damage to
# the files does not reach. Layer 2's down matrices are Q6_K, multiplied where they lie in the file's map.
REPACKED, IN_PLACE = (0, 3), (2, 5)
KEPT = [(0, 1), (2, 1), (3, 0)]
KEY_TEXT = generate_key_text()
KEY = SwarmKey.from_text(KEY_TEXT)


def damage(shard_dir: Path, key: tuple[int, int]) -> None:
    """Flip bytes inside the tensor data of one slab file, in place (a running node has it mapped)."""
    entry = read_manifest(shard_dir).slab(*key)
    assert entry is not None
    flip_bytes(shard_dir / entry.path, entry.data_offset, entry.size)


def restore(shard_dir: Path, good_dir: Path, key: tuple[int, int]) -> None:
    """Put a good copy of the slab file back as one would: written beside it, then renamed over it."""
    entry = read_manifest(shard_dir).slab(*key)
    assert entry is not None
    tmp = shard_dir / (entry.path + ".restore")
    shutil.copyfile(good_dir / entry.path, tmp)
    os.replace(tmp, shard_dir / entry.path)


def wait_until(what: str, predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


@pytest.fixture()
def shard_dir(tmp_path: Path) -> Path:
    out = tmp_path / "m.swarm"
    shard_model(MODEL, out)
    return out


@pytest.mark.slow
def test_a_node_drops_a_slab_whose_file_is_damaged_under_it_and_takes_it_back_once_restored(
    tmp_path, shard_dir, capsys
):
    good = tmp_path / "good.swarm"
    shutil.copytree(shard_dir, good)
    key_file = tmp_path / "swarm.key"  # this test's swarm: no other test's nodes on loopback
    key_file.write_text(KEY_TEXT)
    kf = ["--key-file", str(key_file)]
    (node,) = start_nodes([(shard_dir, ["--experts", "0-6", "--recheck", "1", *kf])], tmp_path / "nodes")
    grpc_client = NodeClient(node.address, fingerprint=node.fingerprint, key=KEY)
    stream_client = NodeClient(
        node.address, fingerprint=node.fingerprint, key=KEY, stream_port=grpc_client.info().stream_port
    )
    status = ["status", "--no-mdns", "--peer", node.address, *kf]
    try:
        x = torch.randn(3, 256)
        before = {k: grpc_client.compute(k[0], [k[1]], [3], x) for k in [REPACKED, IN_PLACE, *KEPT]}

        damage(shard_dir, REPACKED)
        damage(shard_dir, IN_PLACE)
        wait_until(
            "the damaged slabs leave the node's Info",
            lambda: not {REPACKED, IN_PLACE} & grpc_client.info().held,
            timeout=20,
        )
        info = grpc_client.info()
        assert set(KEPT) <= info.held and len(info.held) == 4 * 7 - 2

        # refused as a slab never held is (expert 7 of layer 0), on both transports: the caller goes elsewhere
        unheld = "are not held here; send them to a node that holds them"
        for client in (grpc_client, stream_client):
            for layer, expert in (REPACKED, IN_PLACE, (0, 7)):
                with pytest.raises(NodeCallError) as refused:
                    client.compute(layer, [expert], [3], x)
                assert refused.value.code == grpc.StatusCode.NOT_FOUND, refused.value
                assert f"expert(s) {expert} of layer {layer} {unheld}" in refused.value.details
            for k in KEPT:
                assert torch.equal(client.compute(k[0], [k[1]], [3], x), before[k]), k
        with pytest.raises(NodeCallError) as refused:
            list(grpc_client.fetch(f"experts/{REPACKED[0]}/{REPACKED[1]}.gguf"))  # not given out either
        assert refused.value.code == grpc.StatusCode.NOT_FOUND

        with browse(interfaces=["127.0.0.1"], key=KEY) as browser:
            found = browser.wait_for(
                lambda nodes: any(
                    n.address == node.address and not {REPACKED, IN_PLACE} & n.held and set(KEPT) <= n.held
                    for n in nodes
                ),
                timeout=10,
            )
        assert found, "the node's mDNS record still lists a dropped slab"

        errors = [line for line in node.log_file.read_text().splitlines() if " ERROR " in line]
        assert len(errors) == 2, errors
        for layer, expert in (REPACKED, IN_PLACE):
            [line] = [ln for ln in errors if f"slab {layer}:{expert} failed its check" in ln]
            assert f"{shard_dir}/experts/{layer}/{expert}.gguf: tensor data differs from the manifest" in line
            assert "Restore the file" in line and "--fetch" in line
        wait_until(
            "the ready file names the dropped slabs",
            lambda: json.loads(node.ready_file.read_text())["dropped"] == "0:3;2:5",
            timeout=5,
        )

        capsys.readouterr()
        assert main(status) == 0
        out = capsys.readouterr().out
        assert f"{node.address}: dropped 2 slabs (failed their check): 0:3;2:5" in out, out
        assert main([*status, "--json"]) == 0
        (record,) = json.loads(capsys.readouterr().out)["nodes"]
        assert record["dropped"] == "0:3;2:5" and record["dropped_slabs"] == 2 and record["slabs"] == 26

        restore(shard_dir, good, REPACKED)
        restore(shard_dir, good, IN_PLACE)
        wait_until(
            "the restored slabs are served again",
            lambda: {REPACKED, IN_PLACE} <= grpc_client.info().held,
            timeout=20,
        )
        for k in [REPACKED, IN_PLACE, *KEPT]:
            assert torch.equal(stream_client.compute(k[0], [k[1]], [3], x), before[k]), k
        assert "matches the manifest again; serving it again" in node.log_file.read_text()
        assert main(status) == 0
        assert "dropped" not in capsys.readouterr().out
    finally:
        grpc_client.close()
        stream_client.close()
        assert stop_nodes([node]) == [0], node.log_tail()


class Calls:
    """What a check reported, in order, from its thread."""

    def __init__(self) -> None:
        self.failed: list[tuple[tuple[int, int], str]] = []
        self.restored: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def on_failed(self, entry: SlabEntry, why: str) -> None:
        with self.lock:
            self.failed.append(((entry.layer, entry.expert), why))

    def on_restored(self, entry: SlabEntry) -> None:
        with self.lock:
            self.restored.append((entry.layer, entry.expert))


def test_rounds_run_at_idle_priority_and_the_stat_watch_at_the_nodes_own(shard_dir):
    """Only the rounds' thread yields to everything else: the stat watch (a changed file) and the node's calls
    keep their priority, so a machine whose cores are all busy still has a changed file checked."""
    calls = Calls()
    check = SlabSelfCheck(shard_dir, 3600.0, calls.on_failed, calls.on_restored, watch_seconds=0.01)
    check.start()
    try:
        wait_until("the rounds thread set its priority", lambda: check.idle is not None)
        if sys.platform.startswith("linux"):
            assert check.idle
            assert os.sched_getscheduler(check.native_id) == os.SCHED_IDLE
            assert os.sched_getscheduler(check._thread.native_id) != os.SCHED_IDLE
            assert os.sched_getscheduler(0) != os.SCHED_IDLE  # its thread only: not the node's calls
    finally:
        check.close()


def test_a_round_hashes_an_unchanged_file_once(shard_dir):
    """(At the node's own priority here: an idle-priority thread may get no time at all beside busy
    processes, and this is about what a round does.)"""
    entries = read_manifest(shard_dir).slabs
    calls = Calls()
    check = SlabSelfCheck(shard_dir, 0.05, calls.on_failed, calls.on_restored, watch_seconds=0.01, idle=False)
    for entry in entries:
        check.watch(entry)
    check.start()
    try:
        wait_until("three rounds", lambda: check.rounds >= 3, timeout=60)
    finally:
        check.close()
    rounds = check.rounds
    assert set(check.hashes) == {(e.layer, e.expert) for e in entries}
    for key, n in check.hashes.items():  # once in each round ended, and maybe in the one it was stopped in
        assert rounds <= n <= rounds + 1, (key, n, rounds)
    assert not calls.failed and not calls.restored


def test_a_changed_file_is_hashed_at_once_and_an_unchanged_one_only_stat_ed(shard_dir, tmp_path):
    good = tmp_path / "good.swarm"
    shutil.copytree(shard_dir, good)
    entries = read_manifest(shard_dir).slabs
    calls = Calls()
    check = SlabSelfCheck(shard_dir, 3600.0, calls.on_failed, calls.on_restored, watch_seconds=0.01)
    later = time.time_ns() + 60 * 10**9
    for i, entry in enumerate(entries):
        # as a node's start-up check leaves them: half written before that check began (here: it began a
        # minute from now), half since (it began in 1970), maybe after it read them: those are hashed at once
        check.watch(entry, later if i % 2 else 0)
    check.start()
    try:
        recent = {(e.layer, e.expert) for i, e in enumerate(entries) if not i % 2}
        wait_until("the files written since the start-up check hashed", lambda: set(check.hashes) == recent)
        sweeps = check.sweeps
        wait_until("30 more stat sweeps", lambda: check.sweeps >= sweeps + 30)
        assert set(check.hashes) == recent and all(n == 1 for n in check.hashes.values()), check.hashes
        assert check.rounds == 0

        touched = entries[1]
        path = shard_dir / touched.path
        os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # new stat, same bytes
        key = (touched.layer, touched.expert)
        wait_until("the touched file hashed", lambda: check.hashes[key] == 1)
        assert not calls.failed

        damage(shard_dir, REPACKED)
        wait_until("the damaged slab reported", lambda: bool(calls.failed))
        [(failed, why)] = calls.failed
        assert failed == REPACKED
        assert (
            why == f"{shard_dir}/experts/0/3.gguf: tensor data differs from the manifest (SHA-256 mismatch)"
        )

        entry = read_manifest(shard_dir).slab(*IN_PLACE)
        assert entry is not None
        os.truncate(shard_dir / entry.path, entry.size - 1)
        wait_until("the shortened slab reported", lambda: len(calls.failed) == 2)
        short = f"{shard_dir}/{entry.path}: size {entry.size - 1} bytes, manifest says {entry.size}"
        assert calls.failed[1] == (IN_PLACE, short)

        hashes = check.hashes[REPACKED]
        restore(shard_dir, good, REPACKED)
        wait_until("the restored slab taken back", lambda: calls.restored == [REPACKED])
        assert check.hashes[REPACKED] == hashes + 1 and len(calls.failed) == 2
    finally:
        check.close()


def test_a_round_finds_what_no_stat_shows(shard_dir):
    """Bytes that change under an unchanged stat (rot on the medium): only a round's hashing sees them. Here
    the stat watch looks once, at the start, and never again."""
    entries = read_manifest(shard_dir).slabs
    calls = Calls()
    check = SlabSelfCheck(
        shard_dir, 0.05, calls.on_failed, calls.on_restored, watch_seconds=3600.0, idle=False
    )  # (a round at idle priority may wait long on a busy machine: test_rounds_run_at_idle_priority...)
    for entry in entries:
        check.watch(entry)
    check.start()
    try:
        wait_until("a round", lambda: check.rounds >= 1)
        damage(shard_dir, IN_PLACE)
        wait_until("the damaged slab reported", lambda: bool(calls.failed))
        assert [k for k, _ in calls.failed] == [IN_PLACE]
    finally:
        check.close()


def test_a_removed_slab_is_refused_as_one_never_held_and_add_takes_it_back(shard_dir):
    store = ExpertStore(load_slabs(shard_dir, experts=range(7)).slabs)
    store.prepare()
    x = torch.randn(2, 256)
    before = store.compute(0, [3, 1], [1, 1], x)
    parts = store.slabs[REPACKED]
    assert store.remove(REPACKED) and not store.remove(REPACKED)
    assert store.dropped() == [REPACKED] and REPACKED not in store.held()
    with pytest.raises(MissingSlabs) as dropped:
        store.compute(0, [3, 1], [1, 1], x)
    with pytest.raises(MissingSlabs) as never_held:
        store.compute(0, [7, 1], [1, 1], x)
    assert str(dropped.value) == str(never_held.value).replace("expert(s) 7", "expert(s) 3")
    assert torch.equal(store.compute(0, [1], [1], x[1:]), before[1:])
    assert store.cache_stats().repacked_experts == len(store.held())  # its repacked copy went with it

    store.add(REPACKED, parts)
    assert store.dropped() == [] and REPACKED in store.held()
    assert torch.equal(store.compute(0, [3, 1], [1, 1], x), before)
