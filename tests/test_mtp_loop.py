"""The MTP head's drafts in the decode loop (generate with an MTPDrafter): for the fixture prompts they are the
drafts llama.cpp's own draft-mtp loop makes (tests/fixtures/mtp, llama.cpp de3ff815), and the text is the text
without drafts, greedy and sampled, in process and through nodes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import FIXTURES

from swarm.coordinator.config import EngineConfig
from swarm.coordinator.decode.one import GenerationStats, SamplingParams, generate
from swarm.coordinator.drafts.mtp import MTPDrafter
from swarm.coordinator.engine import open_engine

MTP = FIXTURES / "mtp"


class Recording(MTPDrafter):
    """An MTPDrafter that keeps the drafts it gives the loop for the (one) sequence."""

    seen: list[tuple[int, ...]]

    def step(self, *args, **kw):  # noqa: ANN002, ANN003, ANN201
        out = super().step(*args, **kw)
        self.seen.append(out[0])
        return out


@pytest.mark.parametrize("variant", ["f32"])
def test_the_loops_drafts_are_llama_cpps(variant: str) -> None:
    """(f32: on the bf16 file llama.cpp rounds activations to bf16 and its greedy text parts from ours at a
    near-tie; its drafts are compared row by row, teacher-forced, in test_mtp.py.) llama.cpp's loop holds the prompt's last token back and drafts from it before its first target token;
    ours reads the whole prompt and drafts from the first sampled token: from there on, step for step, the
    drafts are the ones llama.cpp drafted (3 per step, none accepted: random weights), and the tokens its."""
    ref = np.load(MTP / f"qwen35moe-tiny-{variant}.npz")
    meta = json.loads(str(ref["meta"]))
    engine = open_engine(
        FIXTURES / "qwen35moe-tiny" / f"model-{variant}.gguf", EngineConfig(local=True, device="cpu", mtp_head=True))
    try:
        for i in range(4):
            tokens = ref[f"tokens_{i}"].tolist()
            n = int(ref[f"spec_pos0_{i}"][0]) + 1  # the prompt's length
            drafter = Recording(engine.mtp_head, 3)
            drafter.seen = []
            stats = GenerationStats()
            got = list(generate(engine.model, tokens[:n], SamplingParams(max_tokens=meta["n_gen"]), "cpu", stats,
                                mtp_drafter=drafter))  # fmt: skip
            assert got == tokens[n:], f"prompt {i}"
            spec = [tuple(t for t in row if t >= 0) for row in ref[f"spec_draft_{i}"].tolist()]
            steps = len(drafter.seen) - 1  # the last step's drafts are never checked (max_tokens reached)
            # near the end llama.cpp drafts no more than the tokens still to make: compare what it drafted
            ours = [d[: len(s)] for d, s in zip(drafter.seen[:steps], spec[1:], strict=False)]
            assert ours == spec[1 : 1 + steps] and all(spec[1 : 1 + steps]), f"prompt {i}"
            assert sum(len(s) == 3 for s in spec[1 : 1 + steps]) >= steps - 3
            assert stats.extra["accepted"] == 0 == int(ref[f"spec_n_accepted_{i}"].sum())
    finally:
        engine.close()


def test_mtp_drafts_give_the_text_without_drafts_sampled() -> None:
    engine = open_engine(FIXTURES / "qwen35moe-tiny" / "model-f32.gguf", EngineConfig(local=True, device="cpu", mtp_head=True))
    try:
        prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20] * 2
        for params in (SamplingParams(max_tokens=10, temperature=0.9, seed=4), SamplingParams(max_tokens=6)):
            plain = list(generate(engine.model, prompt, params, "cpu"))
            stats = GenerationStats()
            assert (
                list(generate(engine.model, prompt, params, "cpu", stats, mtp_drafter=MTPDrafter(engine.mtp_head, 2)))
                == plain
            )
            assert stats.extra["windows"] > 0 and stats.extra["drafted"] > 0
    finally:
        engine.close()


def test_swarm_run_with_mtp_and_on_a_file_without_a_head(capsys: pytest.CaptureFixture[str]) -> None:
    """`swarm run --mtp 2` drafts with the head and reports the drafts; on a file without an MTP block it says
    so once and answers the same text as without the flag."""
    from swarm.coordinator.cli import main

    tiny = str(FIXTURES / "qwen35moe-tiny" / "model-f32.gguf")
    assert main(["run", tiny, "--local", "--prompt", "one two three", "--max-tokens", "8", "--mtp", "2"]) == 0
    with_mtp = capsys.readouterr()
    assert (
        main(["run", tiny, "--local", "--prompt", "one two three", "--max-tokens", "8", "--draft", "none"])
        == 0
    )
    plain = capsys.readouterr()
    assert with_mtp.out == plain.out and with_mtp.out.strip()
    assert "drafts: 0 of " in with_mtp.err and "tokens per decode pass" in with_mtp.err
    quant = str(FIXTURES / "qwen35moe-quant" / "model-q4_k_m.gguf")
    assert main(["run", quant, "--local", "--prompt", "one two", "--max-tokens", "4", "--mtp", "2"]) == 0
    out = capsys.readouterr()
    assert out.err.count("--mtp: the file has no MTP block") == 1 and out.out.strip()


def test_four_conversations_with_mtp_drafts_in_serve_passes() -> None:
    """The serve scheduler with the head's drafts: four conversations at once each get their text alone;
    sent again with a new turn, each continues from its slot's state (trunk and head) to the same text."""
    import threading

    import torch

    from swarm.coordinator.serve import scheduler as sched

    engine = open_engine(FIXTURES / "qwen35moe-tiny" / "model-f32.gguf", EngineConfig(local=True, device="cpu", mtp_head=True))
    prompts = [[5 + i, 9, 40 + 3 * i, *range(60, 60 + 4 * i)] for i in range(4)]
    params = [SamplingParams(max_tokens=10, temperature=0.7 * (i % 2), seed=1 + i) for i in range(4)]
    try:
        s = sched.Scheduler(engine.model, torch.device("cpu"), None, 4, 256, 4, mtp_drafter=MTPDrafter(engine.mtp_head, 2))
        s.start()
        alone: list[list[int]] = []
        try:
            for turn in range(2):
                if turn:
                    prompts = [p + a + [70, 71] for p, a in zip(prompts, alone, strict=True)]
                alone = [
                    list(generate(engine.model, p, q, "cpu")) for p, q in zip(prompts, params, strict=True)
                ]
                done = [threading.Event() for _ in range(4)]
                outs: list[list[int]] = [[] for _ in range(4)]
                reqs = [sched.Request(prompts[i], params[i], outs[i].extend, lambda _, d=done[i]: d.set())
                        for i in range(4)]  # fmt: skip
                for r in reqs:
                    s.submit(r)
                assert all(d.wait(120) for d in done)
                assert outs == alone, f"turn {turn}"
                assert not turn or all(r.cached > len(p) // 2 for r, p in zip(reqs, prompts, strict=True))
        finally:
            s.stop()
        assert s.draft_totals["drafted"] > 0
    finally:
        engine.close()
