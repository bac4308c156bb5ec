"""The coordinator's heap policy (swarm.node.malloc) on real passes: memory a pass frees is found again by the
next one, where glibc's defaults hand it back and fault its pages in again; and `swarm serve`'s warm-up pass
(scheduler.warm_prompts) maps the memory of the largest prompt pass before the first request needs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")

# Each in a fresh process: mallopt is process-wide and the test process's heap has a history.
PASSES = r"""
import resource, sys
if sys.argv[2] == "keep":
    from swarm.node.malloc import keep_freed_memory
    assert keep_freed_memory()
import torch
from swarm.coordinator.engine import open_engine
from swarm.node.kernels import set_threads

set_threads(2)
engine = open_engine(sys.argv[1], local=True, device="cpu")
m = engine.model
faults = []
with torch.inference_mode():
    for i in range(3):  # 8 prompts of 64 tokens read in one pass, then 4 decode steps of the 8
        states = [m.new_state() for _ in range(8)]
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        m(torch.arange(8 * 64) % 250 + 5 + i, states, [64] * 8, last_only=True)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        for _ in range(4):
            m(torch.arange(8) + 7, states, [1] * 8, last_only=True)
engine.close()
print(*faults)
"""

FIRST_PASS = r"""
import resource, sys
from swarm.node.malloc import keep_freed_memory
assert keep_freed_memory()
import torch
from swarm.coordinator.engine import open_engine
from swarm.coordinator.serve.scheduler import warm_prompts
from swarm.node.kernels import set_threads

set_threads(2)
engine = open_engine(sys.argv[1], local=True, device="cpu")
m = engine.model
with torch.inference_mode():
    if sys.argv[2] == "warm":
        warm_prompts(m, 8, torch.device("cpu"))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    m(torch.arange(8 * 64) % 250 + 5, [m.new_state() for _ in range(8)], [64] * 8, last_only=True)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
engine.close()
"""


def _run(script: str, *args: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return [int(f) for f in out.stdout.split()]


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Qwen3.6-35B layer width (D 2048, expert F 512, 8 of them per token), 2 layers of 16 experts."""
    from swarm.sharding.synth import preset, synthesize

    path = tmp_path_factory.mktemp("malloc") / "wide.gguf"
    return synthesize(path, preset("qwen3.6-35b-a3b", n_layers=2, n_expert=16, experts_type="Q4_K"))


@pytest.mark.slow
def test_a_prompt_pass_finds_the_memory_the_one_before_it_freed(wide_model: Path) -> None:
    """Prompt passes with decode steps between them: with glibc's defaults each later pass faults thousands of
    pages in again (seen 7,600-9,500 from the third on), with the policy a few (0-800)."""
    default = _run(PASSES, str(wide_model), "default")
    kept = _run(PASSES, str(wide_model), "keep")
    assert default[2] > 3000, default
    assert kept[2] < default[2] / 4, (kept, default)


@pytest.mark.slow
def test_the_serve_warm_up_maps_the_first_prompt_pass(wide_model: Path) -> None:
    """8 prompts of 64 tokens read in one pass fault tens of thousands of pages in as the process's first such
    pass; after warm_prompts, a few."""
    (cold,) = _run(FIRST_PASS, str(wide_model), "cold")
    (warm,) = _run(FIRST_PASS, str(wide_model), "warm")
    assert cold > 20_000, cold
    assert warm < cold / 10, (warm, cold)
