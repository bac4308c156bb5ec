"""Start a `swarm serve` process on this machine and stop it again (tests, benchmarks).

    server = spawn_server("model.gguf", ["--local", "--parallel", "4"], workdir).wait_ready(120)
    openai.OpenAI(base_url=server.ready["url"], api_key="-") ...
    server.stop()

The handle is node.launch's (ready file, log file under `workdir`, SIGTERM then SIGKILL).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from swarm.coordinator.cli.spawn import LocalNode, spawn_swarm


def spawn_server(
    source: str | Path,
    args: Sequence[str],
    workdir: Path,
    name: str = "serve",
    env: dict[str, str] | None = None,
) -> LocalNode:
    return spawn_swarm(["serve", str(source), *args], workdir, name, env)
