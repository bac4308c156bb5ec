"""Start `swarm node` processes on this machine and stop them again (tests, benchmarks, `swarm demo`).

    nodes = start_nodes([("model.gguf", ["--experts", "0-3"]), ("model.gguf", ["--experts", "4-7"])], workdir)
    ... NodeClient(nodes[0].address) ...
    for n in nodes: n.stop()

Each node runs `python -m swarm.coordinator.cli node --port 0 --ready-file ... SOURCE` with its output in
a log file under `workdir` (no pipes to fill up); start_nodes spawns them all first and then waits, so
their start-up overlaps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class LocalNode:
    process: subprocess.Popen
    ready_file: Path
    log_file: Path
    ready: dict[str, Any] = field(default_factory=dict)
    terminated: bool = False
    what: str = "node"

    @property
    def address(self) -> str:
        return str(self.ready["address"])

    @property
    def port(self) -> int:
        return int(self.ready["port"])

    @property
    def fingerprint(self) -> str:
        return str(self.ready["fingerprint"])

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, timeout: float) -> LocalNode:
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"swarm {self.what} exited with code {self.process.returncode} before serving:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"swarm {self.what} not serving after {timeout} s:\n{self.log_tail()}")
            time.sleep(0.02)
        self.ready = json.loads(self.ready_file.read_text())
        return self

    def wait_prepared(self, timeout: float) -> LocalNode:
        """Wait until the node's start-up pass has hashed and readied every slab (its ready file says so)."""
        deadline = time.monotonic() + timeout
        while not json.loads(self.wait_ready(timeout).ready_file.read_text()).get("prepared"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"swarm {self.what} did not prepare its slabs in {timeout} s:\n{self.log_tail()}")
            time.sleep(0.05)
        self.ready = json.loads(self.ready_file.read_text())
        return self

    def terminate(self) -> None:
        """Send SIGTERM once: a second one could land while Python is finalizing, after the node's handler is
        gone, and kill it mid-goodbye."""
        if not self.terminated and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.terminated = True

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM (clean goodbye), then SIGKILL if it has not exited after `timeout` s; the exit code."""
        if self.process.poll() is None:
            self.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


# How a launched process runs `swarm`: this package's CLI under the launcher's Python.
SWARM_CLI: tuple[str, ...] = ("-m", "swarm.coordinator.cli")


def spawn_node(
    source: str | Path,
    args: Sequence[str],
    workdir: Path,
    name: str,
    env: dict[str, str] | None = None,
    program: Sequence[str] = SWARM_CLI,
) -> LocalNode:
    """Start one node process (not waiting for it); its ready file and log live in workdir.

    Unless `args` says otherwise the node computes on one thread: the nodes a tool starts share this
    machine's cores with each other and with the launcher, and ggml's threads wait for each other at every
    matmul, which on an oversubscribed machine costs a scheduler slice each time."""
    threads = [] if "--threads" in args else ["--threads", "1"]
    return spawn_swarm(["node", str(source), *threads, *args], workdir, name, env, program)


def spawn_swarm(
    command: Sequence[str],
    workdir: Path,
    name: str,
    env: dict[str, str] | None = None,
    program: Sequence[str] = SWARM_CLI,
) -> LocalNode:
    """Start `swarm COMMAND ...` (a node, a server) with `--port 0`, a ready file and a log in workdir, and
    `--exit-with-parent`: a launcher killed outright (OOM, SIGKILL) must not leave processes behind.
    `program`: what runs the CLI under this Python (a benchmark's wrapper script instead of the package's)."""
    workdir.mkdir(parents=True, exist_ok=True)
    ready = workdir / f"{name}.ready.json"
    log = workdir / f"{name}.log"
    ready.unlink(missing_ok=True)
    sub, *rest = command
    cmd = [sys.executable, *program, sub, "--port", "0", "--ready-file", str(ready), "--exit-with-parent",
           *rest]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
    return LocalNode(proc, ready, log, what=sub)


def start_nodes(
    specs: Sequence[tuple[str | Path, Sequence[str]]],
    workdir: Path,
    timeout: float = 60.0,
    prefix: str = "node",
    env: dict[str, str] | None = None,
    program: Sequence[str] = SWARM_CLI,
) -> list[LocalNode]:
    """Spawn every (source, extra args) node, then wait until all serve; stops them all if one fails.
    `env` adds to the nodes' environment (a swarm key goes there, never into a command line)."""
    nodes = [
        spawn_node(src, args, workdir, f"{prefix}{i}", env, program) for i, (src, args) in enumerate(specs)
    ]
    try:
        for n in nodes:
            n.wait_ready(timeout)
    except BaseException:
        for n in nodes:
            n.stop()
        raise
    return nodes


def stop_nodes(nodes: Sequence[LocalNode], timeout: float = 10.0) -> list[int]:
    """SIGTERM every node at once (their shutdowns overlap), then wait for each; the exit codes."""
    for n in nodes:
        n.terminate()
    return [n.stop(timeout) for n in nodes]
