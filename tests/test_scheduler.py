"""The serve scheduler without HTTP: how it groups requests into passes (the tiny fixture model, in process)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES

from swarm.coordinator.config import EngineConfig
from swarm.coordinator.decode.one import SamplingParams, generate
from swarm.coordinator.decode.passes import Entry
from swarm.coordinator.engine import open_engine
from swarm.coordinator.serve import scheduler as sched
from swarm.coordinator.serve.slots import CHECKPOINT_BEFORE_END
from swarm.coordinator.serve.startup import warm_batches

MODEL = FIXTURES / "qwen35moe-quant" / "model-q4_k_m.gguf"


def _request(prompt: list[int], done: threading.Event, out: list[int]) -> sched.Request:
    return sched.Request(
        prompt,
        SamplingParams(max_tokens=3),
        on_tokens=out.extend,
        on_done=lambda _: done.set(),
    )


@pytest.mark.parametrize("gap", [0.5, 0.0])
def test_requests_that_come_together_to_an_idle_engine_are_read_in_one_pass(
    gap: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A wide gap here so that a loaded machine cannot split the group; with no gap each is read as it comes.
    monkeypatch.setattr(sched, "ADMIT_GAP", gap)
    monkeypatch.setattr(sched, "ADMIT_WINDOW", 3 * gap)
    engine = open_engine(Path(MODEL), EngineConfig(local=True, device="cpu"))
    s = sched.Scheduler(engine.model, torch.device("cpu"), None, parallel=4, ctx_size=256, max_queue=4)
    passes: list[int] = []  # prompts read in each pass
    step = s.core.passes.step

    def counting(entries: list[Entry]) -> None:
        passes.append(sum(1 for e in entries if e.tokens is not None))
        step(entries)

    monkeypatch.setattr(s.core.passes, "step", counting)
    s.start()
    try:
        done = [threading.Event() for _ in range(3)]
        outs: list[list[int]] = [[] for _ in range(3)]
        for i in range(3):
            # longer than CHECKPOINT_BEFORE_END: each keeps a checkpoint before its end
            s.submit(_request([10 + i, 30 + i, *range(20, 20 + CHECKPOINT_BEFORE_END)], done[i], outs[i]))
            if not gap:  # the next one comes once this one's prompt is being read (a sleep is too short on
                deadline = time.monotonic() + 60  # a loaded machine: two came while a pass ran, read as one)
                while sum(1 for n in passes if n) <= i and time.monotonic() < deadline:
                    time.sleep(0.01)
            else:
                time.sleep(0.2)  # the engine is awake before the next one comes
        assert all(d.wait(60) for d in done)
    finally:
        s.stop()
        engine.close()
    assert all(len(o) == 3 for o in outs)
    prompt_passes = [n for n in passes if n]
    if gap:
        # every prompt whole in one pass: the checkpoint before a prompt's end is kept within it (Entry.mark)
        assert prompt_passes == [3]
    else:
        assert prompt_passes == [1, 1, 1]


def test_every_batch_size_is_built_at_start_and_a_real_step_builds_nothing() -> None:
    """warm_batches (what `swarm serve` runs before it listens) steps 1..n new sequences once: a decode step of
    sequences that have read prompts then finds every graph it needs kept (it builds none), for each batch
    size up to n; one size beyond n does build its own."""
    from swarm.compute import graph

    engine = open_engine(Path(MODEL), EngineConfig(local=True, device="cpu"))
    try:
        m = engine.model
        warm_batches(m, 3, torch.device("cpu"))
        with torch.inference_mode():
            for b in (1, 2, 3, 4):
                states = [m.new_state() for _ in range(b)]
                # prompts first (their graphs are their own)
                m(torch.arange(5, 5 + 6 * b), states, [6] * b, last_only=True)
                kept = set(graph._cache._graphs)
                m(torch.arange(40, 40 + b), states, [1] * b, last_only=True)  # a decode step
                new = set(graph._cache._graphs) - kept
                assert (not new) if b <= 3 else new, (b, new)
    finally:
        engine.close()


def test_the_warm_up_runs_on_the_engine_thread_and_its_error_reaches_start() -> None:
    """`swarm serve` warms the model up on the thread that then runs every pass (ggml's per-thread buffers and
    OpenMP's team are the passes' own); start() returns once it is done, and raises what it raised."""
    engine = open_engine(Path(MODEL), EngineConfig(local=True, device="cpu"))
    try:
        ran: list[str] = []
        s = sched.Scheduler(engine.model, torch.device("cpu"), None, parallel=2, ctx_size=256, max_queue=4)
        s.start(lambda: (time.sleep(0.3), ran.append(threading.current_thread().name)))  # start() waits
        try:
            assert ran == [s._thread.name] and s._thread.is_alive()
            done, out = threading.Event(), []
            s.submit(_request([5, 6, 7, 8], done, out))
            assert done.wait(60) and len(out) == 3  # and then it serves
        finally:
            s.stop()

        def broken() -> None:
            raise MemoryError("no room for the warm-up pass")

        s = sched.Scheduler(engine.model, torch.device("cpu"), None, parallel=2, ctx_size=256, max_queue=4)
        with pytest.raises(MemoryError, match="warm-up pass"):
            s.start(broken)
        assert not s._thread.is_alive()
    finally:
        engine.close()


class _Known:
    """Drafts for several conversations: each sequence's next k tokens of its known text (right), or of that
    text with every token moved to another id (wrong) for the conversations in `wrong`."""

    def __init__(self, texts: list[list[int]], wrong: set[int], k: int = 3) -> None:
        self.texts, self.wrong, self.k = texts, wrong, k

    def __call__(self, tokens: Sequence[int]) -> list[int]:
        n = len(tokens)
        for i, text in enumerate(self.texts):
            if list(tokens) == text[:n]:
                nxt = text[n : n + self.k]
                return [(t + 1) % 500 + 3 for t in nxt] if i in self.wrong else nxt
        return []


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_four_conversations_with_drafts_each_get_their_text_alone(temperature: float) -> None:
    """Four requests decode together with drafts in their passes (two all right, two all wrong, their windows
    of different lengths in one pass): each gets the text it gets alone without drafts, token for token.
    Then each conversation is sent again with a new turn: it continues from the state its windows left (the
    slot's held state, taken back to the last kept row) and gets the text it gets alone."""
    engine = open_engine(Path(MODEL), EngineConfig(local=True, device="cpu"))
    prompts = [[5 + i, 9, 40 + 3 * i, *range(60, 60 + 4 * i)] for i in range(4)]
    params = [SamplingParams(max_tokens=14, temperature=temperature, seed=11 + i) for i in range(4)]
    try:
        alone = [list(generate(engine.model, p, q, "cpu")) for p, q in zip(prompts, params, strict=True)]
        known = _Known([p + a for p, a in zip(prompts, alone, strict=True)], wrong={1, 3})
        s = sched.Scheduler(
            engine.model, torch.device("cpu"), None, parallel=4, ctx_size=256, max_queue=4, drafter=known
        )
        s.start()
        try:
            done = [threading.Event() for _ in range(4)]
            outs: list[list[int]] = [[] for _ in range(4)]
            for i in range(4):
                s.submit(sched.Request(prompts[i], params[i], outs[i].extend, lambda _, d=done[i]: d.set()))
            assert all(d.wait(120) for d in done)
            assert outs == alone
            t = s.draft_totals
            assert t["drafted"] > 0 and 0 < t["accepted"] < t["drafted"]
            assert t["tokens"] > t["steps"]  # the right drafts made several tokens a pass
            again = [p + a + [77, 78, 79] for p, a in zip(prompts, alone, strict=True)]
            want = [list(generate(engine.model, p, q, "cpu")) for p, q in zip(again, params, strict=True)]
            known.texts = [p + w for p, w in zip(again, want, strict=True)]
            done = [threading.Event() for _ in range(4)]
            outs = [[] for _ in range(4)]
            reqs = [
                sched.Request(again[i], params[i], outs[i].extend, lambda _, d=done[i]: d.set())
                for i in range(4)
            ]
            for r in reqs:
                s.submit(r)
            assert all(d.wait(120) for d in done)
            assert outs == want
            assert all(r.cached >= len(p) + len(a) - 1 for r, p, a in zip(reqs, prompts, alone, strict=True))
        finally:
            s.stop()
    finally:
        engine.close()
