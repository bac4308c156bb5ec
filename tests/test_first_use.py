"""A node's slabs before their first call (swarm.node.first_use), on real shard files in process: a slab is
hashed against the manifest before any call multiplies its bytes, by the call itself when the start-up pass
has not reached it; a damaged one is dropped and refused as one never held; each is hashed once however many
calls want it at the same moment; the pass verifies and readies every slab."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES, flip_bytes

from swarm.compute.slabs import load_slabs
from swarm.compute.store import ExpertStore, MissingSlabs
from swarm.node.first_use import FirstUse
from swarm.sharding.manifest import SlabEntry, read_manifest
from swarm.sharding.shard import shard_model

MODEL = FIXTURES / "qwen35moe-quant" / "model-q4_k_m.gguf"  # 4 layers x 8 experts, D = 256
DAMAGED = (1, 3)


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("first-use") / "m.swarm"
    shard_model(MODEL, out)
    entry = read_manifest(out).slab(*DAMAGED)
    assert entry is not None
    flip_bytes(out / entry.path, entry.data_offset, entry.size)
    return out


class Opened:
    """A node's store over the mapped (unread) slab files, with its FirstUse not started."""

    def __init__(self, shard_dir: Path) -> None:
        loaded = load_slabs(shard_dir, verify=False, map_only=True)
        assert not loaded.problems, loaded.problems  # mapping reads nothing: the damage is not seen yet
        self.store = ExpertStore(loaded.slabs)
        manifest = read_manifest(shard_dir)
        entries = [manifest.slab(*key) for key in self.store.held()]
        self.failed: list[tuple[SlabEntry, str]] = []
        self.verified: Counter[tuple[int, int]] = Counter()
        self.first_use = FirstUse(
            self.store,
            shard_dir,
            [e for e in entries if e is not None],
            lambda entry, why, since: self.failed.append((entry, why)),
            lambda entry, since: self.verified.update([(entry.layer, entry.expert)]),
        )


def _rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 256)).astype(np.float32)


def test_a_call_hashes_its_slabs_first_and_gets_the_verified_bits(shard_dir: Path) -> None:
    opened = Opened(shard_dir)
    checked = ExpertStore(load_slabs(shard_dir, [0], [0, 1], verify=True).slabs)
    x = _rows(3)
    got = opened.store.compute(0, [0, 1], [1, 2], x)
    assert np.array_equal(got, checked.compute(0, [0, 1], [1, 2], x))
    assert opened.verified == Counter({(0, 0): 1, (0, 1): 1}) and not opened.failed
    opened.store.compute(0, [1], [1], x[:1])  # verified once: not hashed again
    assert opened.verified[(0, 1)] == 1


def test_a_damaged_slab_is_refused_at_its_first_call_and_dropped(shard_dir: Path) -> None:
    opened = Opened(shard_dir)
    layer, expert = DAMAGED
    with pytest.raises(MissingSlabs) as refused:
        opened.store.compute(layer, [0, expert], [1, 1], _rows(2))
    assert refused.value.experts == [expert]  # expert 0 verified; only the damaged one is named
    assert [(e.layer, e.expert) for e, _ in opened.failed] == [DAMAGED]
    assert "tensor data differs from the manifest (SHA-256 mismatch)" in opened.failed[0][1]
    with pytest.raises(MissingSlabs):
        opened.store.compute(layer, [expert], [1], _rows(1))
    assert len(opened.failed) == 1  # reported once


def test_calls_wanting_one_unverified_slab_at_once_hash_it_once(shard_dir: Path) -> None:
    opened = Opened(shard_dir)
    start = threading.Barrier(6)
    outs: list[np.ndarray] = []

    def call() -> None:
        start.wait()
        outs.append(opened.store.compute(2, [4], [2], _rows(2, seed=5)))

    threads = [threading.Thread(target=call) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(outs) == 6 and all(np.array_equal(o, outs[0]) for o in outs)
    assert opened.verified == Counter({(2, 4): 1})


def test_the_start_up_pass_verifies_and_readies_every_slab(shard_dir: Path) -> None:
    opened = Opened(shard_dir)
    held = set(opened.store.held())
    assert len(held) == 32
    first = opened.first_use.start()
    assert first.done.wait(120), "the start-up pass did not end"
    assert set(opened.verified) == held - {DAMAGED} and all(n == 1 for n in opened.verified.values())
    assert opened.store.dropped() == [DAMAGED]
    assert all(opened.store.ready(*key) for key in held - {DAMAGED})
    x = _rows(1)
    opened.store.compute(3, [7], [1], x)  # a call after the pass hashes nothing more
    assert opened.verified[(3, 7)] == 1
