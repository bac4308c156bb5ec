"""Answers are checked: a node serving damaged slabs (damaged before it started, or under it while it runs),
beside an honest holder, is caught and banned, and what the user gets equals the in-process result bit for
bit (the work its answers touched is done again). Real node processes on loopback, real files damaged in
place."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import FIXTURES, flip_bytes

from swarm.compute import weights
from swarm.coordinator.checks.audit import Auditor, Verdict
from swarm.coordinator.cli import main
from swarm.coordinator.cli.spawn import start_nodes, stop_nodes
from swarm.coordinator.config import DEFAULT_AUDIT_RATE, EngineConfig, Verify
from swarm.coordinator.decode.one import (
    GenerationStats,
    SamplingParams,
    checked_logits,
    forward_one,
    generate,
)
from swarm.coordinator.engine import open_engine
from swarm.node.auth import KEY_ENV, SwarmKey, generate_key_text
from swarm.sharding.gguf_io import open_gguf
from swarm.sharding.shard import shard_model
from swarm.sharding.slabs import read_manifest
from swarm.sharding.synth import synthesize
from swarm.sharding.synth_spec import preset

MODEL = FIXTURES / "qwen35moe-quant" / "model-q4_k_m.gguf"  # Q4_K / Q6_K experts: native numerics
KEY_TEXT = generate_key_text()
KEY = SwarmKey.from_text(KEY_TEXT)
LOOPBACK = ["127.0.0.1"]


def damage(shard_dir, layer: int, experts: list[int]) -> None:
    """Flip bytes inside the tensor data of these slab files, in place (the node has them mapped)."""
    for e in experts:
        path = shard_dir / "experts" / str(layer) / f"{e}.gguf"
        flip_bytes(path, open_gguf(path).data_offset)


def make_rig(tmp_path, damaged: dict[int, list[int]] | None = None):
    """An honest node and a liar (or liar-to-be), each holding every expert, from two copies of one shard dir.
    `damaged` {layer: experts}: the liar's slab files are damaged before it starts (with --no-verify, so it
    serves them rather than refusing them). A liar-to-be runs with its own check of its files off
    (--recheck 0): damaged under it, they reach its answers rather than being dropped."""
    honest_dir, liar_dir = tmp_path / "honest.swarm", tmp_path / "liar.swarm"
    shard_model(MODEL, honest_dir)
    shutil.copytree(honest_dir, liar_dir)
    for layer, experts in (damaged or {}).items():
        damage(liar_dir, layer, experts)
    liar_args = ["--no-verify"] if damaged else ["--recheck", "0"]
    nodes = start_nodes(
        [(honest_dir, []), (liar_dir, liar_args)], tmp_path / "nodes", env={KEY_ENV: KEY_TEXT}
    )
    if not damaged:
        nodes[1].wait_prepared(60)  # its slabs hashed before their first use: damage to come reaches answers
    return honest_dir, liar_dir, nodes


@pytest.fixture()
def rig(tmp_path):
    rig = make_rig(tmp_path)
    yield rig
    stop_nodes(rig[2])


def _tensor(name: str):  # noqa: ANN202 - gguf's ReaderTensor
    return next(t for t in open_gguf(MODEL).tensors if t.name == name)


def read_in_place(layer: int) -> bool:
    """Whether a node multiplies this fixture layer's down matrices where they lie in the slab files (a type
    without a repacked layout on this CPU: Q6_K on x86), so that damaging the files under a running node
    changes its answers; a repacked type is copied at start-up and the files are not read again."""
    t = _tensor(f"blk.{layer}.ffn_down_exps.weight")
    return not weights.repackable(int(t.tensor_type), int(t.shape[1]))


def _swarm(shard_dir, rate: float, seed: int = 7, peers: tuple[str, ...] = ()):
    """A coordinator finding the nodes by mDNS on loopback, or only at `peers` (no mDNS), whose answers are
    checked by the exact audits (--verify sample: what this file tests; the projections are test_projection's)."""
    where = {"peers": peers, "mdns": False} if peers else {"mdns_interfaces": LOOPBACK}
    config = EngineConfig(wait=10.0, device="cpu", key=KEY, audit_rate=rate, audit_seed=seed, verify=Verify.SAMPLE,
                          **where)  # fmt: skip
    return open_engine(shard_dir, config)


@pytest.mark.slow
def test_a_damaged_node_is_banned_and_the_logits_are_still_exact(tmp_path):
    n = _tensor("blk.1.ffn_down_exps.weight").shape[-1]
    honest_dir, liar_dir, nodes = make_rig(tmp_path, {1: list(range(int(n) // 2))})
    honest, liar = nodes
    local = open_engine(honest_dir, EngineConfig(local=True, device="cpu"))
    # both given as peers: found by mDNS, the liar could be missed (the honest node holds every slab, and the
    # search ends once every slab has a holder, which it may do before the liar's record is registered)
    swarm = _swarm(honest_dir, rate=1.0, peers=(honest.address, liar.address))
    try:
        # the admission probe draws 4 of the liar's slabs at random (in the order the nodes were found) and
        # may catch it there; otherwise the audits of its answers do
        assert honest.address in swarm.experts.clients
        assert liar.address in set(swarm.experts.clients) | set(swarm.checker.report.banned)
        tokens = list(range(3, 40))
        expect = forward_one(local.model, tokens, local.model.new_state(), "cpu")
        got = checked_logits(swarm.model, tokens, swarm.model.new_state(), "cpu", swarm.checker)
        assert torch.equal(got, expect), f"max diff {float((got - expect).abs().max()):.3g}"
        report = swarm.checker.report
        assert set(report.banned) == {liar.address}, report
        assert "differs from the model's slab" in report.banned[liar.address]
        calls = swarm.experts.calls_per_node.get(liar.address, 0)
        forward_one(swarm.model, tokens[:5], swarm.model.new_state(), "cpu")
        assert swarm.experts.calls_per_node.get(liar.address, 0) == calls, "a banned node got another pair"
    finally:
        swarm.close()
        local.close()
        stop_nodes(nodes)


def test_nodes_found_at_start_are_probed_while_the_model_loads(rig):
    """Admission probes of the nodes found at start run beside the model's loading: by the first call every
    node is admitted, and the first prompt sends no probe. (Static peers: both nodes are known at start on
    any machine; by mDNS a node whose answer comes after the settle time is found later, and probed then.)"""
    from swarm.coordinator.checks.audit import PROBE_SLABS

    honest_dir, _, nodes = rig
    swarm = _swarm(honest_dir, rate=0.0001, peers=tuple(n.address for n in nodes))
    try:
        swarm.experts.await_admission()
        probes = swarm.checker.report.probes
        assert probes == PROBE_SLABS * len(nodes), probes
        assert swarm.experts._admitted == set(swarm.experts.clients) == {n.address for n in nodes}
        assert not swarm.experts.calls_per_node  # probes only: no pair was sent yet
        forward_one(swarm.model, list(range(3, 12)), swarm.model.new_state(), "cpu")
        assert swarm.checker.report.probes == probes and sum(swarm.experts.calls_per_node.values()) > 0
    finally:
        swarm.close()


def test_a_shard_directorys_slab_files_are_read_as_audits_draw_them(rig, monkeypatch):
    """Reading every slab file of a shard directory takes seconds on a real model (~1 ms each: 10,240 files
    for the 35B): a coordinator reads none to start, and each on the first probe or audit that draws it,
    once; an audit of a call reads the files of the experts it checks, not of every expert in the call (a
    prompt's call holds a node's share of a whole layer)."""
    from swarm.coordinator.checks import audit
    from swarm.coordinator.checks.audit import PROBE_SLABS
    from swarm.sharding import slabs

    monkeypatch.setattr(audit, "AUDIT_EXPERTS", 1)

    honest_dir, _, nodes = rig
    reads: list[str] = []
    real = slabs.LazySlabs._read_file

    def counted(self, key, entry):  # noqa: ANN001, ANN202
        reads.append(entry.path)
        return real(self, key, entry)

    monkeypatch.setattr(slabs.LazySlabs, "_read_file", counted)
    swarm = _swarm(honest_dir, rate=1.0, peers=tuple(n.address for n in nodes))
    try:
        total = len(read_manifest(honest_dir).slabs)
        assert 0 < len(reads) <= PROBE_SLABS * len(nodes) < total, (len(reads), total)  # the probes' only
        probed = len(reads)
        forward_one(swarm.model, list(range(3, 12)), swarm.model.new_state(), "cpu")  # every answer audited
        assert swarm.checker.settle(force=True) == Verdict.SETTLED
        assert swarm.checker.report.audits > 0 and len(reads) > probed
        assert len(reads) == len(set(reads)), "a slab file was read twice"
        n_calls = sum(swarm.experts.calls_per_node.values())
        assert len(reads) <= probed + n_calls + len(nodes) < total, (len(reads), probed, n_calls)
    finally:
        swarm.close()


def test_the_engine_is_returned_once_the_admission_has_ended(rig, monkeypatch):
    """What the nodes' admission has left when the model is loaded (probes: slow here on purpose; on a real
    model cold slabs are copied into ggml's repacked layout first) is waited for by open_engine, as start-up:
    the first prompt's time is the prompt's (bench/decode times prefill from it)."""
    import time

    from swarm.coordinator.checks.audit import PROBE_SLABS

    honest_dir, _, nodes = rig
    real = Auditor.probe

    def slow(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        time.sleep(0.75)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Auditor, "probe", slow)
    swarm = _swarm(honest_dir, rate=0.0001, peers=tuple(n.address for n in nodes))
    try:
        assert swarm.experts._admission is None, "open_engine returned while the admission still ran"
        assert swarm.checker.report.probes == PROBE_SLABS * len(nodes)
    finally:
        swarm.close()


@pytest.mark.slow
def test_sampled_audits_catch_a_node_that_turns_and_redo_what_it_touched(rig, capsys):
    """The liar passes its admission probe, then its slabs are damaged; audits at 1/4 of the answers catch it
    some passes later: the passes since the last settled point are done again, and the greedy text is the
    in-process one, token for token."""
    honest_dir, liar_dir, (honest, liar) = rig
    n = read_manifest(honest_dir).n_expert
    local = open_engine(honest_dir, EngineConfig(local=True, device="cpu"))
    swarm = _swarm(honest_dir, rate=0.25, seed=3)
    try:
        prompt = list(range(5, 25))
        forward_one(swarm.model, prompt[:4], swarm.model.new_state(), "cpu")  # both admitted (probed)
        assert not swarm.checker.report.banned
        assert read_in_place(2) and read_in_place(3)  # else the damage below could not reach its answers
        damage(liar_dir, 2, list(range(n)))
        damage(liar_dir, 3, list(range(n)))
        params = SamplingParams(max_tokens=24)
        expect = list(generate(local.model, prompt, params, "cpu"))
        stats = GenerationStats()
        got = list(generate(swarm.model, prompt, params, "cpu", stats, checker=swarm.checker))
        assert got == expect
        assert set(swarm.checker.report.banned) == {liar.address}
        assert stats.extra["redone_passes"] >= 1, "caught at once: the redo path was not exercised"
    finally:
        swarm.close()
        local.close()


@pytest.mark.slow
def test_status_reports_a_node_whose_answers_differ(tmp_path, capsys):
    n = int(_tensor("blk.0.ffn_down_exps.weight").shape[-1])
    honest_dir, liar_dir, nodes = make_rig(tmp_path, {layer: list(range(n)) for layer in range(4)})
    (honest, liar) = nodes
    try:
        key_file = tmp_path / "swarm.key"
        key_file.write_text(KEY_TEXT)
        argv = [
            "status",
            str(honest_dir),
            "--mdns-interface",
            "127.0.0.1",
            "--key-file",
            str(key_file),
            "--wait",
            "1.5",
        ]
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "with 1 holder" in out and "with 2 holders" not in out, out  # the liar's slabs do not count
        assert f"{liar.address}: BANNED: its answer for layer" in out
        assert [ln for ln in out.splitlines() if ln.startswith(honest.address)][0].rstrip().endswith("ok")
    finally:
        stop_nodes(nodes)


def test_settling_holds_open_work_and_catches(tmp_path):
    """The books alone: an answer counts as checked only once a later audit of its node passed."""
    from swarm.compute.slabs import load_slabs
    from swarm.compute.store import ExpertStore

    loaded = load_slabs(MODEL)
    auditor = Auditor(ExpertStore(loaded.slabs), "native", torch.float32, rate=0.0, seed=1)
    x = torch.randn(2, 256)
    right = auditor.expected(0, [0, 1], [1, 1], x)
    assert torch.equal(auditor.answered("a", 0, [0, 1], [1, 1], x, right), right)
    assert auditor.settle() is Verdict.OPEN
    assert auditor.settle(force=True) is Verdict.SETTLED  # the forced audit of a's last call passed
    wrong = right.clone()
    wrong[0, 0] += 1e-3
    auditor.answered("b", 0, [0, 1], [1, 1], x, wrong)
    assert auditor.settle(force=True) is Verdict.CAUGHT
    assert auditor.is_banned("b") and not auditor.is_banned("a")
    assert auditor.settle() is Verdict.SETTLED


def test_audits_run_beside_the_model_and_settle_waits_for_their_verdict():
    """An audited answer is handed back at once (its check runs on the auditor's own thread); a forced settle
    waits for the verdicts, and a caught node is reported to the placement (`on_ban`) as soon as it is caught."""
    from swarm.compute.slabs import load_slabs
    from swarm.compute.store import ExpertStore

    loaded = load_slabs(MODEL)
    banned: list[str] = []
    auditor = Auditor(ExpertStore(loaded.slabs), "native", torch.float32, rate=1.0, seed=1, on_ban=banned.append)
    try:
        x = torch.randn(2, 256)
        right = auditor.expected(0, [0, 1], [1, 1], x)
        wrong = right.clone()
        wrong[1, 3] -= 1e-3
        assert auditor.answered("a", 0, [0, 1], [1, 1], x, right) is right
        assert auditor.answered("b", 0, [0, 1], [1, 1], x, wrong) is wrong  # not replaced: checked aside
        assert auditor.settle(force=True) is Verdict.CAUGHT
        assert banned == ["b"] and set(auditor.report.banned) == {"b"} and auditor.report.audits == 2
        assert auditor.settle() is Verdict.SETTLED  # a's audit passed: nothing is open
    finally:
        auditor.close()
    inline = Auditor(ExpertStore(loaded.slabs), "native", torch.float32, rate=1.0, seed=1, background=False)
    assert torch.equal(inline.answered("b", 0, [0, 1], [1, 1], x, wrong), right)  # replaced in the call


def test_audit_rate_is_checked(capsys):
    assert main(["run", str(MODEL), "--audit", "1.5", "--prompt", "x", "--no-mdns"]) == 2
    assert "--audit 1.5" in capsys.readouterr().err


def test_an_agreeing_answer_needs_no_hashing_and_a_damaged_slab_of_ours_bans_nobody(
    tmp_path, monkeypatch, caplog
):
    """From a shard directory the coordinator hashes its own slab files only when an answer differs from
    its own: agreeing answers cost no SHA-256; a difference that comes from a damaged file of ours is no
    ban (and that slab checks nothing more); one from the node, against files that hold, is."""
    from swarm.compute.slabs import load_slabs
    from swarm.compute.store import ExpertStore
    from swarm.sharding import slabs

    shard_dir = tmp_path / "m.swarm"
    shard_model(MODEL, shard_dir)
    honest = Auditor(ExpertStore(load_slabs(MODEL).slabs), "native", torch.float32, rate=0.0)
    damage(shard_dir, 0, [0])
    auditor = Auditor(
        ExpertStore(load_slabs(shard_dir, verify=False).slabs), "native", torch.float32, rate=1.0,
        shard_dir=shard_dir, seed=1, background=False,
    )  # fmt: skip
    hashed: list[str] = []
    check = slabs.check_slab_file
    monkeypatch.setattr(slabs, "check_slab_file", lambda d, e: hashed.append(e.path) or check(d, e))
    x = torch.randn(3, 256)

    right = honest.expected(1, [0, 1], [2, 1], x)
    assert torch.equal(auditor.answered("a", 1, [0, 1], [2, 1], x, right), right)
    assert hashed == [] and auditor.report.audits == 1 and auditor.settle() is Verdict.SETTLED

    right0 = honest.expected(0, [0, 1], [2, 1], x)  # the node is right; our slab 0:0 is not
    with caplog.at_level("WARNING", logger="swarm.coordinator.checks.audit"):
        assert torch.equal(auditor.answered("a", 0, [0, 1], [2, 1], x, right0), right0)
    assert not auditor.report.banned and auditor.settle(force=True) is Verdict.SETTLED
    assert "cannot audit with slab 0:0" in caplog.text
    assert not auditor.holds(0, [0]) and auditor.holds(0, [1])

    wrong = right.clone()
    wrong[2, 5] += 1e-3
    auditor.answered("b", 1, [0, 1], [2, 1], x, wrong)
    assert auditor.is_banned("b") and auditor.settle() is Verdict.CAUGHT


def test_a_call_of_many_experts_is_checked_on_a_random_few_and_forced_audits_share_two_threads(monkeypatch):
    """A prompt's call holds a node's share of every expert of a layer: an audit checks one row of each of
    at most AUDIT_EXPERTS of them, drawn at random, so a node wrong on one expert of the call is still caught
    within a few audits. A forced settle audits the open nodes on this thread and hands the others to the
    audit thread (which may or may not get to them first: it runs at idle priority), each audit once."""
    import threading

    from swarm.compute.slabs import load_slabs
    from swarm.compute.store import ExpertStore
    from swarm.coordinator.checks import audit

    monkeypatch.setattr(audit, "AUDIT_EXPERTS", 2)  # the fixture has 8 experts a layer
    auditor = Auditor(ExpertStore(load_slabs(MODEL).slabs), "native", torch.float32, rate=1.0, seed=3,
                      background=False)  # fmt: skip
    checked: list[tuple[list[int], str]] = []
    expected = auditor.expected

    def recording(layer, ids, counts, rows):  # noqa: ANN001, ANN202
        checked.append((list(ids), threading.current_thread().name))
        return expected(layer, ids, counts, rows)

    experts, counts = list(range(8)), [2] * 8
    x = torch.randn(16, 256)
    right = expected(0, experts, counts, x)
    monkeypatch.setattr(auditor, "expected", recording)
    assert auditor.answered("a", 0, experts, counts, x, right) is right
    assert len(checked) == 1 and len(checked[0][0]) == 2 and len(set(checked[0][0])) == 2

    wrong = right.clone()
    wrong[10:12] += 1e-3  # expert 5's rows only
    audits = 0
    while not auditor.is_banned("b"):
        audits += 1
        assert audits <= 30, "a node wrong on one expert of eight was never caught"
        auditor.answered("b", 0, experts, counts, x, wrong)
    sampled = [ids for ids, _ in checked if len(ids) == 2]  # (then the whole call, recomputed for the ban)
    assert len(sampled) == audits + 1 and 5 in sampled[-1] and all(5 not in ids for ids in sampled[1:-1])

    aside = Auditor(ExpertStore(load_slabs(MODEL).slabs), "native", torch.float32, rate=0.0, seed=3)
    try:
        checked.clear()
        monkeypatch.setattr(aside, "expected", recording)
        for node in ("n1", "n2", "n3"):
            aside.answered(node, 0, [0, 1], [1, 1], x[:2], expected(0, [0, 1], [1, 1], x[:2]))
        assert aside.settle() is Verdict.OPEN and aside.settle(force=True) is Verdict.SETTLED
        threads = [name for _, name in checked]
        assert len(threads) == 3 and threads.count(threading.current_thread().name) >= 2, threads
        assert aside.report.audits == 3
    finally:
        aside.close()


def test_the_audit_thread_takes_idle_time_and_a_forced_settle_never_waits_on_it(monkeypatch):
    """Audits aside run at the idle scheduling priority (Linux), so they take the cores the model and the
    nodes leave free. A busy machine may give such a thread nothing: a forced settle then does itself the
    audits the thread has not started, and one it is stuck in (after TAKE_OVER seconds); a call checked
    twice that way counts once when both pass."""
    import os
    import sys
    import threading
    import time

    from swarm.compute.slabs import load_slabs
    from swarm.compute.store import ExpertStore
    from swarm.coordinator.checks import audit

    auditor = Auditor(ExpertStore(load_slabs(MODEL).slabs), "native", torch.float32, rate=1.0, seed=2)
    expected = auditor.expected
    running, release = threading.Event(), threading.Event()
    checked: list[str] = []
    policies: list[int] = []

    def stuck_aside(layer, ids, counts, rows):  # noqa: ANN001, ANN202
        name = threading.current_thread().name
        checked.append(name)
        if name.startswith("swarm-audit"):
            if sys.platform.startswith("linux"):
                policies.append(os.sched_getscheduler(0))
            running.set()
            release.wait(30)
        return expected(layer, ids, counts, rows)

    x = torch.randn(2, 256)
    right = expected(0, [0, 1], [1, 1], x)
    monkeypatch.setattr(auditor, "expected", stuck_aside)
    try:
        auditor.answered("a", 0, [0, 1], [1, 1], x, right)
        assert running.wait(30)  # the audit thread is in a's audit and does not come out
        auditor.answered("b", 1, [2, 3], [1, 1], x, expected(1, [2, 3], [1, 1], x))  # queued behind it
        started = time.monotonic()
        assert auditor.settle(force=True) is Verdict.SETTLED
        assert time.monotonic() - started < 10 * audit.TAKE_OVER + 5
        me = threading.current_thread().name
        assert checked.count(me) == 2 and auditor.report.audits == 2  # a's taken over, b's never started
    finally:
        release.set()
        auditor.close()
    assert len(checked) == 3 and auditor.report.audits == 2  # a's first run ended late: counted once
    assert policies == ([os.SCHED_IDLE] if sys.platform.startswith("linux") else [])


def test_a_forced_settle_checks_the_ready_experts_of_each_open_node_or_one(monkeypatch):
    """The model waits for a forced settle, so its audit of each open node's last call checks one row of
    each expert whose repacked copy is here already, or of one expert when none is, rather than copy several
    cold slabs while the model waits. A node wrong on every answer is still caught by it, before anything
    it shaped is settled."""
    from swarm.compute.slabs import load_slabs
    from swarm.compute.store import ExpertStore

    auditor = Auditor(ExpertStore(load_slabs(MODEL).slabs, stacked=False), "native", torch.float32, rate=0.0,
                      seed=5, background=False)  # fmt: skip
    checked: list[tuple[int, list[int], list[int]]] = []
    expected = auditor.expected

    def recording(layer, ids, counts, rows):  # noqa: ANN001, ANN202
        checked.append((layer, list(ids), list(counts)))
        return expected(layer, ids, counts, rows)

    x = torch.randn(6, 256)
    ids, counts = [1, 3, 6], [2, 2, 2]
    right = expected(0, ids, counts, x)
    assert [e for e in range(8) if auditor.store.ready(0, e)] == ids  # what the answer above used
    monkeypatch.setattr(auditor, "expected", recording)
    auditor.answered("a", 0, ids, counts, x, right)
    assert auditor.settle() is Verdict.OPEN and auditor.settle(force=True) is Verdict.SETTLED
    assert checked == [(0, ids, [1, 1, 1])]  # all three ready: one row of each

    checked.clear()
    monkeypatch.setattr(auditor.store, "ready", lambda layer, e: (layer, e) == (0, 3))
    for _ in range(4):
        auditor.answered("a", 0, ids, counts, x, right)
        assert auditor.settle(force=True) is Verdict.SETTLED
    assert checked == [(0, [3], [1])] * 4

    checked.clear()
    monkeypatch.setattr(auditor.store, "ready", lambda layer, e: False)
    for _ in range(12):
        auditor.answered("a", 0, ids, counts, x, right)
        assert auditor.settle(force=True) is Verdict.SETTLED
    assert all(len(e) == 1 and e[0] in ids and c == [1] for _, e, c in checked) and len(checked) == 12
    assert len({e[0] for _, e, _ in checked}) > 1  # none ready: one of the call's experts, at random

    auditor.answered("b", 0, ids, counts, x, right + 1e-3)  # wrong on every row
    assert auditor.settle(force=True) is Verdict.CAUGHT and auditor.is_banned("b")


def test_a_call_checked_twice_is_caught_by_either_check():
    """A settle that takes an audit over from the audit thread may draw other rows than the thread does:
    when the thread's late check finds a wrong row that the settle's did not, the node is still banned."""
    import threading

    from swarm.compute.slabs import load_slabs
    from swarm.compute.store import ExpertStore

    banned: list[str] = []
    auditor = Auditor(
        ExpertStore(load_slabs(MODEL).slabs), "native", torch.float32, rate=1.0, seed=4, on_ban=banned.append
    )
    running, release = threading.Event(), threading.Event()
    expected = auditor.expected

    def draw(call, forced=False):  # noqa: ANN001, ANN202 - the thread checks expert 1's row, a settle expert 0's
        return [(1, 1)] if threading.current_thread().name.startswith("swarm-audit") else [(0, 0)]

    def stuck_aside(layer, ids, counts, rows):  # noqa: ANN001, ANN202
        if threading.current_thread().name.startswith("swarm-audit"):
            running.set()
            release.wait(30)
        return expected(layer, ids, counts, rows)

    x = torch.randn(2, 256)
    wrong = expected(0, [0, 1], [1, 1], x)
    wrong[1, 5] += 1e-3  # expert 1's row only
    auditor._rows_to_check = draw
    auditor.expected = stuck_aside
    try:
        auditor.answered("a", 0, [0, 1], [1, 1], x, wrong)
        assert running.wait(30)
        assert auditor.settle(force=True) is Verdict.SETTLED and not banned  # the settle's row was right
    finally:
        release.set()
        auditor.close()
    assert (
        banned == ["a"] and auditor.settle() is Verdict.CAUGHT
    )  # the thread's late check (close waits for it)


@pytest.fixture()
def busy_cores():
    """Three processes spinning beside the test on the machine's cores (CI has 2): the load under which
    audits that run at idle priority get almost nothing and every verdict comes at the forced settle."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    yield
    for p in procs:
        p.kill()
        p.wait()


def _nonfinite_weights(shard_dir, layer: int, experts) -> int:
    n = 0
    for e in experts:
        for t in open_gguf(shard_dir / "experts" / str(layer) / f"{e}.gguf").tensors:
            n += int((~np.isfinite(np.asarray(t.data).view(np.float16))).sum())
    return n


@pytest.mark.slow
def test_an_honest_node_is_not_banned_for_rows_a_liar_made_nan_on_a_busy_machine(tmp_path, busy_cores):
    """A liar whose damaged F16 slabs hold infinities and NaNs (bit rot does that) makes the hidden states of
    every later layer NaN; the honest node's answers for those rows are NaN too, bit for bit what the
    coordinator computes, and must not be called different (NaN != NaN for torch.equal: on a busy machine
    the settle's checks of the honest node's last calls banned it, then every node). The liar is caught
    at layer 0 before the logits are released, and they equal in-process bit for bit, every time."""
    spec = preset(
        "qwen2moe-tiny", n_layers=4, n_embd=96, n_expert=60, n_expert_used=4, expert_ff=16, shared_ff=64,
        n_head=4, head_dim=24, experts_type="F16",
    )  # fmt: skip
    honest_dir, liar_dir = tmp_path / "honest.swarm", tmp_path / "liar.swarm"
    shard_model(synthesize(tmp_path / "m.gguf", spec), honest_dir)
    shutil.copytree(honest_dir, liar_dir)
    nodes = start_nodes(
        [(honest_dir, []), (liar_dir, ["--no-verify"])], tmp_path / "nodes", env={KEY_ENV: KEY_TEXT}
    )
    honest, liar = nodes
    local = open_engine(honest_dir, EngineConfig(local=True, device="cpu"))
    tokens = list(range(1, 13))
    expect = forward_one(local.model, tokens, local.model.new_state(), "cpu")
    half = range(30)
    try:
        for rep in range(2):
            swarm = _swarm(honest_dir, rate=DEFAULT_AUDIT_RATE, seed=rep, peers=(honest.address, liar.address))
            try:
                damage(liar_dir, 0, list(half))  # after its admission probes: it turns liar now
                assert _nonfinite_weights(liar_dir, 0, half) > 0  # what makes the rows after it NaN
                got = checked_logits(swarm.model, tokens, swarm.model.new_state(), "cpu", swarm.checker)
                assert set(swarm.checker.report.banned) == {liar.address}, swarm.checker.report.banned
                assert torch.equal(got, expect), f"rep {rep}: max diff {float((got - expect).abs().max())}"
            finally:
                swarm.close()
                damage(liar_dir, 0, list(half))  # (the same flips again: the files as they were)
    finally:
        local.close()
        stop_nodes(nodes)
