"""The coordinator's heap policy (swarm.node.malloc) on real passes: a prompt pass of the size of the one before
finds the memory that one freed, where glibc's defaults map it afresh and fault its pages in again; and with
`swarm serve`'s warm-up pass (scheduler.warm_prompts) before it, the first real one finds it too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# A fresh process per policy: mallopt is process-wide and the test process's heap has a history.
PASSES = r"""
import resource, sys
if sys.argv[2] == "keep":
    from swarm.node.malloc import keep_freed_memory
    assert keep_freed_memory()
import torch
from swarm.coordinator.engine import open_engine
from swarm.coordinator.serve.scheduler import warm_prompts
from swarm.node.kernels import set_threads

set_threads(2)
engine = open_engine(sys.argv[1], local=True, device="cpu")
m = engine.model
if sys.argv[2] == "keep":
    warm_prompts(m, 8, torch.device("cpu"))
faults = []
with torch.inference_mode():
    for _ in range(2):  # 8 prompts of 64 tokens, read in one pass
        states = [m.new_state() for _ in range(8)]
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        m(torch.arange(8 * 64) % 250 + 5, states, [64] * 8, last_only=True)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
engine.close()
print(*faults)
"""


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Qwen3.6-35B layer width (D 2048, expert F 512, 8 of them per token), few experts and layers."""
    from swarm.sharding.synth import preset, synthesize

    path = tmp_path_factory.mktemp("malloc") / "wide.gguf"
    return synthesize(path, preset("qwen3.6-35b-a3b", n_layers=2, n_expert=16, experts_type="Q4_K"))


def _faults(model: Path, policy: str) -> list[int]:
    """Minor page faults of each of 2 passes of 8 prompts of 64 tokens in a fresh process: "keep" with the
    heap policy and serve's warm-up pass before them, "default" with neither."""
    out = subprocess.run(
        [sys.executable, "-c", PASSES, str(model), policy], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return [int(f) for f in out.stdout.split()[-2:]]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
@pytest.mark.slow
def test_a_pass_finds_the_memory_the_pass_before_it_freed(wide_model: Path) -> None:
    kept = _faults(wide_model, "keep")
    default = _faults(wide_model, "default")
    assert default[1] > 2000, default  # glibc's defaults: a pass maps and faults megabytes in again
    assert kept[1] < default[1] / 10, (kept, default)  # the policy: a later pass finds its memory
    assert kept[0] < default[0] / 10, (kept, default)  # the warm-up: so does the first
