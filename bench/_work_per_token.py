"""The coordinator's own work per token, counted rather than timed: run by bench/two_trees.py with each tree's
python, in that tree (so both trees count the same way, whatever their module names).

    <tree>/.venv/bin/python <this file> WORKDIR {'in process','4 nodes'}

A `swarm run`-shaped prefill (64 tokens) and greedy decode (32 tokens) of bench/decode's qwen35moe model, in
process or through 4 loopback nodes, under cProfile: the coordinator's Python function calls per token (torch's
own calls among them). Calls do not depend on how busy the machine is, so two trees doing the same work show the
same counts where their timings drift apart under load (CPU time does not: torch's threads spin while they
wait, longer on a busy machine). One configuration a process (a second profiler in the same process sees
nothing); prints one JSON object.
"""

from __future__ import annotations

import cProfile
import json
import pstats
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path.cwd() / "bench"))

import _engines  # noqa: E402
import _timing  # noqa: E402
from _models import prepare  # noqa: E402

PROMPT, DECODE = 64, 32


def counts(profile: cProfile.Profile) -> tuple[int, int]:
    """(every Python-level call, the calls into torch among them)."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    torch_calls = sum(
        v[1] for (f, _, name), v in stats.items() if "torch" in name or "/torch/" in f or "TensorBase" in name
    )
    return sum(v[1] for v in stats.values()), torch_calls


def profiled(figures: dict[str, float], where: str) -> Callable[..., Iterator[int]]:
    """A stand-in for bench/_timing's generate that counts its first token (the prompt) and the rest apart."""
    inner = _timing.generate

    def generate(*args: Any, **kwargs: Any) -> Iterator[int]:
        tokens = inner(*args, **kwargs)
        for phase, per in (("prompt", PROMPT), ("decode", DECODE - 1)):
            profile = cProfile.Profile()
            profile.enable()
            got = [next(tokens)] if phase == "prompt" else list(tokens)
            profile.disable()
            calls, torch_calls = counts(profile)
            figures[f"{where}: Python calls per {phase} token"] = calls / per
            figures[f"{where}: torch calls per {phase} token"] = torch_calls / per
            yield from got

    return generate


def main() -> int:
    workdir, where = Path(sys.argv[1]), sys.argv[2]
    gguf, shard_dir = prepare("qwen35moe", 4, workdir)
    figures: dict[str, float] = {}
    _timing.generate = profiled(figures, where)  # type: ignore[assignment]
    if where == "in process":
        _engines.run_inprocess(gguf, PROMPT, DECODE, 2, "native")
    else:
        with tempfile.TemporaryDirectory(prefix="work-per-token-") as d:
            _engines.run_swarm(shard_dir, 4, 1, PROMPT, DECODE, Path(d), 2, "native")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
